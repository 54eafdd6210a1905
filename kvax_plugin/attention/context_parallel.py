"""Sharding and context parallelism (Llama 3 style) for the attention op; design in
docs/context-parallelism.md.

Specs are 4-entry (batch, sequence, heads, head_dim) tuples of mesh axis names (or tuples, or
None) per BSHD array, from query_specs= / kv_specs= or the innermost `attention_specs(...)`. The
query's sequence entry is the context axis (size cp); kv_specs[1] is None: key, value and kv ids
arrive sharded over the context axis and are all-gathered inside shard_map. Positions and
segment ids, never buffer indices, decide which pairs attend, so any `token_order` is exact: it
only declares the order the inputs arrive in, and the mask and the call must agree on it. kv
gradients are summed over the context axis by the all-gather's transpose (psum_scatter).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kvax_plugin.attention import arguments
from kvax_plugin.attention import block_mask as bm
from kvax_plugin.attention import kernels
from kvax_plugin.attention import split_kv_attention as split_kv
from kvax_plugin.attention import token_order as orders
from kvax_plugin.attention.block_mask import AttentionMask, BlockTable, MaskSpec
from kvax_plugin.attention.kernels.custom_vjp import KernelParts, capture_kernel_parts
from kvax_plugin.attention.params import DEFAULT_FWD_PARAMS

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

AxisNames = tuple[str, ...]
_DIM_NAMES = ("batch", "sequence", "heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class AttentionSpecs:
  """Normalised specs: each of the 4 entries is a tuple of mesh axis names (() = unsharded)."""

  query: tuple[AxisNames, AxisNames, AxisNames, AxisNames]
  kv: tuple[AxisNames, AxisNames, AxisNames, AxisNames]

  @property
  def batch_axes(self) -> AxisNames:
    return self.query[0]

  @property
  def context_axes(self) -> AxisNames:
    return self.query[1]

  @property
  def head_axes(self) -> AxisNames:
    return self.query[2]


_ATTENTION_SPECS: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar(
    "kvax_plugin_attention_specs", default=None)


def _normalise_entry(entry: Any, name: str, dim: int) -> AxisNames:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
    return tuple(entry)
  raise TypeError(f"{name}[{dim}] ({_DIM_NAMES[dim]}) must be a mesh axis name, a tuple of names "
                  f"or None, got {entry!r}")


def _normalise_spec(spec: Any, name: str) -> tuple[AxisNames, AxisNames, AxisNames, AxisNames]:
  if isinstance(spec, str) or not isinstance(spec, Sequence) or len(spec) != 4:
    raise ValueError(f"{name} must be a 4-entry spec (batch, sequence, heads, head_dim) for a BSHD "
                     f"array, got {spec!r}")
  out = tuple(_normalise_entry(e, name, i) for i, e in enumerate(spec))
  seen: set[str] = set()
  for axes in out:
    for a in axes:
      if a in seen:
        raise ValueError(f"{name} uses mesh axis {a!r} more than once: {spec!r}")
      seen.add(a)
  return out  # type: ignore[return-value]


@contextlib.contextmanager
def attention_specs(query_specs: Any, kv_specs: Any = None) -> Iterator[None]:
  """Set the specs of attention calls with a mesh and no explicit specs, in this context (a
  contextvar: per thread / task, restored on exit). kv_specs None means (query batch, None,
  query heads, None)."""
  q = _normalise_spec(query_specs, "query_specs")
  kv = None if kv_specs is None else _normalise_spec(kv_specs, "kv_specs")
  token = _ATTENTION_SPECS.set((q, kv))
  try:
    yield
  finally:
    _ATTENTION_SPECS.reset(token)


def current_attention_specs() -> tuple[Any, Any] | None:
  """(query_specs, kv_specs) of the innermost attention_specs context, or None outside one."""
  return _ATTENTION_SPECS.get()


def resolve_specs(query_specs: Any = None, kv_specs: Any = None) -> AttentionSpecs:
  """Explicit arguments first, then the attention_specs context; kv derived from query last."""
  ctx = _ATTENTION_SPECS.get()
  q = (_normalise_spec(query_specs, "query_specs") if query_specs is not None
       else (ctx[0] if ctx is not None else None))
  if q is None:
    raise ValueError("a mesh was given but no query_specs: pass query_specs= (and kv_specs=) or "
                     "call inside `with attention_specs(query_specs, kv_specs):`")
  if kv_specs is not None:
    kv = _normalise_spec(kv_specs, "kv_specs")
  elif ctx is not None and ctx[1] is not None and query_specs is None:
    kv = ctx[1]
  else:
    kv = (q[0], (), q[2], ())
  return AttentionSpecs(q, kv)


def _entry(axes: AxisNames):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _axes_size(mesh, axes: AxisNames) -> int:
  return int(math.prod(mesh.shape[a] for a in axes))


def check_specs(specs: AttentionSpecs, mesh) -> None:
  """Rules that do not depend on shapes; every error names the offending argument."""
  names = set(mesh.axis_names)
  for label, spec in (("query_specs", specs.query), ("kv_specs", specs.kv)):
    for dim, axes in enumerate(spec):
      for a in axes:
        if a not in names:
          raise ValueError(f"{label}[{dim}] ({_DIM_NAMES[dim]}) names mesh axis {a!r}, but the "
                           f"mesh has axes {tuple(mesh.axis_names)}")
    if spec[3]:
      raise ValueError(f"{label}[3] (head_dim) must be None: the head dimension cannot be sharded, "
                       f"got {_entry(spec[3])!r}")
  if specs.kv[1]:
    raise ValueError(
        f"kv_specs[1] (key/value sequence) must be None, got {_entry(specs.kv[1])!r}: key/value "
        "are all-gathered over the query's context axis (query_specs[1]) inside the op; pass them "
        "context-sharded or replicated, the spec describes the gathered view")
  if specs.query[0] != specs.kv[0]:
    raise ValueError(f"query_specs[0] and kv_specs[0] (batch) must be equal, got "
                     f"{_entry(specs.query[0])!r} and {_entry(specs.kv[0])!r}")
  if specs.kv[2] and specs.query[2] != specs.kv[2]:
    # Sharded kv heads must follow the query heads' axes, or a shard would miss kv heads its
    # query heads read.
    if not specs.query[2]:
      raise ValueError(
          f"kv_specs[2] (heads) shards the key/value heads over {_entry(specs.kv[2])!r} but "
          "query_specs[2] leaves the query heads unsharded: expected kv_specs[2] None (key/value "
          "heads replicated) or query_specs[2] naming the same mesh axes")
    raise ValueError(
        f"query_specs[2] and kv_specs[2] (heads) name different mesh axes, "
        f"{_entry(specs.query[2])!r} and {_entry(specs.kv[2])!r}: expected kv_specs[2] equal to "
        "query_specs[2] (kv heads sharded like the query heads) or None (kv heads replicated; "
        "each shard then uses the kv heads its own query heads read)")


def _check_divisible(what: str, length: int, arg: str, size: int, axes: AxisNames) -> None:
  if length % size:
    raise ValueError(f"{what} ({length}) must be divisible by the size of its mesh axes "
                     f"{axes} ({size}) given in {arg}")


def check_shapes(specs: AttentionSpecs, mesh, *, batch: int, q_len: int, kv_len: int,
                 heads: int | None = None, kv_heads: int | None = None,
                 token_order: str = "natural") -> None:
  """Divisibility of every sharded dimension by its axes' sizes."""
  dp = _axes_size(mesh, specs.batch_axes)
  cp = _axes_size(mesh, specs.context_axes)
  tp = _axes_size(mesh, specs.head_axes)
  _check_divisible("batch", batch, "query_specs[0]", dp, specs.batch_axes)
  _check_divisible("query sequence length", q_len, "query_specs[1]", cp, specs.context_axes)
  _check_divisible("key/value sequence length", kv_len, "query_specs[1] (the all-gather of key/"
                   "value)", cp, specs.context_axes)
  if token_order == "llama3" and cp > 1:
    for what, n in (("query sequence length", q_len), ("key/value sequence length", kv_len)):
      if n % (2 * cp):
        raise ValueError(f"{what} ({n}) must be divisible by 2 * cp = {2 * cp} when "
                         'token_order="llama3" (permute_tokens_for_load_balance=True: 2*cp '
                         "load-balancing chunks)")
  if heads is not None:
    _check_divisible("query heads", heads, "query_specs[2]", tp, specs.head_axes)
  if specs.kv[2] and kv_heads is not None and kv_heads % tp and tp % kv_heads:
    raise ValueError(
        f"key/value heads ({kv_heads}) and the size of the head axes {specs.head_axes} ({tp}) "
        "given in kv_specs[2] must divide one another: either every shard holds whole kv heads "
        "or each kv head is shared by a whole number of shards; or pass kv_specs[2]=None "
        "(key/value heads replicated, each shard taking the kv heads its query heads read)")


