"""install() / uninstall(): route MaxText's attention="kvax" to the seam, reversibly.

Replaced, each remembered with its original: AttentionOp.apply_attention (kvax when
attention_kernel == "kvax"), NNXDecoder.__call__ (seam.decoder_entry),
train_utils.setup_train_loop (batch_order.setup_train_loop_entry) and pyconfig.initialize[_pydantic]
(config_class with the kvax_* keys). A MaxText patched with patches/maxtext/<version>/ only gets
the config class.
"""

from __future__ import annotations

import functools
import threading

from kvax_plugin.integrations.maxtext import batch_order, seam, settings, versions

_LOCK = threading.Lock()
_ORIGINALS: dict[tuple[object, str], object] = {}


def _targets():
  from maxtext.configs import pyconfig
  from maxtext.layers import attention_op, nnx_decoders
  return attention_op, nnx_decoders, pyconfig


def _train_targets():
  from maxtext.utils import maxtext_utils, train_utils
  return maxtext_utils, train_utils


def is_patched() -> bool:
  attention_op, _, _ = _targets()
  return bool(getattr(attention_op, "KVAX_PATCHED", False))


def is_installed() -> bool:
  return bool(_ORIGINALS)


def _routed_apply_attention(original):
  @functools.wraps(original)
  def apply_attention(self, *args, **kwargs):
    if self.attention_kernel == seam.ATTENTION_NAME:
      return seam.apply_attention(self, *args, **kwargs)
    return original(self, *args, **kwargs)

  apply_attention.__kvax_original__ = original
  return apply_attention


def _with_kvax_config_class(original):
  from maxtext.configs import types

  @functools.wraps(original)
  def initialize(argv=None, config_class=types.MaxTextConfig, **kwargs):
    # Only MaxText's own default class is replaced.
    if config_class is types.MaxTextConfig:
      config_class = settings.kvax_config_class()
    return original(argv, config_class=config_class, **kwargs)

  initialize.__kvax_original__ = original
  return initialize


def _replace(owner, name: str, new) -> None:
  _ORIGINALS[(owner, name)] = owner.__dict__[name]
  setattr(owner, name, new)


def install(*, allow_unsupported_version: bool = False) -> None:
  """Make attention="kvax" a MaxText attention kernel. Idempotent; undo with uninstall().
  Raises MaxTextVersionError for an unsupported MaxText or changed wrapped signatures."""
  with _LOCK:
    if _ORIGINALS:
      return
    versions.check_version(allow_unsupported_version)
    attention_op, nnx_decoders, pyconfig = _targets()
    maxtext_utils, train_utils = _train_targets()
    checks = {
        "AttentionOp.apply_attention": attention_op.AttentionOp.apply_attention,
        "AttentionOp.apply_attention_dot": attention_op.AttentionOp.apply_attention_dot,
        "NNXDecoder.__call__": nnx_decoders.NNXDecoder.__call__,
        "pyconfig.initialize": pyconfig.initialize,
        "pyconfig.initialize_pydantic": pyconfig.initialize_pydantic,
        "train_utils.setup_train_loop": train_utils.setup_train_loop,
        "maxtext_utils.get_reorder_callable": maxtext_utils.get_reorder_callable,
    }
    for label, fn in checks.items():
      versions.check_signature(label, fn)
    settings.kvax_config_class()
    if not is_patched():
      _replace(attention_op.AttentionOp, "apply_attention",
               _routed_apply_attention(attention_op.AttentionOp.apply_attention))
      _replace(nnx_decoders.NNXDecoder, "__call__",
               seam.decoder_entry(nnx_decoders.NNXDecoder.__call__))
      _replace(train_utils, "setup_train_loop",
               batch_order.setup_train_loop_entry(train_utils.setup_train_loop))
    _replace(pyconfig, "initialize", _with_kvax_config_class(pyconfig.initialize))
    _replace(pyconfig, "initialize_pydantic",
             _with_kvax_config_class(pyconfig.initialize_pydantic))


def uninstall() -> None:
  """Restore every attribute install() replaced (no-op when not installed)."""
  with _LOCK:
    for (owner, name), original in reversed(list(_ORIGINALS.items())):
      setattr(owner, name, original)
    _ORIGINALS.clear()
