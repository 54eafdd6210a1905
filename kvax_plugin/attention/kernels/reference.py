"""backend="reference": the dense float32 reference (attention/reference.py) behind the kernel
calling convention, reading causal / sliding_window from the mask's spec.

O(S^2) memory: for tests and for checking the other backends on small inputs.
"""

from __future__ import annotations

import jax

from kvax_plugin.attention.block_mask import AttentionMask
from kvax_plugin.attention.kernels.capabilities import Capabilities
from kvax_plugin.attention.reference import reference_attention

# Every dtype, head dim and feature the public op accepts (dense float32 math; float64 in float64).
CAPABILITIES = Capabilities(dtypes=("float32", "bfloat16", "float16", "float64"))


def reference_with_mask(query: jax.Array, key: jax.Array, value: jax.Array,
                        query_positions: jax.Array, query_segment_ids: jax.Array,
                        kv_positions: jax.Array, kv_segment_ids: jax.Array, mask: AttentionMask,
                        *, scale: float, logits_soft_cap: float | None,
                        sinks: jax.Array | None) -> jax.Array:
  """query [B, Sq, H, Dqk], key [B, Skv, K, Dqk], value [B, Skv, K, Dv] -> [B, Sq, H, Dv].

  The mask's tables are not read (the reference masks every pair exactly); only its spec is.
  """
  return reference_attention(query, key, value, query_positions, query_segment_ids, kv_positions,
                             kv_segment_ids, causal=mask.spec.causal,
                             sliding_window=mask.spec.sliding_window, scale=scale,
                             logits_soft_cap=logits_soft_cap, sinks=sinks)