@dataclasses.dataclass(frozen=True)
class _KvHeadPlan:
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


def _kv_head_plan(mesh, specs: AttentionSpecs, heads: int, kv_heads: int) -> _KvHeadPlan | None:
  """None when key / value enter sharded as kv_specs[2] says (or tp is 1), else the plan."""
  tp = _axes_size(mesh, specs.head_axes)
  if tp == 1 or (specs.kv[2] and kv_heads % tp == 0):
    return None
  return _KvHeadPlan(head_axis=_axis_name(specs.head_axes), local_heads=heads // tp,
                     group=heads // kv_heads, kv_heads=kv_heads, shards=tp)


TOKEN_ORDERS = orders.ORDERS


def resolve_token_order(token_order: str | None, permute_tokens_for_load_balance: bool | None,
                        *, default: str = "llama3") -> str:
  """The order the inputs arrive in: `token_order` ("natural", "llama3", "balanced") or the older
  flag (True "llama3", False "natural"); neither: `default`; contradicting: ValueError."""
  if token_order is None:
    if permute_tokens_for_load_balance is None:
      return default
    return "llama3" if permute_tokens_for_load_balance else "natural"
  if token_order not in TOKEN_ORDERS:
    raise ValueError(f"token_order must be one of {TOKEN_ORDERS}, got {token_order!r}")
  if (permute_tokens_for_load_balance is not None
      and bool(permute_tokens_for_load_balance) != (token_order == "llama3")):
    raise ValueError(
        f"permute_tokens_for_load_balance={permute_tokens_for_load_balance} contradicts "
        f"token_order={token_order!r}: pass token_order alone (the flag True means \"llama3\", "
        "False means \"natural\")")
  return token_order


def _load_balance_order(cp: int) -> list[int]:
  """Chunk order of the permuted sequence: rank r holds chunks r and 2*cp-1-r."""
  return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def _reorder_chunks(x, cp: int, axis: int, inverse: bool, name: str):
  if x is None:
    return None
  if not isinstance(cp, (int, np.integer)) or isinstance(cp, bool) or cp < 1:
    raise ValueError(f"cp must be a positive int, got {cp!r}")
  ndim = len(x.shape)
  ax = axis + ndim if axis < 0 else axis
  if not 0 <= ax < ndim:
    raise ValueError(f"axis {axis} is out of range for {name} of shape {tuple(x.shape)}")
  n = x.shape[ax]
  if n % (2 * cp):
    raise ValueError(f"{name}: the sequence axis (axis {axis}, length {n}) must be divisible by "
                     f"2 * cp = {2 * cp}")
  if cp == 1:
    return x
  xp = np if isinstance(x, np.ndarray) else jnp
  c = n // (2 * cp)
  order = _load_balance_order(cp)
  if inverse:
    order = list(np.argsort(order))
  # Static slices + concatenate: cheap copies whose transposes are slices again (no gathers).
  chunks = [jax.lax.slice_in_dim(x, i * c, (i + 1) * c, axis=ax) if xp is jnp
            else np.take(x, np.arange(i * c, (i + 1) * c), axis=ax) for i in order]
  return xp.concatenate(chunks, axis=ax)


def _map_arrays(fn, x_or_tuple, label: str):
  if isinstance(x_or_tuple, (tuple, list)):
    out = [_map_arrays(fn, x, f"{label}[{i}]") for i, x in enumerate(x_or_tuple)]
    return type(x_or_tuple)(out)
  return fn(x_or_tuple, label)


def to_load_balanced_order(x_or_tuple, cp: int, axis: int = 1):
  """Natural order -> load-balanced order for context parallelism `cp`: the sequence `axis`
  (length a multiple of 2*cp) is cut into 2*cp chunks and rank r gets chunks r and 2*cp-1-r.
  Takes an array (numpy or jax) or a nested tuple / list of them (None passes through)."""
  return _map_arrays(lambda x, n: _reorder_chunks(x, cp, axis, False, n), x_or_tuple, "x")


def from_load_balanced_order(x_or_tuple, cp: int, axis: int = 1):
  """Inverse of `to_load_balanced_order` (load-balanced order -> natural order)."""
  return _map_arrays(lambda x, n: _reorder_chunks(x, cp, axis, True, n), x_or_tuple, "x")


def ambient_mesh():
  """The surrounding mesh (`with jax.set_mesh(mesh)`, abstract inside jit, else the older
  `with mesh:`), or None."""
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # inside jit: only the abstract mesh is known there
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty:
    return mesh
  # kvax's `with mesh:` context has no public reader (pxla's alias is deprecated).
  from jax._src import mesh as mesh_lib
  resources = getattr(mesh_lib, "thread_resources", None)
  legacy = None if resources is None else resources.env.physical_mesh
  return None if legacy is None or legacy.empty else legacy


def mesh_for_call(mesh, mask, query_specs=None, kv_specs=None) -> tuple[Any, Any, Any]:
  """(mesh, query_specs, kv_specs) a flash_attention call runs with: an explicit mesh (the mask
  must match it), else a sharded mask's mesh and specs (call or context specs win), else the
  surrounding mesh when specs are known (as kvax does), else one device."""
  lay = mask.layout if isinstance(mask, ShardedAttentionMask) else None
  if mesh is None and lay is not None and lay.mesh is not None:
    mesh = lay.mesh
  elif mesh is None and (query_specs is not None or current_attention_specs() is not None):
    mesh = ambient_mesh()
  if (mesh is not None and lay is not None and lay.specs is not None and query_specs is None
      and kv_specs is None and current_attention_specs() is None):
    query_specs = tuple(_entry(a) for a in lay.specs.query)
    kv_specs = tuple(_entry(a) for a in lay.specs.kv)
  return mesh, query_specs, kv_specs


def mesh_for_mask(mesh, query_specs=None) -> Any:
  """The mesh create_attention_mask builds on: the explicit one, else the surrounding mesh when
  specs are known (query_specs= or attention_specs), else None (one device)."""
  if mesh is not None or (query_specs is None and current_attention_specs() is None):
    return mesh
  return ambient_mesh()


def context_size(mesh, query_specs: Any = None) -> int:
  """The size of the query's sequence axes (query_specs, else the context's) on `mesh`."""
  specs = resolve_specs(query_specs)
  check_specs(specs, mesh)
  return _axes_size(mesh, specs.context_axes)


def _context_size_for(mesh, query_specs, fn: str) -> int:
  mesh = ambient_mesh() if mesh is None else mesh
  if mesh is None:
    raise ValueError(f"{fn} reads the context size from a mesh: pass mesh= or call it inside "
                     "`with jax.set_mesh(mesh):` (or `with mesh:`)")
  return context_size(mesh, query_specs)


def permute_tokens_context_parallelism(inputs, mesh=None, *, query_specs: Any = None):
  """kvax 0.1.0's permutation, natural -> load-balanced order along axis 1, of an array or a
  nested tuple / list of [B, S, ...] arrays; cp is the size of the query's sequence axes on `mesh`
  (None: the surrounding mesh). to_load_balanced_order takes cp explicitly."""
  cp = _context_size_for(mesh, query_specs, "permute_tokens_context_parallelism")
  return to_load_balanced_order(inputs, cp, axis=1)


def unpermute_tokens_context_parallelism(inputs, mesh=None, *, query_specs: Any = None):
  """Inverse of permute_tokens_context_parallelism."""
  cp = _context_size_for(mesh, query_specs, "unpermute_tokens_context_parallelism")
  return from_load_balanced_order(inputs, cp, axis=1)


@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """How a ShardedAttentionMask's tables are distributed (static, hashable)."""

  mesh_axes: tuple[tuple[str, int], ...]  # (name, size) of the mesh the tables were built on
  batch_axes: AxisNames
  context_axes: AxisNames
  context_size: int
  token_order: str  # the order the inputs arrive in ("natural" whenever context_size == 1)
  local_spec: MaskSpec  # per-shard problem (with overlap_kv_gather: the local part)
  # flash_attention(mesh=None) runs on these; an explicit mesh must match.
  mesh: Any = None
  specs: AttentionSpecs | None = None
  # Overlapped kv collective: remote_spec is the other shards' kv, ascending rank.
  overlap_kv_gather: bool = False
  remote_spec: MaskSpec | None = None
  kv_grad_reduce_dtype: str = "auto"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ShardedAttentionMask(AttentionMask):
  """An AttentionMask with per-shard tables: int32 [B, context_size * n_local] sharded
  (layout.batch_axes, layout.context_axes); `spec` is the global problem. kv_arrangement
  ("balanced" only): int32 [B, context_size * Skv], each shard's slice the document-order
  permutation of its gathered kv. With layout.overlap_kv_gather, fwd / dq / dkv are the local
  part's tables and `remote` the remote part's (other shards' kv, ascending rank);
  kv_arrangement is then the remote kv's document order (cp > 2, llama3 / balanced) or None."""

  # Both sides order-free, and the query side in order (tables index the shard's queries as they
  # arrive). Not the kv side in order: the op rearranges the gathered kv, and kvax_plugin.ops
  # builds from natural-order kv ids and calls with llama3-ordered ones.
  checked_fingerprint_columns = (0, 1, 2)

  layout: ShardLayout | None = None
  kv_arrangement: jax.Array | None = None
  remote: tuple[BlockTable, BlockTable | None, BlockTable | None] | None = None

  def tree_flatten(self):
    return ((self.fwd, self.dq, self.dkv, self.fingerprint, self.kv_arrangement, self.remote),
            (self.spec, self.layout))

  @classmethod
  def tree_unflatten(cls, aux, children):
    spec, layout = aux
    fwd, dq, dkv, fingerprint, kv_arrangement, remote = children
    return cls(spec, fwd, dq, dkv, fingerprint=fingerprint, layout=layout,
               kv_arrangement=kv_arrangement, remote=remote)

  @property
  def token_order(self) -> str:
    return self.layout.token_order

  def local(self, fwd: BlockTable, dq: BlockTable | None,
            dkv: BlockTable | None) -> AttentionMask:
    return AttentionMask(self.layout.local_spec, fwd, dq, dkv)

  def remote_part(self, fwd: BlockTable, dq: BlockTable | None,
                  dkv: BlockTable | None) -> AttentionMask:
    return AttentionMask(self.layout.remote_spec, fwd, dq, dkv)


def _mesh_axes(mesh) -> tuple[tuple[str, int], ...]:
  return tuple((str(a), int(mesh.shape[a])) for a in mesh.axis_names)


class _GatherKvGradSum:
  """all_gather over the context axes whose transpose sums in kv_grad_reduce_dtype."""

  @staticmethod
  def make(axes: AxisNames, cp: int, reduce_choice: str = "auto"):
    axis_name = axes if len(axes) > 1 else axes[0]

    @jax.custom_vjp
    def gather(x):
      return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)

    def fwd(x):
      return gather(x), None

    def bwd(_, ct):
      # Reduce-scatter: sum every shard's partial kv gradients, keep this shard's slice.
      rd = kv_grad_reduce_dtype(ct.dtype, cp, reduce_choice)
      summed = jax.lax.psum_scatter(ct.astype(rd), axis_name,
                                    scatter_dimension=1, tiled=True)
      return (summed.astype(ct.dtype),)

    gather.defvjp(fwd, bwd)
    return gather


