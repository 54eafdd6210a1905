"""How key / value reach a shard inside shard_map, and how their gradients go back: the
all-gather over the context axes (its transpose a reduce-scatter in kv_grad_reduce_dtype), the
local / remote split of the overlapped path, the document-order arrangement of the gathered
tokens, and the kv heads a tensor-parallel shard takes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvax_plugin.attention.specs import AttentionSpecs, AxisNames, axes_size, axis_name
from kvax_plugin.attention.token_order import from_load_balanced_order

KV_GRAD_REDUCE_CHOICES = ("auto", "float32", "input")


def kv_grad_reduce_dtype(grad_dtype, context_size: int, choice: str = "auto"):
  """The dtype of the cross-shard dk / dv sum over `context_size` shards. choice: "float32",
  "input" (the gradient's dtype), or "auto": the input dtype with two shards (exact: one rounded
  16-bit addition equals float32-then-round), float32 with more."""
  if choice == "float32":
    return jnp.dtype(jnp.float32)
  if choice == "input":
    return jnp.dtype(grad_dtype)
  if context_size <= 2 or jnp.dtype(grad_dtype).itemsize >= 4:
    return jnp.dtype(grad_dtype)
  return jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class KvHeadSelection:
  """Which kv heads tensor-parallel shard t takes from key / value that enter whole: it holds
  query heads [t * local_heads, (t + 1) * local_heads); query head h reads kv head h // group."""

  head_axis: Any
  local_heads: int
  group: int
  kv_heads: int
  shards: int

  def take(self, x: jax.Array) -> jax.Array:
    t = jax.lax.axis_index(self.head_axis)
    if self.kv_heads % self.shards == 0:
      # Whole groups per shard: its K / tp kv heads, consecutive (a GQA problem locally).
      n = self.kv_heads // self.shards
      return jax.lax.dynamic_slice_in_dim(x, t * n, n, axis=2)
    if self.shards % self.kv_heads == 0:
      # A group spans tp / K shards: the one kv head they share.
      return jax.lax.dynamic_slice_in_dim(x, t // (self.shards // self.kv_heads), 1, axis=2)
    # Groups straddle shard borders (e.g. H 12, K 3, tp 4): one kv head per local query head;
    # the gather's transpose adds the gradients of repeated heads.
    heads = (t * self.local_heads + jnp.arange(self.local_heads)) // self.group
    return jnp.take(x, heads, axis=2)


def kv_head_selection(mesh, specs: AttentionSpecs, heads: int,
                      kv_heads: int) -> KvHeadSelection | None:
  """None when key / value enter sharded as kv_specs[2] says (or tp is 1), else the selection."""
  tp = axes_size(mesh, specs.head_axes)
  if tp == 1 or (specs.kv[2] and kv_heads % tp == 0):
    return None
  return KvHeadSelection(head_axis=axis_name(specs.head_axes), local_heads=heads // tp,
                         group=heads // kv_heads, kv_heads=kv_heads, shards=tp)


def _gather_summing_grads(axes: AxisNames, cp: int, reduce_choice: str = "auto"):
  """all_gather over the context axes whose transpose sums in kv_grad_reduce_dtype."""
  name = axis_name(axes)

  @jax.custom_vjp
  def gather(x):
    return jax.lax.all_gather(x, name, axis=1, tiled=True)

  def fwd(x):
    return gather(x), None

  def bwd(_, ct):
    # Reduce-scatter: sum every shard's partial kv gradients, keep this shard's slice.
    rd = kv_grad_reduce_dtype(ct.dtype, cp, reduce_choice)
    summed = jax.lax.psum_scatter(ct.astype(rd), name, scatter_dimension=1, tiled=True)
    return (summed.astype(ct.dtype),)

  gather.defvjp(fwd, bwd)
  return gather


def _remote_ranks(axes: AxisNames, cp: int) -> jax.Array:
  """int32 [cp - 1]: the other context ranks, ascending (inside shard_map)."""
  i = jnp.arange(cp - 1, dtype=jnp.int32)
  return i + (i >= jax.lax.axis_index(axis_name(axes))).astype(jnp.int32)


def gather_remote(x: jax.Array, axes: AxisNames, cp: int) -> jax.Array:
  """[B, n, ...] -> [B, (cp - 1) * n, ...]: the other shards' tokens, ascending rank."""
  name = axis_name(axes)
  if cp == 2:
    return jax.lax.ppermute(x, name, perm=[(0, 1), (1, 0)])
  g = jnp.take(jax.lax.all_gather(x, name, axis=0, tiled=False), _remote_ranks(axes, cp), axis=0)
  return jnp.moveaxis(g, 0, 1).reshape((x.shape[0], (cp - 1) * x.shape[1]) + x.shape[2:])


def split_local_remote(axes: AxisNames, cp: int, reduce_choice: str = "auto"):
  """x -> (x, the other shards' x) for the overlap path; the transpose sends the remote
  cotangent back and adds the local one, summed in kv_grad_reduce_dtype."""
  name = axis_name(axes)

  @jax.custom_vjp
  def split(x):
    return x, gather_remote(x, axes, cp)

  def fwd(x):
    return split(x), None

  def bwd(_, cts):
    ct_local, ct_remote = cts
    rd = kv_grad_reduce_dtype(ct_remote.dtype, cp, reduce_choice)
    ct_remote = ct_remote.astype(rd)
    if cp == 2:
      back = jax.lax.ppermute(ct_remote, name, perm=[(0, 1), (1, 0)])
    else:
      b, n = ct_remote.shape[0], ct_local.shape[1]
      per_rank = jnp.moveaxis(ct_remote.reshape((b, cp - 1, n) + ct_remote.shape[2:]), 1, 0)
      full = jnp.zeros((cp,) + per_rank.shape[1:], rd).at[_remote_ranks(axes, cp)].set(per_rank)
      back = jax.lax.psum_scatter(full, name, scatter_dimension=0, tiled=False)
    return ((ct_local.astype(rd) + back).astype(ct_local.dtype),)

  split.defvjp(fwd, bwd)
  return split


def take_tokens(x: jax.Array, index: jax.Array) -> jax.Array:
  idx = index.reshape(index.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, idx, axis=1)


@jax.custom_vjp
def arrange(x: jax.Array, index: jax.Array) -> jax.Array:
  """Permute the token axis by `index`; the transpose gathers by the inverse (no scatter-add)."""
  return take_tokens(x, index)


def _arrange_fwd(x, index):
  return take_tokens(x, index), index


def _arrange_bwd(index, ct):
  rows = jnp.arange(index.shape[0])[:, None]
  inverse = jnp.zeros_like(index).at[rows, index].set(
      jnp.broadcast_to(jnp.arange(index.shape[1], dtype=index.dtype), index.shape))
  return take_tokens(ct, inverse), None


arrange.defvjp(_arrange_fwd, _arrange_bwd)


def gather_kv(arrays, axes: AxisNames, cp: int, token_order: str, *, float_grad: bool,
              arrangement: jax.Array | None = None, reduce_choice: str = "auto"):
  """All-gather [B_local, S / cp, ...] token arrays to [B_local, S, ...] in natural order
  ("llama3") or document order ("balanced", by `arrangement`)."""
  if cp == 1:
    return arrays
  if float_grad:
    gather = _gather_summing_grads(axes, cp, reduce_choice)
    out = [gather(x) for x in arrays]
  else:
    out = [jax.lax.all_gather(x, axis_name(axes), axis=1, tiled=True) for x in arrays]
  if token_order == "llama3":
    out = from_load_balanced_order(out, cp, axis=1)
  elif token_order == "balanced":
    out = [arrange(x, arrangement) if float_grad else take_tokens(x, arrangement) for x in out]
  return out


__all__ = ["KV_GRAD_REDUCE_CHOICES", "kv_grad_reduce_dtype", "KvHeadSelection",
           "kv_head_selection", "gather_remote", "split_local_remote", "take_tokens", "arrange",
           "gather_kv"]
