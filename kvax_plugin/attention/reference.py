"""Dense reference attention, O(S^2) memory, for tests; imports nothing beyond JAX.

It defines what non-finite inputs do, which every backend follows: a row with nothing to attend
is 0; otherwise a NaN or +inf kept logit makes the row NaN, a non-finite v reaches exactly the
rows attending its token, a NaN sink makes its head's non-empty rows NaN. Block kernels may
spread a non-finite value to rows sharing a visited block: more NaN, never less.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvax_plugin.attention import arguments, validation
from kvax_plugin.attention.block_mask import dense_mask


def reference_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                        query_positions: jax.Array, query_segment_ids: jax.Array,
                        kv_positions: jax.Array, kv_segment_ids: jax.Array, *,
                        causal: bool = True, sliding_window: int | None = None,
                        scale: float = 1.0, logits_soft_cap: float | None = None,
                        sinks: jax.Array | None = None) -> jax.Array:
  """softmax(mask(softcap(scale * q k^T)) [+ sink]) v in float32 (float64 for float64 inputs).
  Shapes as flash_attention (any head dims; integer inputs are rejected). Returns [B, Sq, H, Dv]
  in query.dtype; rows that attend to nothing are 0."""
  validation.check_qkv(query, key, value, kernel_head_dims=False)
  b, sq, h, _ = query.shape
  skv, kh = key.shape[1], key.shape[2]
  validation.check_tokens("query_positions", query_positions, "query_segment_ids",
                          query_segment_ids, b, sq)
  validation.check_tokens("kv_positions", kv_positions, "kv_segment_ids", kv_segment_ids, b, skv)
  scale, logits_soft_cap = validation.check_options(scale, logits_soft_cap, sinks, h)
  sliding_window = arguments.normalize_window(sliding_window)
  causal = arguments.as_bool("causal", causal)
  if validation.is_empty(query, key):
    return jnp.zeros((b, sq, h, value.shape[3]), query.dtype)
  group = h // kh
  ct = jnp.promote_types(query.dtype, jnp.float32)
  keep = dense_mask(query_positions, query_segment_ids, kv_positions, kv_segment_ids,
                    causal=causal, sliding_window=sliding_window)[:, None, None]
  # A row with no kept pair gets no gradient, whatever flows back (0 * NaN from a NaN scale).
  no_pair = ~jnp.any(keep[:, 0, 0], axis=-1)[:, :, None, None]
  query = jnp.where(no_pair, jax.lax.stop_gradient(query), query)
  q = query.astype(ct).reshape(b, sq, kh, group, -1)
  k = key.astype(ct)
  v = value.astype(ct)

  logits = jnp.einsum("bqkgd,btkd->bkgqt", q, k) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  logits = jnp.where(keep, logits, -jnp.inf)
  # NaN counts as something to attend.
  empty = ~jnp.any(keep & (logits != -jnp.inf), axis=-1, keepdims=True)

  row_max = jnp.max(logits, axis=-1, keepdims=True)
  if sinks is not None:
    sink = sinks.astype(ct).reshape(1, kh, group, 1, 1)
    row_max = jnp.maximum(row_max, sink)
  # Shift by 0 where the max is not finite, so empty rows get no NaN.
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  weights = jnp.where(keep, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sink - row_max)
  safe_denom = jnp.where(denom == 0, 1.0, denom)
  probs = jnp.where(keep & ~empty, weights / safe_denom, 0.0)
  finite_v = jnp.isfinite(v)
  out = jnp.einsum("bkgqt,btkd->bqkgd", probs, _finite_part(v))
  # Non-finite v reaches the rows attending its token (the product above read it as 0).
  reached = jax.lax.cond(
      jnp.all(finite_v),
      lambda: jnp.zeros(out.shape, bool),
      lambda: jnp.einsum("bkgqt,btkd->bqkgd", (keep & ~empty).astype(ct),
                         (~finite_v).astype(ct)) > 0)
  out = out + jnp.where(reached, jnp.nan, 0.0).astype(ct)
  return out.reshape(b, sq, h, -1).astype(query.dtype)


@jax.custom_vjp
def _finite_part(v):
  """v with non-finite entries read as 0 in the forward; its gradient is v's own."""
  return jnp.where(jnp.isfinite(v), v, 0.0)


_finite_part.defvjp(lambda v: (_finite_part(v), None), lambda _, g: (g,))