def _axis_name(axes: AxisNames):
  return axes if len(axes) > 1 else axes[0]


def _remote_ranks(axes: AxisNames, cp: int) -> jax.Array:
  """int32 [cp - 1]: the other context ranks, ascending (inside shard_map)."""
  i = jnp.arange(cp - 1, dtype=jnp.int32)
  return i + (i >= jax.lax.axis_index(_axis_name(axes))).astype(jnp.int32)


def _gather_remote(x: jax.Array, axes: AxisNames, cp: int) -> jax.Array:
  """[B, n, ...] -> [B, (cp - 1) * n, ...]: the other shards' tokens, ascending rank."""
  name = _axis_name(axes)
  if cp == 2:
    return jax.lax.ppermute(x, name, perm=[(0, 1), (1, 0)])
  g = jnp.take(jax.lax.all_gather(x, name, axis=0, tiled=False), _remote_ranks(axes, cp), axis=0)
  return jnp.moveaxis(g, 0, 1).reshape((x.shape[0], (cp - 1) * x.shape[1]) + x.shape[2:])


class _SplitKv:
  """x -> (x, the other shards' x) for the overlap path; the transpose sends the remote
  cotangent back and adds the local one, summed in kv_grad_reduce_dtype."""

  @staticmethod
  def make(axes: AxisNames, cp: int, reduce_choice: str = "auto"):
    name = _axis_name(axes)

    @jax.custom_vjp
    def split(x):
      return x, _gather_remote(x, axes, cp)

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


