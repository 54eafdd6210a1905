"""Attention over key / value given in two parts, merged by log-sum-exp.

The context-parallel overlap splits a shard's attention into a local part and a remote part
(kv arriving by a collective). With w_p = lse_p (-inf where +inf):

    lse = logaddexp(w_a, w_b [, sink_h])                    (+inf where both are empty)
    out = out_a * exp(w_a - lse) + out_b * exp(w_b - lse)   (0 where both are empty)

Backward: each part's kernels take the merged out and lse, so its gradients are exact; dq sums
in float32. Optimization barriers order a before b forward and the reverse backward ("Order"),
so each collective has work to hide behind.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention.block_mask import AttentionMask
from kvax_plugin.attention.kernels.custom_vjp import (KernelParts, saved_residuals,
                                                      sinks_gradient, softmax_delta)


class KvPart(NamedTuple):
  """One part of the key / value (k [B, S_p, K, Dqk], v [B, S_p, K, Dv], int32 ids [B, S_p]) and
  the mask of the queries against exactly these tokens."""

  key: jax.Array
  value: jax.Array
  positions: jax.Array
  segment_ids: jax.Array
  mask: AttentionMask


def _finite_or_minus_inf(lse):
  """lse with +inf ("nothing attended") read as -inf; NaN stays."""
  return jnp.where(lse == jnp.inf, -jnp.inf, lse)


def merge(out_a, lse_a, out_b, lse_b, sinks=None):
  """Merged (out, lse) of two parts over disjoint key sets: out_* [B, Sq, H, Dv], lse_*
  [B, H, Sq], sinks optional [H]. Returns float32 (float64 for float64 inputs)."""
  ct = jnp.promote_types(jnp.promote_types(lse_a.dtype, lse_b.dtype), jnp.float32)
  w_a = _finite_or_minus_inf(lse_a.astype(ct))
  w_b = _finite_or_minus_inf(lse_b.astype(ct))
  w = jnp.logaddexp(w_a, w_b)
  empty = w == -jnp.inf
  if sinks is not None:
    w = jnp.logaddexp(w, sinks.astype(ct)[None, :, None])
  safe = jnp.where(empty, 0.0, w)
  lse = jnp.where(empty, jnp.inf, w)
  to_rows = lambda x: jnp.moveaxis(x, 1, 2)[..., None]
  out = (out_a.astype(ct) * to_rows(jnp.exp(w_a - safe))
         + out_b.astype(ct) * to_rows(jnp.exp(w_b - safe)))
  return jnp.where(to_rows(empty), 0.0, out), lse


def _zero_cotangents(tree):
  return jax.tree.map(lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0), tree)


def split_kv_attention(parts_a: KernelParts, parts_b: KernelParts, query: jax.Array,
                       query_positions: jax.Array, query_segment_ids: jax.Array, a: KvPart,
                       b: KvPart, sinks: jax.Array | None = None) -> jax.Array:
  """Attention of `query` [B, Sq, H, Dqk] over the union of key / value parts a and b, exact as
  one call over both. parts_a / parts_b: each part's kernels (capture_kernel_parts). sinks:
  optional [H]. Returns [B, Sq, H, Dv] in query.dtype; differentiable in query, both parts' key /
  value and sinks."""
  has_sinks = sinks is not None
  sinks_arr = (jnp.zeros((query.shape[2],), jnp.float32) if sinks is None else sinks)
  ints = (query_positions, query_segment_ids, a.positions, a.segment_ids, a.mask,
          b.positions, b.segment_ids, b.mask)

  def forward(q, k_a, v_a, k_b, v_b, s, ints):
    q_pos, q_seg, kp_a, ks_a, mask_a, kp_b, ks_b, mask_b = ints
    out_a, lse_a = parts_a.forward(q, k_a, v_a, q_pos, q_seg, kp_a, ks_a, mask_a)
    out_a, lse_a, q_b, k_b, v_b = jax.lax.optimization_barrier((out_a, lse_a, q, k_b, v_b))
    out_b, lse_b = parts_b.forward(q_b, k_b, v_b, q_pos, q_seg, kp_b, ks_b, mask_b)
    out, lse = merge(out_a, lse_a, out_b, lse_b, s if has_sinks else None)
    return out.astype(q.dtype), lse

  @jax.custom_vjp
  def attention(q, k_a, v_a, k_b, v_b, s, ints):
    return forward(q, k_a, v_a, k_b, v_b, s, ints)[0]

  def attention_fwd(q, k_a, v_a, k_b, v_b, s, ints):
    out, lse = forward(q, k_a, v_a, k_b, v_b, s, ints)
    # Saved by a remat policy naming "context": the backward reruns neither part's forward.
    out, lse = saved_residuals(out, lse)
    return out, (q, k_a, v_a, k_b, v_b, s, ints, out, lse)

  def attention_bwd(res, d_out):
    q, k_a, v_a, k_b, v_b, s, ints, out, lse = res
    q_pos, q_seg, kp_a, ks_a, mask_a, kp_b, ks_b, mask_b = ints
    for mask in (mask_a, mask_b):
      if not mask.has_backward:
        raise ValueError("mask has no backward tables: build it with "
                         "create_attention_mask(..., calc_bwd_mask=True) to take gradients")
    d_out = d_out.astype(q.dtype)
    dq_b, dk_b, dv_b = parts_b.backward(q, k_b, v_b, q_pos, q_seg, kp_b, ks_b, mask_b, out, lse,
                                        d_out)
    # Part a after part b, so b's dk / dv collective runs while a's backward does.
    dq_b, dk_b, dv_b, q_a, d_out_a = jax.lax.optimization_barrier((dq_b, dk_b, dv_b, q, d_out))
    dq_a, dk_a, dv_a = parts_a.backward(q_a, k_a, v_a, q_pos, q_seg, kp_a, ks_a, mask_a, out, lse,
                                        d_out_a)
    f32 = lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))
    dq = (f32(dq_a) + f32(dq_b)).astype(q.dtype)
    if has_sinks:
      delta = softmax_delta(d_out, out)
      ds = sinks_gradient(s, lse, delta)
    else:
      ds = jnp.zeros_like(s)
    return (dq, dk_a.astype(k_a.dtype), dv_a.astype(v_a.dtype), dk_b.astype(k_b.dtype),
            dv_b.astype(v_b.dtype), ds, _zero_cotangents(ints))

  attention.defvjp(attention_fwd, attention_bwd)
  return attention(query, a.key, a.value, b.key, b.value, sinks_arr, ints)


__all__ = ["KvPart", "merge", "split_kv_attention"]
