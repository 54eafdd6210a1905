"""install() / uninstall(): make attn_backend=kvax a Levanter attention backend, reversibly.

install() changes only: AttentionBackend (gains KVAX = "kvax", so `attn_backend: kvax` parses),
dot_product_attention wherever imported by name (seam), and DECODER_ENTRIES' __call__
(seam.decoder_entry). uninstall() restores all of it.
"""

from __future__ import annotations

import importlib
import sys
import threading

from kvax_plugin.integrations.levanter import seam, versions

_LOCK = threading.Lock()
_ORIGINALS: list[tuple[object, str, object]] = []  # (owner, attribute, original value)
_ENUM_MEMBER = "KVAX"

DECODER_ENTRIES = {
    "levanter.models.llama": ("LlamaTransformer",),  # llama, qwen3, mistral
    "levanter.models.qwen": ("QwenTransformer",),
    "levanter.models.gemma": ("GemmaTransformer", "Gemma2Transformer"),  # gemma, gemma2, gemma3
    "levanter.models.olmo": ("Olmo2Transformer",),
    "levanter.models.olmo3": ("Olmo3Transformer",),
    "levanter.models.mixtral": ("MixtralTransformer",),
    "levanter.models.qwen3_moe": ("Qwen3MoeTransformer",),
    "levanter.models.apertus": ("ApertusTransformer",),
}
# Import dot_product_attention by name; routed, with masks built per call.
NAMED_IMPORTERS = ("levanter.models.gpt2", "levanter.models.whisper",
                   "levanter.models.modernbert", "levanter.models.olmo")


def is_installed() -> bool:
  return bool(_ORIGINALS)


def _replace(owner, name: str, new) -> None:
  _ORIGINALS.append((owner, name, owner.__dict__[name]))
  setattr(owner, name, new)


def _add_enum_member(enum_cls) -> None:
  """AttentionBackend.KVAX = "kvax" (Python enums have no public way to add a member)."""
  if seam.ATTENTION_BACKEND_NAME in enum_cls._value2member_map_:
    return
  member = str.__new__(enum_cls, seam.ATTENTION_BACKEND_NAME)
  member._name_ = _ENUM_MEMBER
  member._value_ = seam.ATTENTION_BACKEND_NAME
  member._sort_order_ = len(enum_cls._member_names_)
  enum_cls._member_map_[_ENUM_MEMBER] = member
  enum_cls._value2member_map_[seam.ATTENTION_BACKEND_NAME] = member
  enum_cls._member_names_.append(_ENUM_MEMBER)
  type.__setattr__(enum_cls, _ENUM_MEMBER, member)
  _ORIGINALS.append((enum_cls, "<enum member>", None))


def _remove_enum_member(enum_cls) -> None:
  member = enum_cls._member_map_.pop(_ENUM_MEMBER, None)
  if member is None:
    return
  enum_cls._value2member_map_.pop(seam.ATTENTION_BACKEND_NAME, None)
  enum_cls._member_names_.remove(_ENUM_MEMBER)
  type.__delattr__(enum_cls, _ENUM_MEMBER)


def install(*, settings=None, allow_unsupported_version: bool = False) -> None:
  """Make attn_backend=kvax a Levanter attention backend. Idempotent; undo with uninstall().

  settings: a KvaxLevanterSettings to configure() too (optional). LevanterVersionError for an
  unsupported Levanter version or changed parameters of a wrapped function.
  """
  from kvax_plugin.integrations.levanter import settings as settings_mod
  with _LOCK:
    if settings is not None:
      settings_mod.configure(settings)
    if _ORIGINALS:
      return
    versions.check_version(allow_unsupported_version)
    from levanter.layers import attention, attention_mask
    versions.check_signature("levanter.layers.attention.dot_product_attention",
                             "dot_product_attention", attention.dot_product_attention)
    versions.check_mask_fields(attention_mask.AttentionMask)
    entries = []
    for module_name, class_names in DECODER_ENTRIES.items():
      module = importlib.import_module(module_name)
      for class_name in class_names:
        cls = getattr(module, class_name)
        versions.check_signature(f"{module_name}.{class_name}.__call__", "Transformer.__call__",
                                 cls.__dict__["__call__"])
        entries.append(cls)
    for module_name in NAMED_IMPORTERS:
      importlib.import_module(module_name)

    try:
      _add_enum_member(attention.AttentionBackend)
      original = attention.dot_product_attention
      routed = seam.routed_dot_product_attention(original)
      for name, module in sorted(sys.modules.items()):
        if (name == "levanter" or name.startswith("levanter.")) and \
            module.__dict__.get("dot_product_attention") is original:
          _replace(module, "dot_product_attention", routed)
      for cls in entries:
        _replace(cls, "__call__", seam.decoder_entry(cls.__dict__["__call__"]))
    except BaseException:
      _restore()
      raise


def _restore() -> None:
  for owner, name, original in reversed(_ORIGINALS):
    if name == "<enum member>":
      _remove_enum_member(owner)
    else:
      setattr(owner, name, original)
  _ORIGINALS.clear()


def uninstall() -> None:
  """Restore everything install() changed (no-op when not installed). Configs holding
  AttentionBackend.KVAX keep it, and Levanter's dispatch does not know it."""
  with _LOCK:
    _restore()