def _take_tokens(x: jax.Array, index: jax.Array) -> jax.Array:
  idx = index.reshape(index.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, idx, axis=1)


@jax.custom_vjp
def _arrange(x: jax.Array, index: jax.Array) -> jax.Array:
  """Permute the token axis by `index`; the transpose gathers by the inverse (no scatter-add)."""
  return _take_tokens(x, index)


def _arrange_fwd(x, index):
  return _take_tokens(x, index), index


def _arrange_bwd(index, ct):
  rows = jnp.arange(index.shape[0])[:, None]
  inverse = jnp.zeros_like(index).at[rows, index].set(
      jnp.broadcast_to(jnp.arange(index.shape[1], dtype=index.dtype), index.shape))
  return _take_tokens(ct, inverse), None


_arrange.defvjp(_arrange_fwd, _arrange_bwd)


def _gather_kv(arrays, axes: AxisNames, cp: int, token_order: str, *, float_grad: bool,
               arrangement: jax.Array | None = None, reduce_choice: str = "auto"):
  """All-gather [B_local, S / cp, ...] token arrays to [B_local, S, ...] in natural order
  ("llama3") or document order ("balanced", by `arrangement`)."""
  if cp == 1:
    return arrays
  axis_name = axes if len(axes) > 1 else axes[0]
  if float_grad:
    gather = _GatherKvGradSum.make(axes, cp, reduce_choice)
    out = [gather(x) for x in arrays]
  else:
    out = [jax.lax.all_gather(x, axis_name, axis=1, tiled=True) for x in arrays]
  if token_order == "llama3":
    out = from_load_balanced_order(out, cp, axis=1)
  elif token_order == "balanced":
    out = [_arrange(x, arrangement) if float_grad else _take_tokens(x, arrangement)
           for x in out]
  return out


