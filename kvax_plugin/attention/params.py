"""Constants and launch parameters shared by every attention backend."""

from __future__ import annotations

import dataclasses

# Segment id that marks a padding token: it attends to nothing and nothing attends to it.
PADDING_SEGMENT_ID = -1


@dataclasses.dataclass(frozen=True)
class FlashAttentionParamsConfig:
  """Block sizes and launch settings of one attention pass (forward, or backward).

  The block mask is built for specific block sizes, so the same config must be passed to
  `create_attention_mask` and `flash_attention`. `num_warps` / `num_stages` only matter for
  the Triton backend; the JAX backend reads the block sizes alone.
  """

  query_block_size: int = 128
  kv_block_size: int = 128
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    for name in ("query_block_size", "kv_block_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(
            f"FlashAttentionParamsConfig.{name} must be a power of two >= 16, got {value!r}")
    for name in ("num_warps", "num_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"FlashAttentionParamsConfig.{name} must be a positive int, got {value!r}")


# Defaults used when the caller passes None. Backends with tuned per-GPU settings (Triton)
# may choose other values through `default_params`; the mask records what it was built with.
DEFAULT_FWD_PARAMS = FlashAttentionParamsConfig(query_block_size=128, kv_block_size=128,
                                                num_warps=8, num_stages=3)
DEFAULT_BWD_PARAMS = FlashAttentionParamsConfig(query_block_size=128, kv_block_size=128,
                                                num_warps=8, num_stages=2)
