"""Constants and launch parameters shared by every attention backend."""

from __future__ import annotations

import dataclasses

from kvax_plugin.attention.arguments import as_int

# Segment id that marks a padding token: it attends to nothing and nothing attends to it.
PADDING_SEGMENT_ID = -1


@dataclasses.dataclass(frozen=True)
class FlashAttentionParamsConfig:
  """Block sizes and launch settings of one pass; the mask is built for them, so
  `create_attention_mask` and `flash_attention` get the same config. num_warps / num_stages: Triton
  only."""

  query_block_size: int = 128
  kv_block_size: int = 128
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):

    for name in ("query_block_size", "kv_block_size", "num_warps", "num_stages"):
      minimum = 1 if name in ("num_warps", "num_stages") else None
      value = as_int(f"FlashAttentionParamsConfig.{name}", getattr(self, name), minimum=minimum)
      object.__setattr__(self, name, value)
    for name in ("query_block_size", "kv_block_size"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(
            f"FlashAttentionParamsConfig.{name} must be a power of two >= 16, got {value!r}")


# Defaults for None (Triton may choose tuned ones through `default_params`).
DEFAULT_FWD_PARAMS = FlashAttentionParamsConfig(query_block_size=128, kv_block_size=128,
                                                num_warps=8, num_stages=3)
DEFAULT_BWD_PARAMS = FlashAttentionParamsConfig(query_block_size=128, kv_block_size=128,
                                                num_warps=8, num_stages=2)


def check_params(name: str, params) -> None:
  """fwd_params / bwd_params: a FlashAttentionParamsConfig or None."""
  if params is not None and not isinstance(params, FlashAttentionParamsConfig):
    raise TypeError(f"{name} must be a FlashAttentionParamsConfig or None, got "
                    f"{type(params).__name__} {params!r}; build one with "
                    "FlashAttentionParamsConfig(query_block_size=..., kv_block_size=..., ...)")