def _call_shard_map(fn, mesh, in_specs, out_specs, args):
  """shard_map(fn) under jit, each argument first moved to its in_spec (jax.reshard on Explicit
  meshes, a sharding constraint otherwise), since shard_map rejects inputs laid out otherwise.
  On a concrete mesh they are device_put first, so arrays committed to one device do not fail
  the jit with "incompatible devices"."""
  from jax.sharding import AxisType, NamedSharding

  explicit = any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))

  def shardings(spec):
    return jax.tree.map(lambda p: NamedSharding(mesh, p), spec,
                        is_leaf=lambda p: isinstance(p, P))

  def place(x, spec):
    sharding = shardings(spec)
    if explicit:
      return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)

  @jax.jit
  def run(*args):
    placed = [place(a, spec) for a, spec in zip(args, in_specs)]
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*placed)

  # Concrete meshes only (inside jit the ambient mesh may be abstract).
  if isinstance(mesh, jax.sharding.Mesh):
    args = [jax.device_put(a, shardings(spec)) for a, spec in zip(args, in_specs)]
  return run(*args)


def create_attention_mask_sharded(query_positions: jax.Array,
                                  query_segment_ids: jax.Array,
                                  kv_positions: jax.Array,
                                  kv_segment_ids: jax.Array,
                                  *,
                                  fwd_params=None,
                                  bwd_params=None,
                                  calc_bwd_mask: bool = False,
                                  skip_pad_tokens: bool = True,
                                  causal: bool = True,
                                  sliding_window: int | None = None,
                                  mesh,
                                  query_specs=None,
                                  kv_specs=None,
                                  token_order: str = "llama3",
                                  overlap_kv_gather: bool = False,
                                  kv_grad_reduce_dtype: str = "auto"
                                  ) -> ShardedAttentionMask:
  """Per-shard block tables, built inside shard_map. query_positions / query_segment_ids: int32
  [B, Sq]; kv_positions / kv_segment_ids: int32 [B, Skv], in the order flash_attention gets the
  tokens (`token_order`). Specs: explicit or from attention_specs. overlap_kv_gather: build the
  overlapped path's local / remote tables (no effect without context parallelism).
  kv_grad_reduce_dtype: one of KV_GRAD_REDUCE_CHOICES, recorded in the layout."""
  if kv_grad_reduce_dtype not in KV_GRAD_REDUCE_CHOICES:
    raise ValueError(f"kv_grad_reduce_dtype must be one of {KV_GRAD_REDUCE_CHOICES}, got "
                     f"{kv_grad_reduce_dtype!r}")
  specs = resolve_specs(query_specs, kv_specs)
  check_specs(specs, mesh)
  b, sq = query_positions.shape
  skv = kv_positions.shape[1]
  cp = _axes_size(mesh, specs.context_axes)
  order = resolve_token_order(token_order, None) if cp > 1 else "natural"
  check_shapes(specs, mesh, batch=b, q_len=sq, kv_len=skv, token_order=order)
  dp = _axes_size(mesh, specs.batch_axes)
  overlap = bool(overlap_kv_gather) and cp > 1
  local_specs: list[MaskSpec] = []
  mask_kw = dict(fwd_params=fwd_params, bwd_params=bwd_params, calc_bwd_mask=calc_bwd_mask,
                 skip_pad_tokens=skip_pad_tokens, causal=causal, sliding_window=sliding_window)

  def per_shard_split(qp, qs, kp, ks):
    # Local part: the shard's own kv (ascending natural order in every order). Remote part: the
    # other shards' kv; with cp > 2 llama3 / balanced interleave documents, so it is sorted.
    m_local = bm.create_attention_mask(qp, qs, kp, ks, **mask_kw)
    kp_r, ks_r = (_gather_remote(x, specs.context_axes, cp) for x in (kp, ks))
    arrangement = None
    if cp > 2 and order != "natural":
      arrangement = orders.document_order(kp_r, ks_r)
      kp_r, ks_r = _take_tokens(kp_r, arrangement), _take_tokens(ks_r, arrangement)
    m_remote = bm.create_attention_mask(qp, qs, kp_r, ks_r, **mask_kw)
    local_specs.append((m_local.spec, m_remote.spec))
    return (m_local.fwd, m_local.dq, m_local.dkv, arrangement,
            (m_remote.fwd, m_remote.dq, m_remote.dkv))

  def per_shard(qp, qs, kp, ks):
    gathered = "natural" if order == "balanced" else order
    kp, ks = _gather_kv((kp, ks), specs.context_axes, cp, gathered, float_grad=False)
    arrangement = None
    if order == "balanced":
      arrangement = orders.document_order(kp, ks)
      kp, ks = _take_tokens(kp, arrangement), _take_tokens(ks, arrangement)
    m = bm.create_attention_mask(qp, qs, kp, ks, fwd_params=fwd_params, bwd_params=bwd_params,
                                 calc_bwd_mask=calc_bwd_mask, skip_pad_tokens=skip_pad_tokens,
                                 causal=causal, sliding_window=sliding_window)
    local_specs.append(m.spec)
    return m.fwd, m.dq, m.dkv, arrangement

  tok = P(_entry(specs.batch_axes), _entry(specs.context_axes))
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  # check_vma=False: outputs are replicated over the head axes by construction.
  remote = remote_spec = None
  if overlap:
    fwd, dq, dkv, arrangement, remote = _call_shard_map(per_shard_split, mesh,
                                                        (tok, tok, tok, tok), tok, ints)
    local, remote_spec = local_specs[-1]
    kv_ok = local.kv_len * cp == skv and remote_spec.kv_len == skv - local.kv_len
  else:
    fwd, dq, dkv, arrangement = _call_shard_map(per_shard, mesh, (tok, tok, tok, tok), tok,
                                                ints)
    local = local_specs[-1]
    kv_ok = local.kv_len == skv
  if local.batch * dp != b or local.q_len * cp != sq or not kv_ok:
    raise AssertionError(f"internal: local mask spec {local} does not tile the global problem")
  spec = dataclasses.replace(local, batch=b, q_len=sq, kv_len=skv)
  layout = ShardLayout(mesh_axes=_mesh_axes(mesh), batch_axes=specs.batch_axes,
                       context_axes=specs.context_axes, context_size=cp, token_order=order,
                       local_spec=local, mesh=mesh, specs=specs, overlap_kv_gather=overlap,
                       remote_spec=remote_spec, kv_grad_reduce_dtype=kv_grad_reduce_dtype)
  fingerprint = bm.mask_fingerprint(*ints)
  return ShardedAttentionMask(spec, fwd, dq, dkv, fingerprint=fingerprint, layout=layout,
                              kv_arrangement=arrangement, remote=remote)


