"""Attention provider registry: what a model stack selects by name (MaxText's attention=kvax).

An *attention provider* is the stack-facing unit: a name, a once-per-step `prepare` and a
per-layer `apply` (base.py). It is not a kernel backend (the `backend=` argument of
flash_attention, kvax_plugin.attention.kernels): the `kvax` provider runs whichever kernel
backend its options name.

Providers register here by name (built-in ones on import, third-party ones through the
`kvax_plugin.providers` entry point group). `get_provider(name)` never substitutes another
provider for the one asked: an unknown name is an error listing the known ones.
"""

from __future__ import annotations

import importlib.metadata
import threading

from kvax_plugin.providers.base import AttentionProvider, LayerSettings, PreparedAttention

ENTRY_POINT_GROUP = "kvax_plugin.providers"

_REGISTRY: dict[str, AttentionProvider] = {}
_LOCK = threading.Lock()
_entry_points_loaded = False


def register_provider(provider: AttentionProvider, *, replace: bool = False) -> AttentionProvider:
  """Add a provider under provider.name; re-registering a different object needs replace=True."""
  if not isinstance(provider, AttentionProvider):
    raise TypeError(f"provider must be an AttentionProvider, got {type(provider).__name__}")
  with _LOCK:
    existing = _REGISTRY.get(provider.name)
    if existing is not None and existing is not provider and not replace:
      raise ValueError(f"an attention provider named {provider.name!r} is already registered; "
                       "pass replace=True to override it")
    _REGISTRY[provider.name] = provider
  return provider


def _load_entry_points() -> None:
  # Entry points are loaded lazily (and once) so importing kvax_plugin stays cheap.
  global _entry_points_loaded
  if _entry_points_loaded:
    return
  _entry_points_loaded = True
  for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    if ep.name in _REGISTRY:
      continue
    provider = ep.load()
    if not isinstance(provider, AttentionProvider) or provider.name != ep.name:
      raise TypeError(f"entry point {ep.name!r} = {ep.value} in group {ENTRY_POINT_GROUP!r} must "
                      f"name an AttentionProvider called {ep.name!r}, got {provider!r}")
    register_provider(provider)


def _ensure_builtin() -> None:
  if "kvax" not in _REGISTRY:
    # Local import: the built-in provider pulls in the attention op, which a stack that only
    # lists providers need not pay for until it asks for one.
    from kvax_plugin.providers.kvax_provider import KVAX_PROVIDER
    register_provider(KVAX_PROVIDER)


def available_providers() -> tuple[str, ...]:
  _ensure_builtin()
  _load_entry_points()
  return tuple(sorted(_REGISTRY))


def get_provider(name: str) -> AttentionProvider:
  """The provider registered as `name` (loads built-ins and entry points on first use)."""
  _ensure_builtin()
  if name not in _REGISTRY:
    _load_entry_points()
  if name not in _REGISTRY:
    raise KeyError(f"unknown attention provider {name!r}; registered: "
                   f"{', '.join(sorted(_REGISTRY))}")
  return _REGISTRY[name]


__all__ = ["AttentionProvider", "LayerSettings", "PreparedAttention", "register_provider",
           "get_provider", "available_providers", "ENTRY_POINT_GROUP"]
