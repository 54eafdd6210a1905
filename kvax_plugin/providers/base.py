"""What an attention provider is: a name, a once-per-step `prepare`, and a per-layer `apply`.

Integrations use only these types and the registry (get_provider): the per-step state (the
block mask) is built once at the decoder entry and every layer reuses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax


@dataclasses.dataclass(frozen=True)
class LayerSettings:
  """Per-layer attention settings (static: they select the mask and specialise the kernel).

  causal: keep only kv_pos <= q_pos.
  sliding_window: keep only q_pos - kv_pos < sliding_window (None: no window).
  logits_soft_cap: cap * tanh(logits / cap) before masking (None: no cap).
  scale: multiplies q k^T; MaxText pre-scales the query, so it passes 1.0.
  """

  causal: bool = True
  sliding_window: int | None = None
  logits_soft_cap: float | None = None
  scale: float = 1.0

  def __post_init__(self):
    w = self.sliding_window
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
      raise ValueError(f"LayerSettings.sliding_window must be a positive int or None, got {w!r}")
    cap = self.logits_soft_cap
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
      raise ValueError(f"LayerSettings.logits_soft_cap must be a positive float or None, got {cap!r}")

  @property
  def mask_key(self) -> tuple[bool, int | None]:
    """Which prepared mask this layer reads: layers sharing it share one build."""
    return (self.causal, self.sliding_window)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PreparedAttention:
  """State built once per step and read by every layer (a pytree). Tokens: kvax's convention
  (PADDING_SEGMENT_ID = -1); `masks`: LayerSettings.mask_key -> the provider's mask."""

  query_positions: jax.Array
  query_segment_ids: jax.Array
  kv_positions: jax.Array
  kv_segment_ids: jax.Array
  masks: Mapping[tuple[bool, int | None], Any]
  provider: str
  options: Any = None  # provider-specific static options (hashable)

  def tree_flatten(self):
    keys = tuple(sorted(self.masks, key=repr))
    children = (self.query_positions, self.query_segment_ids, self.kv_positions,
                self.kv_segment_ids, tuple(self.masks[k] for k in keys))
    return children, (keys, self.provider, self.options)

  @classmethod
  def tree_unflatten(cls, aux, children):
    keys, provider, options = aux
    qp, qs, kp, ks, masks = children
    return cls(qp, qs, kp, ks, dict(zip(keys, masks)), provider, options)

  def mask_for(self, settings: LayerSettings):
    try:
      return self.masks[settings.mask_key]
    except KeyError:
      have = ", ".join(f"(causal={c}, sliding_window={w})" for c, w in self.masks) or "none"
      raise KeyError(
          f"no prepared mask for causal={settings.causal}, sliding_window="
          f"{settings.sliding_window}; prepare() built: {have}. Pass this layer's window to "
          "prepare(mask_keys=...) at the decoder entry.") from None


@dataclasses.dataclass(frozen=True)
class AttentionProvider:
  """A named attention provider.

  prepare(query_positions, query_segment_ids, kv_positions=None, kv_segment_ids=None, *,
          mask_keys, options) -> PreparedAttention
  apply(query, key, value, prepared, settings, *, sinks=None) -> [B, Sq, H, Dv]
  options_type: the class of prepare's `options` (frozen, hashable; None: it takes none).
  """

  name: str
  prepare: Callable[..., PreparedAttention]
  apply: Callable[..., jax.Array]
  description: str = ""
  options_type: type | None = None