def _check_mask_layout(mask, specs: AttentionSpecs, mesh, cp: int, order: str) -> None:
  if not isinstance(mask, ShardedAttentionMask):
    raise TypeError(
        f"mask must come from create_attention_mask(..., mesh=mesh) with the same mesh and specs "
        f"when flash_attention runs on a mesh (mesh=, or the surrounding jax.set_mesh with "
        f"query specs known), got a {type(mask).__name__} built without a mesh")
  lay = mask.layout
  if lay.mesh_axes != _mesh_axes(mesh):
    raise ValueError(f"mask was built on a mesh with axes {lay.mesh_axes}, flash_attention got "
                     f"{_mesh_axes(mesh)}: build the mask with the same mesh")
  if (isinstance(lay.mesh, jax.sharding.Mesh) and isinstance(mesh, jax.sharding.Mesh)
      and lay.mesh.device_ids.tolist() != mesh.device_ids.tolist()):
    raise ValueError("mesh has the axes of the mask's mesh but other devices (or another device "
                     "order): build the mask with the mesh flash_attention runs on")
  if lay.batch_axes != specs.batch_axes or lay.context_axes != specs.context_axes:
    raise ValueError(
        f"mask was built for batch axes {lay.batch_axes} and context axes {lay.context_axes}, "
        f"flash_attention got query_specs with {specs.batch_axes} and {specs.context_axes}: "
        "build the mask under the same specs")
  if lay.token_order != order:
    raise ValueError(
        f"token_order {order!r} differs from the mask's ({lay.token_order!r}): pass the same "
        "token_order (or permute_tokens_for_load_balance) to create_attention_mask and "
        "flash_attention (it says in which order the inputs arrive)")


