"""Attention backend registry.

Backends register here by name (built-in ones on import, third-party ones through the
`kvax_plugin.backends` entry point group). `get_backend(name)` never substitutes another
backend for the one asked: an unknown name is an error listing the known ones.
"""

from __future__ import annotations

import importlib.metadata
import threading

from kvax_plugin.backends.base import AttentionBackend, LayerSettings, PreparedAttention

ENTRY_POINT_GROUP = "kvax_plugin.backends"

_REGISTRY: dict[str, AttentionBackend] = {}
_LOCK = threading.Lock()
_entry_points_loaded = False


def register_backend(backend: AttentionBackend, *, replace: bool = False) -> AttentionBackend:
  """Add a backend under backend.name; re-registering a different object needs replace=True."""
  if not isinstance(backend, AttentionBackend):
    raise TypeError(f"backend must be an AttentionBackend, got {type(backend).__name__}")
  with _LOCK:
    existing = _REGISTRY.get(backend.name)
    if existing is not None and existing is not backend and not replace:
      raise ValueError(f"an attention backend named {backend.name!r} is already registered; "
                       "pass replace=True to override it")
    _REGISTRY[backend.name] = backend
  return backend


def _load_entry_points() -> None:
  # Entry points are loaded lazily (and once) so importing kvax_plugin stays cheap.
  global _entry_points_loaded
  if _entry_points_loaded:
    return
  _entry_points_loaded = True
  for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    if ep.name in _REGISTRY:
      continue
    backend = ep.load()
    if not isinstance(backend, AttentionBackend) or backend.name != ep.name:
      raise TypeError(f"entry point {ep.name!r} = {ep.value} in group {ENTRY_POINT_GROUP!r} must "
                      f"name an AttentionBackend called {ep.name!r}, got {backend!r}")
    register_backend(backend)


def _ensure_builtin() -> None:
  if "kvax" not in _REGISTRY:
    from kvax_plugin.backends import kvax_backend  # registers itself
    del kvax_backend


def available_backends() -> tuple[str, ...]:
  _ensure_builtin()
  _load_entry_points()
  return tuple(sorted(_REGISTRY))


def get_backend(name: str) -> AttentionBackend:
  """The backend registered as `name` (loads built-ins and entry points on first use)."""
  _ensure_builtin()
  if name not in _REGISTRY:
    _load_entry_points()
  if name not in _REGISTRY:
    raise KeyError(f"unknown attention backend {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
  return _REGISTRY[name]


__all__ = ["AttentionBackend", "LayerSettings", "PreparedAttention", "register_backend",
           "get_backend", "available_backends", "ENTRY_POINT_GROUP"]
