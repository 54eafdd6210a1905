"""Runs an AttentionPlan: zeros for empty inputs, the sharded path on a mesh, else the backend on
one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvax_plugin.attention import kernels
from kvax_plugin.attention.block_mask import AttentionMask
from kvax_plugin.attention.plan import AttentionPlan
from kvax_plugin.attention.sharded import run_sharded


def run_on_device(plan: AttentionPlan, query, key, value, query_positions, query_segment_ids,
                  kv_positions, kv_segment_ids, mask: AttentionMask,
                  sinks: jax.Array | None) -> jax.Array:
  """The plan's backend over the whole problem: [B, Sq, H, Dv] in query.dtype."""
  if plan.debug:
    print(f"kvax_plugin.flash_attention: backend={plan.backend} q={query.shape} k={key.shape} "
          f"v={value.shape} dtype={query.dtype} mask={mask.spec}")
  return kernels.backend_function(plan.backend)(query, key, value, query_positions,
                                                query_segment_ids, kv_positions, kv_segment_ids,
                                                mask, sinks=sinks, **plan.kernel_kwargs)


def run(plan: AttentionPlan, query, key, value, query_positions, query_segment_ids, kv_positions,
        kv_segment_ids, mask: AttentionMask, sinks: jax.Array | None) -> jax.Array:
  """flash_attention's result under `plan` (shapes as there)."""
  if plan.empty:
    # With Skv = 0 every row attends nothing: 0.
    b, sq, h, _ = query.shape
    return jnp.zeros((b, sq, h, value.shape[3]), query.dtype)
  runner = run_on_device if plan.mesh is None else run_sharded
  return runner(plan, query, key, value, query_positions, query_segment_ids, kv_positions,
                kv_segment_ids, mask, sinks)


__all__ = ["run", "run_on_device"]
