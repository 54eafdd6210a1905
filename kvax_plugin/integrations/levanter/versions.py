"""The Levanter versions this integration supports, and the checks that what it wraps is unchanged.

This is the one place the supported version lives (setup.cfg's [levanter] extra pins the same).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect

SUPPORTED_LEVANTER_VERSIONS: tuple[str, ...] = ("0.2.227.dev40316220070",)
DISTRIBUTION = "marin-levanter"

# The parameters install() relies on, per wrapped callable (a prefix of the real signature).
# If Levanter renames or reorders them, wrapping would misread arguments: refuse instead.
EXPECTED_SIGNATURES = {
    "dot_product_attention": (
        "QPos", "KPos", "Key", "query", "key", "value", "mask", "bias", "attention_dtype",
        "precision", "use_flash", "attn_backend", "flash_block_size", "dropout",
        "logits_soft_cap", "scaling_factor", "inference", "prng", "attn_sink"),
    "Transformer.__call__": ("self", "x", "attn_mask", "key", "pos_ids"),
}
# Fields of levanter.layers.attention_mask.AttentionMask the seam reads.
EXPECTED_MASK_FIELDS = ("is_causal", "causal_offset", "explicit_mask", "segment_ids",
                        "sliding_window", "bidirectional_window")


class LevanterVersionError(RuntimeError):
  """The installed Levanter is not one this integration was written against."""


def installed_version() -> str:
  try:
    return importlib.metadata.version(DISTRIBUTION)
  except importlib.metadata.PackageNotFoundError as e:
    raise ImportError("kvax_plugin.integrations.levanter needs Levanter: pip install "
                      f"'kvax-plugin[levanter]' (supported {DISTRIBUTION}: "
                      f"{', '.join(SUPPORTED_LEVANTER_VERSIONS)})") from e


def _advice() -> str:
  return (f"kvax_plugin supports {DISTRIBUTION} {', '.join(SUPPORTED_LEVANTER_VERSIONS)}: install "
          f"it (pip install 'kvax-plugin[levanter]' -c constraints-levanter.txt), or update "
          "kvax_plugin/integrations/levanter (versions.py, seam.py) for the new version")


def check_version(allow_unsupported_version: bool = False) -> str:
  version = installed_version()
  if version not in SUPPORTED_LEVANTER_VERSIONS and not allow_unsupported_version:
    raise LevanterVersionError(f"{DISTRIBUTION} {version} is installed. {_advice()}. "
                               "install(allow_unsupported_version=True) tries anyway when the "
                               "wrapped functions still have the expected signatures.")
  return version


def check_signature(label: str, expected_key: str, fn) -> None:
  """Raise LevanterVersionError when `fn` no longer has the expected parameters, in order."""
  fn = getattr(fn, "__kvax_original__", fn)
  params = tuple(inspect.signature(fn).parameters)
  expected = EXPECTED_SIGNATURES[expected_key]
  missing = [p for p in expected if p not in params]
  ordered = [p for p in params if p in expected]
  if missing or ordered != list(expected):
    raise LevanterVersionError(
        f"{DISTRIBUTION} {installed_version()}: {label} changed (expected parameters {expected}, "
        f"found {params}). {_advice()}.")


def check_mask_fields(mask_cls) -> None:
  names = {f.name for f in dataclasses.fields(mask_cls)}
  missing = [n for n in EXPECTED_MASK_FIELDS if n not in names]
  if missing:
    raise LevanterVersionError(
        f"{DISTRIBUTION} {installed_version()}: AttentionMask lost the fields {missing}. "
        f"{_advice()}.")
