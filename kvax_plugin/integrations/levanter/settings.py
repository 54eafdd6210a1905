"""kvax settings for Levanter: which kvax kernel, and its block sizes.

Not in the model config (draccus rejects unknown keys). First of: `configure(...)` /
`install(settings=...)` (the launcher's --kvax.* flags), the environment (KVAX_LEVANTER_BACKEND,
KVAX_LEVANTER_BLOCK_SIZE), the defaults. `flash_attention_block_size` is not read (Levanter's own
kernels' blocks, too large for kvax's).
"""

from __future__ import annotations

import dataclasses
import os
import threading

import kvax_plugin

ENV_BACKEND = "KVAX_LEVANTER_BACKEND"
ENV_BLOCK_SIZE = "KVAX_LEVANTER_BLOCK_SIZE"


def _check_block(name: str, value) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
    raise ValueError(f"{name}={value!r}: must be a power of two >= 16 (or None for kvax's default)")


@dataclasses.dataclass(frozen=True)
class KvaxLevanterSettings:
  """kvax options for every Levanter attention call with attn_backend=kvax.

  kernel: a kvax backend name: "auto", "mosaic", "triton", "jax" or "reference"; an explicit
    kernel never falls back to another.
  block_size: query and key/value block size of both passes (power of two >= 16); None: kvax's.
  memory_optimized_gqa_backward, deterministic_backward: see kvax_plugin.flash_attention
    (kernel="hopper" refuses deterministic_backward=True).
  skip_pad_tokens: skip blocks of kvax padding; no effect here, as the seam maps Levanter's
    padding to ordinary segments.
  """

  kernel: str = "auto"
  block_size: int | None = None
  memory_optimized_gqa_backward: bool = False
  deterministic_backward: bool = False
  skip_pad_tokens: bool = True

  def __post_init__(self):
    try:
      kvax_plugin.resolve_backend(self.kernel)
    except kvax_plugin.BackendUnavailableError:
      pass  # not runnable here: the call will say why
    except ValueError as e:
      raise ValueError(f"kernel={self.kernel!r}: {e}") from None
    _check_block("block_size", self.block_size)

  def params(self):
    """(fwd_params, bwd_params) for the mask and the op; (None, None) means kvax's defaults."""
    block = self.block_size
    if block is None:
      return None, None
    fwd = kvax_plugin.FlashAttentionParamsConfig(query_block_size=block, kv_block_size=block)
    bwd = kvax_plugin.FlashAttentionParamsConfig(query_block_size=block, kv_block_size=block,
                                                 num_stages=2)
    return fwd, bwd

  def provider_options(self, options_type, **mesh_fields):
    """`options_type` (the provider's options class) for these settings plus `mesh_fields`."""
    fwd, bwd = self.params()
    return options_type(backend=self.kernel, fwd_params=fwd, bwd_params=bwd,
                        memory_optimized_gqa_backward=self.memory_optimized_gqa_backward,
                        deterministic_backward=self.deterministic_backward,
                        skip_pad_tokens=self.skip_pad_tokens, **mesh_fields)


def from_environment() -> KvaxLevanterSettings:
  """Settings from KVAX_LEVANTER_BACKEND / KVAX_LEVANTER_BLOCK_SIZE (defaults where unset)."""
  kernel = os.environ.get(ENV_BACKEND, "auto") or "auto"
  block = os.environ.get(ENV_BLOCK_SIZE)
  if block:
    try:
      block = int(block)
    except ValueError:
      raise ValueError(f"{ENV_BLOCK_SIZE}={block!r}: must be an integer") from None
  else:
    block = None
  try:
    return KvaxLevanterSettings(kernel=kernel, block_size=block)
  except ValueError as e:
    raise ValueError(f"from the environment ({ENV_BACKEND} / {ENV_BLOCK_SIZE}): {e}") from None


_LOCK = threading.Lock()
_CURRENT: KvaxLevanterSettings | None = None


def current() -> KvaxLevanterSettings:
  """The settings in force (configure()'s, else the environment's, read on first use)."""
  global _CURRENT
  with _LOCK:
    if _CURRENT is None:
      _CURRENT = from_environment()
    return _CURRENT


def configure(settings: KvaxLevanterSettings | None = None, **changes) -> KvaxLevanterSettings:
  """Set the settings (a KvaxLevanterSettings, or field=value changes); returns the previous
  ones. Takes effect at the next trace."""
  global _CURRENT
  if settings is not None and changes:
    raise TypeError("configure() takes a KvaxLevanterSettings or field=value changes, not both")
  if settings is not None and not isinstance(settings, KvaxLevanterSettings):
    raise TypeError(f"settings must be a KvaxLevanterSettings, got {type(settings).__name__}")
  previous = current()
  new = settings if settings is not None else dataclasses.replace(previous, **changes)
  with _LOCK:
    _CURRENT = new
  return previous
