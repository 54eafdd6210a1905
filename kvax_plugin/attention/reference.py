"""Dense reference attention: the semantics of shared/DESIGN.md section 2, read as math.

O(S^2) memory, for tests and checks; imports nothing beyond JAX. It defines what non-finite
inputs do (README, "NaN and inf"), which every backend follows: a row with nothing to attend is
0 whatever the inputs hold; otherwise a NaN or +inf kept logit makes the row NaN, a non-finite
v reaches exactly the rows attending its token, a NaN sink makes its head's non-empty rows NaN.
Block kernels may spread a non-finite value to rows sharing a visited block: more NaN, never
less.
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
  """softmax(mask(softcap(scale * q k^T)) [+ sink]) v, computed in float32 (float64 for float64).

  Args:
    query: [B, Sq, H, Dqk]; key: [B, Skv, K, Dqk]; value: [B, Skv, K, Dv]; H % K == 0,
      query head h reads kv head h // (H // K). Floating point (integer inputs are rejected).
    *_positions, *_segment_ids: int [B, S]; PADDING_SEGMENT_ID (-1) marks padding.
    sinks: optional [H]: one extra logit per query head in the softmax denominator (no value).

  Returns:
    [B, Sq, H, Dv] in query.dtype. Rows that attend to nothing are 0.
  """
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
  ct = jnp.promote_types(query.dtype, jnp.float32)  # float32, or float64 for float64 inputs
  keep = dense_mask(query_positions, query_segment_ids, kv_positions, kv_segment_ids,
                    causal=causal, sliding_window=sliding_window)[:, None, None]  # [B,1,1,Sq,Skv]
  # A row with no kept pair gets no gradient, whatever flows back (0 * NaN from a NaN scale).
  no_pair = ~jnp.any(keep[:, 0, 0], axis=-1)[:, :, None, None]  # [B, Sq, 1, 1]
  query = jnp.where(no_pair, jax.lax.stop_gradient(query), query)
  q = query.astype(ct).reshape(b, sq, kh, group, -1)
  k = key.astype(ct)
  v = value.astype(ct)

  logits = jnp.einsum("bqkgd,btkd->bkgqt", q, k) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  logits = jnp.where(keep, logits, -jnp.inf)
  # Nothing to attend: no kept pair, or only -inf logits (NaN counts as something).
  empty = ~jnp.any(keep & (logits != -jnp.inf), axis=-1, keepdims=True)  # [B, K, G, Sq, 1]

  row_max = jnp.max(logits, axis=-1, keepdims=True)
  if sinks is not None:
    sink = sinks.astype(ct).reshape(1, kh, group, 1, 1)
    row_max = jnp.maximum(row_max, sink)
  # Shift by 0 where the max is not finite (empty rows: -inf), so no NaN appears there; a NaN
  # or +inf max still yields NaN below through exp(logit - 0).
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  weights = jnp.where(keep, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sink - row_max)
  safe_denom = jnp.where(denom == 0, 1.0, denom)  # not `denom > 0`: NaN must stay NaN
  # `where` again so a NaN denominator does not leak into masked pairs (0 / NaN).
  probs = jnp.where(keep & ~empty, weights / safe_denom, 0.0)
  finite_v = jnp.isfinite(v)
  out = jnp.einsum("bkgqt,btkd->bqkgd", probs, _finite_part(v))
  # Non-finite v reaches the rows that attend its token, as NaN (the product above used 0 so
  # that masked pairs stay clean; this restores it for kept ones). Skipped when v is finite.
  reached = jax.lax.cond(
      jnp.all(finite_v),
      lambda: jnp.zeros(out.shape, bool),
      lambda: jnp.einsum("bkgqt,btkd->bqkgd", (keep & ~empty).astype(ct),
                         (~finite_v).astype(ct)) > 0)
  out = out + jnp.where(reached, jnp.nan, 0.0).astype(ct)
  return out.reshape(b, sq, h, -1).astype(query.dtype)


@jax.custom_vjp
def _finite_part(v):
  """v with non-finite entries read as 0 in the forward; the gradient is that of v itself
  (dv = P^T dO does not depend on v, so a NaN entry still gets its true gradient)."""
  return jnp.where(jnp.isfinite(v), v, 0.0)


_finite_part.defvjp(lambda v: (_finite_part(v), None), lambda _, g: (g,))
