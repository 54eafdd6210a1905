"""Compare any backend with the float32 reference: outputs and every gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvax_plugin.attention.api import flash_attention
from kvax_plugin.attention.block_mask import AttentionMask
from kvax_plugin.attention.reference import reference_attention


def compare_with_reference(query, key, value, query_positions, query_segment_ids, kv_positions,
                           kv_segment_ids, mask: AttentionMask, *, scale: float = 1.0,
                           logits_soft_cap: float | None = None, sinks=None,
                           backend: str = "auto", seed: int = 0) -> dict[str, float]:
  """Max |difference| and relative L2 difference of out, dq, dk, dv (and dsinks) vs reference.

  Gradients are taken of <out, cotangent> with a random cotangent (zero on padding rows does not
  matter: both sides must give zero there). The reference runs on float32 copies of the inputs.
  Returns {"out_max_abs": ..., "out_rel_l2": ..., "dq_max_abs": ..., ...}.
  """
  ints = (query_positions, query_segment_ids, kv_positions, kv_segment_ids)
  has_sinks = sinks is not None
  sinks_arg = sinks if has_sinks else jnp.zeros((query.shape[2],), jnp.float32)
  out_shape = query.shape[:3] + (value.shape[3],)
  cot = jax.random.normal(jax.random.PRNGKey(seed), out_shape, jnp.float32)

  def ours(q, k, v, s):
    return flash_attention(q, k, v, *ints, mask, scale=scale, logits_soft_cap=logits_soft_cap,
                           sinks=s if has_sinks else None, backend=backend)

  def ref(q, k, v, s):
    return reference_attention(q, k, v, *ints, causal=mask.spec.causal,
                               sliding_window=mask.spec.sliding_window, scale=scale,
                               logits_soft_cap=logits_soft_cap, sinks=s if has_sinks else None)

  def run(fn, args):
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot)
    out = fn(*args)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    return (out,) + grads

  f32 = lambda x: x.astype(jnp.float32)
  mine = jax.jit(lambda *a: run(ours, a))(query, key, value, sinks_arg)
  theirs = jax.jit(lambda *a: run(ref, a))(f32(query), f32(key), f32(value), f32(sinks_arg))
  names = ["out", "dq", "dk", "dv"] + (["dsinks"] if has_sinks else [])
  report = {}
  for name, a, b in zip(names, mine, theirs):
    a, b = f32(a), f32(b)
    report[f"{name}_max_abs"] = float(jnp.max(jnp.abs(a - b)))
    report[f"{name}_rel_l2"] = float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))
    report[f"{name}_finite"] = float(jnp.all(jnp.isfinite(a)))
  return report