def flash_attention_sharded(query, key, value, query_positions, query_segment_ids, kv_positions,
                            kv_segment_ids, mask, *, scale: float,
                            logits_soft_cap: float | None, sinks: jax.Array | None,
                            memory_optimized_gqa_backward: bool,
                            token_order: str, backend: str, mesh,
                            query_specs=None, kv_specs=None,
                            deterministic_backward: bool | None = None,
                            kernel_options=None) -> jax.Array:
  """flash_attention on a mesh (shard_map over batch, heads and query sequence). query
  [B, Sq, H, Dqk] sharded by query_specs; key / value [B, Skv, K, D] and kv ids [B, Skv] enter
  context-sharded and are all-gathered; `mask` from create_attention_mask with the same mesh,
  specs and order; `backend` already resolved. Returns [B, Sq, H, Dv] sharded like the query."""
  specs = resolve_specs(query_specs, kv_specs)
  check_specs(specs, mesh)
  b, sq, h, _ = query.shape
  skv, kh = key.shape[1], key.shape[2]
  cp = _axes_size(mesh, specs.context_axes)
  order = resolve_token_order(token_order, None) if cp > 1 else "natural"
  check_shapes(specs, mesh, batch=b, q_len=sq, kv_len=skv, heads=h, kv_heads=kh,
               token_order=order)
  _check_mask_layout(mask, specs, mesh, cp, order)

  backend_fn = kernels.backend_function(backend)
  extra = kernels.backend_options(backend,
                                  memory_optimized_gqa_backward=memory_optimized_gqa_backward,
                                  deterministic_backward=deterministic_backward,
                                  kernel_options=kernel_options)
  has_sinks = sinks is not None
  layout_mask = mask
  overlap = mask.layout.overlap_kv_gather
  reduce_choice = mask.layout.kv_grad_reduce_dtype

  def per_shard_split(q, k, v, qp, qs, kp, ks, tables, arrangement, remote_tables, s):
    k, v = pick_kv_head(k), pick_kv_head(v)
    split = _SplitKv.make(specs.context_axes, cp, reduce_choice)
    (k_loc, k_rem), (v_loc, v_rem) = split(k), split(v)
    kp_rem, ks_rem = (_gather_remote(x, specs.context_axes, cp) for x in (kp, ks))
    if arrangement is not None:
      k_rem, v_rem = _arrange(k_rem, arrangement), _arrange(v_rem, arrangement)
      kp_rem, ks_rem = _take_tokens(kp_rem, arrangement), _take_tokens(ks_rem, arrangement)
    local_mask = layout_mask.local(*tables)
    remote_mask = layout_mask.remote_part(*remote_tables)
    opts = dict(scale=scale, logits_soft_cap=logits_soft_cap, sinks=None, **extra)
    with capture_kernel_parts():
      parts_loc = backend_fn(q, k_loc, v_loc, qp, qs, kp, ks, local_mask, **opts)
      parts_rem = backend_fn(q, k_rem, v_rem, qp, qs, kp_rem, ks_rem, remote_mask, **opts)
    if not isinstance(parts_loc, KernelParts) or not isinstance(parts_rem, KernelParts):
      raise ValueError(
          f'backend="{backend}" has no separate forward / backward kernels, which the '
          "overlapped context-parallel path (a mask built with overlap_kv_gather=True) needs: "
          'use backend "hopper", "mosaic", "triton" or "jax", or build the mask without the '
          "overlap")
    return split_kv.split_kv_attention(
        parts_loc, parts_rem, q, qp, qs, split_kv.KvPart(k_loc, v_loc, kp, ks, local_mask),
        split_kv.KvPart(k_rem, v_rem, kp_rem, ks_rem, remote_mask), s if has_sinks else None)

  def per_shard(q, k, v, qp, qs, kp, ks, tables, arrangement, s):
    k, v = pick_kv_head(k), pick_kv_head(v)
    k, v = _gather_kv((k, v), specs.context_axes, cp, order, float_grad=True,
                      arrangement=arrangement, reduce_choice=reduce_choice)
    kp, ks = _gather_kv((kp, ks), specs.context_axes, cp, order, float_grad=False,
                        arrangement=arrangement)
    local_mask = layout_mask.local(*tables)
    return backend_fn(q, k, v, qp, qs, kp, ks, local_mask, scale=scale,
                      logits_soft_cap=logits_soft_cap, sinks=s if has_sinks else None, **extra)

  bat, ctx, hd = (_entry(a) for a in (specs.batch_axes, specs.context_axes, specs.head_axes))
  x_spec = P(bat, ctx, hd, None)
  plan = _kv_head_plan(mesh, specs, h, kh)
  if plan is None:
    kv_spec = P(bat, ctx, _entry(specs.kv[2]), None)
    pick_kv_head = lambda x: x
  else:
    # key / value enter whole over the head axes; shard_map's transpose sums the shards' kv
    # gradients (each zero outside the heads it took).
    kv_spec = P(bat, ctx, None, None)
    pick_kv_head = plan.take
  tok = P(bat, ctx)
  # Sinks in float32: shard_map sums their gradient over the batch / context shards.
  s = sinks.astype(jnp.float32) if has_sinks else jnp.zeros((h,), jnp.float32)
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  tables = (mask.fwd, mask.dq, mask.dkv)
  if overlap:
    return _call_shard_map(
        per_shard_split, mesh, (x_spec, kv_spec, kv_spec, tok, tok, tok, tok, tok, tok, tok, P(hd)),
        x_spec, (query, key, value, *ints, tables, mask.kv_arrangement, mask.remote, s))
  return _call_shard_map(per_shard, mesh,
                         (x_spec, kv_spec, kv_spec, tok, tok, tok, tok, tok, tok, P(hd)), x_spec,
                         (query, key, value, *ints, tables, mask.kv_arrangement, s))


