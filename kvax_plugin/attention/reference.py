"""Dense float32 reference attention: the semantics of shared/DESIGN.md section 2, read as math.

O(S^2) memory; meant for tests and for checking other backends, not for training.
Imports nothing beyond JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvax_plugin.attention.block_mask import dense_mask


def reference_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                        query_positions: jax.Array, query_segment_ids: jax.Array,
                        kv_positions: jax.Array, kv_segment_ids: jax.Array, *,
                        causal: bool = True, sliding_window: int | None = None,
                        scale: float = 1.0, logits_soft_cap: float | None = None,
                        sinks: jax.Array | None = None) -> jax.Array:
  """softmax(mask(softcap(scale * q k^T)) [+ sink]) v, computed in float32.

  Args:
    query: [B, Sq, H, Dqk]; key: [B, Skv, K, Dqk]; value: [B, Skv, K, Dv]; H % K == 0,
      query head h reads kv head h // (H // K).
    *_positions, *_segment_ids: int [B, S]; PADDING_SEGMENT_ID (-1) marks padding.
    sinks: optional [H]: one extra logit per query head in the softmax denominator (no value).

  Returns:
    [B, Sq, H, Dv] in query.dtype. Rows that attend to nothing are 0.
  """
  b, sq, h, _ = query.shape
  kh = key.shape[2]
  group = h // kh
  q = query.astype(jnp.float32).reshape(b, sq, kh, group, -1)
  k = key.astype(jnp.float32)
  v = value.astype(jnp.float32)

  logits = jnp.einsum("bqkgd,btkd->bkgqt", q, k) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  keep = dense_mask(query_positions, query_segment_ids, kv_positions, kv_segment_ids,
                    causal=causal, sliding_window=sliding_window)[:, None, None]  # [B,1,1,Sq,Skv]
  logits = jnp.where(keep, logits, -jnp.inf)

  row_max = jnp.max(logits, axis=-1, keepdims=True)
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, kh, group, 1, 1)
    row_max = jnp.maximum(row_max, sink)
  # A row with nothing to attend has max -inf; shift by 0 there so no NaN appears (also in grads).
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  weights = jnp.where(keep, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sink - row_max)
  safe_denom = jnp.where(denom > 0, denom, 1.0)
  probs = weights / safe_denom
  out = jnp.einsum("bkgqt,btkd->bqkgd", probs, v)
  return out.reshape(b, sq, h, -1).astype(query.dtype)
