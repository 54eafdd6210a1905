"""The MaxText versions this integration supports, and the check that what it wraps is unchanged.

This is the one place the supported version lives: patches/maxtext/<version>/ and the tests
read it from here.
"""

from __future__ import annotations

import inspect

SUPPORTED_MAXTEXT_VERSIONS: tuple[str, ...] = ("0.2.5",)

# The parameters install() relies on, per wrapped callable (a prefix of the real signature).
# If MaxText renames or reorders them, wrapping would misread arguments: refuse instead.
EXPECTED_SIGNATURES = {
    "AttentionOp.apply_attention": (
        "self", "query", "key", "value", "decoder_segment_ids", "segment_positions", "lengths",
        "model_mode", "use_ragged_attention", "previous_chunk", "bidirectional_mask", "sinks",
        "indexer_mask", "compressed_mask", "record_max_logits", "decoder_segment_ids_kv",
        "pad_kv_total", "compress_ratio", "qk_product_einsum", "wv_product_einsum"),
    "AttentionOp.apply_attention_dot": (
        "self", "query", "key", "value", "decoder_segment_ids", "model_mode", "previous_chunk"),
    "NNXDecoder.__call__": (
        "self", "shared_embedding", "decoder_input_tokens", "decoder_positions",
        "decoder_segment_ids", "deterministic", "model_mode", "previous_chunk"),
    "pyconfig.initialize": ("argv", "config_class"),
    "pyconfig.initialize_pydantic": ("argv", "config_class"),
    "train_utils.setup_train_loop": ("config", "recorder"),
    "maxtext_utils.get_reorder_callable": ("cp_size", "shard_mode", "reorder_strategy",
                                           "hardware"),
}


class MaxTextVersionError(RuntimeError):
  """The installed MaxText is not one this integration was written against."""


def installed_version() -> str:
  try:
    from maxtext import version
  except ImportError as e:
    raise ImportError("kvax_plugin.integrations.maxtext needs MaxText: pip install "
                      f"'kvax-plugin[maxtext]' (supported: {', '.join(SUPPORTED_MAXTEXT_VERSIONS)})"
                      ) from e
  return version.__version__


def _advice() -> str:
  return (f"kvax_plugin supports MaxText {', '.join(SUPPORTED_MAXTEXT_VERSIONS)}: install one of "
          f"them (pip install 'maxtext=={SUPPORTED_MAXTEXT_VERSIONS[-1]}'), or update "
          "kvax_plugin/integrations/maxtext (versions.py, seam.py) and patches/maxtext/ for the new "
          "version")


def check_version(allow_unsupported_version: bool = False) -> str:
  version = installed_version()
  if version not in SUPPORTED_MAXTEXT_VERSIONS and not allow_unsupported_version:
    raise MaxTextVersionError(f"MaxText {version} is installed. {_advice()}. "
                              "install(allow_unsupported_version=True) tries anyway when the "
                              "wrapped functions still have the expected signatures.")
  return version


def check_signature(label: str, fn) -> None:
  """Raise MaxTextVersionError when `fn`'s parameters no longer start with the expected ones."""
  fn = getattr(fn, "__kvax_original__", fn)
  params = tuple(inspect.signature(fn).parameters)
  expected = EXPECTED_SIGNATURES[label]
  missing = [p for p in expected if p not in params]
  positional = [p for p in params if p in expected]
  if missing or positional != list(expected):
    raise MaxTextVersionError(
        f"MaxText {installed_version()}: {label} changed (expected parameters {expected}, found "
        f"{params}). {_advice()}.")