def context_parallel_balance(positions, segment_ids, cp: int, *, order: str | None = None,
                             permute: bool | None = None, causal: bool = True,
                             sliding_window: int | None = None, fwd_params=None,
                             block: int | None = None) -> dict[str, Any]:
  """Per-rank work of self-attention under context parallelism `cp`. positions, segment_ids:
  int [B, S], natural order. order: "natural", "llama3", "balanced" (unit `block`, default the
  forward query block) or a token_order.TokenOrder; permute=True / False is the older spelling
  of "llama3" / "natural"; neither: "balanced". Returns a dict: cp, order, permuted, and per
  rank (summed over the batch) kept_pairs, visited_blocks, full_blocks; kept_max_over_min and
  visited_max_over_min."""
  cp = arguments.as_int("cp", cp, minimum=1)
  positions = np.asarray(positions)
  segment_ids = np.asarray(segment_ids)
  if positions.ndim != 2 or positions.shape != segment_ids.shape:
    raise ValueError(f"positions {positions.shape} and segment_ids {segment_ids.shape} must both "
                     "be [batch, seq_len] arrays of one shape")
  b, s = positions.shape
  if s % cp:
    raise ValueError(f"the sequence length ({s}) must be divisible by cp ({cp})")
  fwd_params = fwd_params or DEFAULT_FWD_PARAMS
  if isinstance(order, orders.TokenOrder):
    if permute is not None:
      raise ValueError("pass either order= or permute=, not both")
    name, tok = "custom", order
  else:
    name = resolve_token_order(order, permute, default="balanced")
    tok = orders.token_order(positions, segment_ids, cp, order=name,
                             block=block or fwd_params.query_block_size,
                             kv_block=fwd_params.kv_block_size, causal=causal,
                             sliding_window=sliding_window)
  perm = np.asarray(tok.order)
  if perm.shape != (b, s):
    raise ValueError(f"the order has shape {perm.shape}, the batch {(b, s)}")
  if name == "balanced":
    kv = np.asarray(orders.document_order(positions, segment_ids))
    kv_pos = np.take_along_axis(positions, kv, axis=1)
    kv_seg = np.take_along_axis(segment_ids, kv, axis=1)
  else:
    kv_pos, kv_seg = positions, segment_ids
  n = s // cp
  counts = np.asarray(orders.kept_pairs_per_token(positions, segment_ids, causal=causal,
                                                  sliding_window=sliding_window), np.int64)
  counts = np.take_along_axis(counts, perm, axis=1)
  kept = [int(counts[:, r * n:(r + 1) * n].sum()) for r in range(cp)]
  # All ranks stacked on the batch axis (row r * B + i): one table build.
  qpos = np.take_along_axis(positions, perm, axis=1).reshape(b, cp, n).transpose(1, 0, 2)
  qseg = np.take_along_axis(segment_ids, perm, axis=1).reshape(b, cp, n).transpose(1, 0, 2)
  tile = lambda x: np.broadcast_to(x, (cp, b, s)).reshape(cp * b, s)
  m = bm.create_attention_mask(jnp.asarray(qpos.reshape(cp * b, n)),
                               jnp.asarray(qseg.reshape(cp * b, n)),
                               jnp.asarray(tile(kv_pos)), jnp.asarray(tile(kv_seg)),
                               fwd_params=fwd_params, causal=causal,
                               sliding_window=sliding_window)
  fwd = [np.asarray(x).reshape(cp, -1) for x in m.fwd]
  visited = [int(v) for v in (fwd[1] - fwd[0]).sum(axis=1)]
  full = [int(v) for v in (fwd[3] - fwd[2]).sum(axis=1)]

  def ratio(xs):
    return float(max(xs) / min(xs)) if min(xs) > 0 else float("inf")

  return {"cp": cp, "order": name, "permuted": name == "llama3", "kept_pairs": kept,
          "visited_blocks": visited, "full_blocks": full, "kept_max_over_min": ratio(kept),
          "visited_max_over_min": ratio(visited)}


__all__ = ["attention_specs", "current_attention_specs", "resolve_specs", "AttentionSpecs",
           "ShardedAttentionMask", "ShardLayout", "to_load_balanced_order",
           "from_load_balanced_order", "permute_tokens_context_parallelism",
           "unpermute_tokens_context_parallelism", "ambient_mesh", "context_size",
           "context_parallel_balance",
           "create_attention_mask_sharded", "flash_attention_sharded", "kv_grad_reduce_dtype",
           "TOKEN_ORDERS", "resolve_token_order"]
