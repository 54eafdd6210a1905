"""The seam between Levanter and kvax: one block mask per step, read by every layer.

`decoder_entry` wraps Transformer.__call__: while traced, it builds the masks (the "kvax"
provider's prepare()) and exposes them through a ContextVar that the layers (in fold / scan /
remat) read. `dot_product_attention` sends attn_backend=kvax calls to the provider's apply().

Positions are row indices. Levanter's padding (id -1) attends earlier padding and feeds the MoE
router losses, so negative ids get segments of their own (kvax_tokens), not PADDING_SEGMENT_ID.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import logging
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.integrations.levanter import axes, settings
from kvax_plugin.providers import LayerSettings, PreparedAttention, get_provider

ATTENTION_BACKEND_NAME = "kvax"  # the value of Levanter's attn_backend that selects kvax
PROVIDER = "kvax"  # the attention provider (kvax_plugin.providers) that serves those calls
Q_POS = "position"  # the sequence axis names Levanter's attention layers use
KV_POS = "key_position"

logger = logging.getLogger("kvax_plugin.integrations.levanter")

MaskKey = tuple[bool, "int | None"]  # (causal, window) of one kvax block mask


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What the decoder entry built for one decoder call (arrays are tracers of that trace)."""

  batch: tuple  # haliax Axes flattened into kvax's batch dimension
  length: int
  attention: PreparedAttention  # the provider's: int32 [B, S] tokens, one mask per MaskKey
  mesh: object | None
  tokens: axes.TokenSpecs | None


@dataclasses.dataclass(frozen=True)
class _Scope:
  owner: object  # the Transformer whose __call__ set this scope
  prepared: Prepared | None
  unsupported: str | None = None  # why this decoder call goes to Levanter's path


_ACTIVE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("kvax_levanter_scope",
                                                                        default=None)
_NOTED: set[str] = set()
# Trace-time counts (layer_calls: once per scan body; per_call_masks: built without an entry;
# routed: sent to Levanter; sharded_calls: on a mesh, query specs in SHARDED_SPECS).
TRACE_COUNTS = {"entries": 0, "entry_masks": 0, "layer_calls": 0, "per_call_masks": 0,
                "routed": 0, "sharded_calls": 0}
SHARDED_SPECS: set = set()


def note_once(message: str) -> None:
  if message not in _NOTED:
    _NOTED.add(message)
    logger.warning(message)


def uses_kvax(backend) -> bool:
  return backend is not None and str(backend) == ATTENTION_BACKEND_NAME


# ----------------------------------------------------------------------------- masks


def mask_key(mask) -> tuple[MaskKey | None, str | None]:
  """(causal, window) of a Levanter mask, or (None, why kvax cannot serve it). A sliding
  window w is causal; a bidirectional window r is kvax's non-causal window r + 1."""
  from levanter.layers.attention_mask import AttentionMask
  from haliax import NamedArray
  if mask is None:
    return (False, None), None
  if isinstance(mask, NamedArray):
    return None, "a dense (NamedArray) attention mask"
  if not isinstance(mask, AttentionMask):
    return None, f"an attention mask of type {type(mask).__name__}"
  if mask.explicit_mask is not None:
    return None, "an AttentionMask with an explicit (dense) mask"
  if mask.is_causal and mask.causal_offset is not None:
    return None, "a causal mask with an offset (causal_offset)"
  causal = bool(mask.is_causal) or mask.sliding_window is not None
  windows = []
  if mask.sliding_window is not None:
    windows.append(int(mask.sliding_window))
  if mask.bidirectional_window is not None:
    windows.append(int(mask.bidirectional_window) + 1)
  window = min(windows) if windows else None
  if window is not None and window < 1:
    return None, f"an empty window (sliding_window={mask.sliding_window})"
  return (causal, window), None


def _layer_windows(module) -> set:
  """Sliding windows that the module's attention layers set on their masks (per layer)."""
  from levanter.layers.attention import Attention
  found = set()
  for leaf in jax.tree_util.tree_leaves(module, is_leaf=lambda m: isinstance(m, Attention)):
    if isinstance(leaf, Attention):
      window = getattr(leaf.config, "sliding_window", None)
      if window is not None:
        found.add(int(window))
  return found


def kvax_tokens(q_seg: jax.Array, kv_seg: jax.Array | None = None):
  """(q_pos, q_seg, kv_pos, kv_seg) int32 [B, S] for kvax from Levanter's segment ids [B, S].

  Positions are row indices. Ids >= 0 are kept; negative id -k becomes segment top + k (top: the
  row's largest id), so padding attends earlier padding as under Levanter's segment equality.
  """
  q_seg = q_seg.astype(jnp.int32)
  same = kv_seg is None or kv_seg is q_seg
  kv_seg = q_seg if same else kv_seg.astype(jnp.int32)
  top = jnp.max(q_seg, axis=1) if same else jnp.maximum(jnp.max(q_seg, axis=1),
                                                         jnp.max(kv_seg, axis=1))
  top = jnp.maximum(top, -1)[:, None]

  def own_segment(ids):
    return jnp.where(ids < 0, top - ids, ids)

  b, length = q_seg.shape
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
  q_ids = own_segment(q_seg)
  return pos, q_ids, pos, (q_ids if same else own_segment(kv_seg))


def _token_arrays(mask, batch, length):
  """(q_pos, q_seg, kv_pos, kv_seg) int32 [B, S] from the mask's segment ids (None: one doc)."""
  seg_ids = getattr(mask, "segment_ids", None)
  b = math.prod(a.size for a in batch)
  if seg_ids is None:
    seg = jnp.zeros((b, length), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    return pos, seg, pos, seg
  if not isinstance(seg_ids, tuple):
    seg_ids = (seg_ids, seg_ids)
  q_named, kv_named = seg_ids
  q_seg = axes.tokens(q_named, batch, Q_POS)
  if kv_named is q_named:
    kv_seg = q_seg
  else:
    kv_name = Q_POS if Q_POS in {a.name for a in kv_named.axes} else KV_POS
    kv_seg = axes.tokens(kv_named, batch, kv_name)
  for what, s in (("query", q_seg), ("key/value", kv_seg)):
    if s.shape[1] != length:
      raise axes.UnsupportedLayout(f"{what} segment ids have {s.shape[1]} tokens, the sequence "
                                   f"{length}")
  return kvax_tokens(q_seg, kv_seg)


def prepare(mask, keys, batch, q_pos_axis) -> Prepared:
  """Positions, segment ids and one kvax block mask per key, for tokens [*batch, q_pos_axis],
  built by the registry's kvax provider with the settings in force."""
  length = q_pos_axis.size
  qp, qs, kp, ks = _token_arrays(mask, batch, length)
  mesh = axes.current_mesh()
  tokens = None
  mesh_fields = {}
  if mesh is not None and math.prod(mesh.shape.values()) > 1:
    tokens = axes.token_specs(mesh, batch, q_pos_axis)
    query_specs, kv_specs = axes.specs(tokens, ())
    mesh_fields = dict(mesh=mesh, query_specs=query_specs, kv_specs=kv_specs,
                       token_order="natural")
  else:
    mesh = None
  provider = get_provider(PROVIDER)
  options = settings.current().provider_options(provider.options_type, **mesh_fields)
  keys = sorted(keys, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
  attention = provider.prepare(qp, qs, kp, ks, mask_keys=keys, options=options)
  return Prepared(batch=tuple(batch), length=length, attention=attention, mesh=mesh,
                  tokens=tokens)


# ----------------------------------------------------------------------------- decoder entry


def _entry_scope(transformer, x, attn_mask) -> _Scope:
  key, reason = mask_key(attn_mask)
  if reason is not None:
    return _Scope(transformer, None, reason)
  config = transformer.config
  embed = config.Embed.name
  names = {a.name for a in x.axes}
  if Q_POS not in names or embed not in names:
    return _Scope(transformer, None,
                  f"a decoder input without {Q_POS!r} / {embed!r} axes ({sorted(names)})")
  batch = tuple(a for a in x.axes if a.name not in (Q_POS, embed))
  keys = {key}
  for window in _layer_windows(transformer):
    layer_key, layer_reason = mask_key(attn_mask.with_sliding_window(window))
    if layer_reason is not None:
      return _Scope(transformer, None, layer_reason)
    keys.add(layer_key)
  try:
    prepared = prepare(attn_mask, keys, batch, x.resolve_axis(Q_POS))
  except axes.UnsupportedLayout as e:
    return _Scope(transformer, None, str(e))
  TRACE_COUNTS["entries"] += 1
  TRACE_COUNTS["entry_masks"] += len(prepared.attention.masks)
  return _Scope(transformer, prepared)


def decoder_entry(call):
  """Wrap a Transformer.__call__(self, x, attn_mask, *, key, pos_ids): build masks once."""
  if getattr(call, "__kvax_original__", None) is not None:
    return call
  signature = inspect.signature(call)

  @functools.wraps(call)
  def wrapper(self, *args, **kwargs):
    if not uses_kvax(getattr(self.config, "attn_backend", None)):
      return call(self, *args, **kwargs)
    active = _ACTIVE.get()
    if active is not None and active.owner is self:
      return call(self, *args, **kwargs)  # a subclass's __call__ reaching its parent's
    bound = signature.bind(self, *args, **kwargs)
    scope = _entry_scope(self, bound.arguments["x"], bound.arguments.get("attn_mask"))
    token = _ACTIVE.set(scope)
    try:
      return call(self, *args, **kwargs)
    finally:
      _ACTIVE.reset(token)

  wrapper.__kvax_original__ = call
  return wrapper


# ----------------------------------------------------------------------------- the layer call


def _call_unsupported(a: dict) -> str | None:
  if a["bias"] is not None:
    return "an additive attention bias"
  if a["dropout"] and not a["inference"]:
    return "attention dropout"
  return None


def _head_dims_unsupported(layout) -> str | None:
  for what, dim in (("query/key", layout.qk_dim.size), ("value", layout.v_dim.size)):
    if dim % 16 or not 16 <= dim <= 256:
      return f"{what} head dim {dim} (kvax: a multiple of 16 in [16, 256])"
  return None


def _scale(query, key_axis, scaling_factor):
  """(query, scale): a Python scale goes to the kernel; a traced one pre-scales the query."""
  if scaling_factor is None:
    return query, 1.0 / math.sqrt(query.resolve_axis(key_axis).size)
  if isinstance(scaling_factor, numbers.Real) or (
      isinstance(scaling_factor, np.ndarray) and scaling_factor.ndim == 0):
    return query, float(scaling_factor)
  return query * scaling_factor, 1.0


def _prepared_for(scope, layout, key) -> tuple[Prepared | None, str | None]:
  if scope is None or scope.prepared is None:
    return None, "attention outside a wrapped decoder entry (e.g. another model family)"
  p = scope.prepared
  if tuple(a.name for a in layout.batch) != tuple(a.name for a in p.batch) or \
      layout.batch_size != math.prod(a.size for a in p.batch):
    return None, "attention over other batch axes than the decoder input's"
  if layout.q_pos.size != p.length or layout.kv_pos.size != p.length:
    return None, "attention over another sequence length than the decoder input's"
  if key not in p.attention.masks:
    return None, f"a mask the decoder entry did not foresee (causal, window) = {key}"
  return p, None


def kvax_attention(a: dict):
  """The kvax call for dot_product_attention's bound arguments `a`, or None to route it."""
  reason = _call_unsupported(a)
  key, mask_reason = mask_key(a["mask"])
  reason = reason or mask_reason
  scope = _ACTIVE.get()
  if reason is None and scope is not None and scope.unsupported is not None:
    reason = scope.unsupported
  query, key_arr, value = a["query"], a["key"], a["value"]
  layout = None
  if reason is None:
    batch_names = None
    if scope is not None and scope.prepared is not None:
      batch_names = tuple(x.name for x in scope.prepared.batch)
    try:
      layout = axes.classify(query, key_arr, value, a["QPos"], a["KPos"], a["Key"], batch_names)
    except axes.UnsupportedLayout as e:
      if batch_names is None:
        reason = str(e)
      else:  # not the decoder's tokens: try on its own
        try:
          layout = axes.classify(query, key_arr, value, a["QPos"], a["KPos"], a["Key"])
        except axes.UnsupportedLayout as e2:
          reason = str(e2)
  if reason is None and layout.q_pos.size != layout.kv_pos.size:
    reason = "query and key/value of different lengths"
  if reason is None:
    reason = _head_dims_unsupported(layout)
  sinks = None
  if reason is None and a["attn_sink"] is not None:
    try:
      sinks = layout.sinks(a["attn_sink"]).astype(jnp.float32)
    except axes.UnsupportedLayout as e:
      reason = str(e)
  if reason is not None:
    TRACE_COUNTS["routed"] += 1
    note_once(f"attn_backend=kvax does not serve {reason}; those calls use Levanter's default "
              "attention path")
    return None

  prepared, why_not = _prepared_for(scope, layout, key)
  if prepared is None:
    note_once(f"attn_backend=kvax: {why_not}: building the block mask per call")
    try:
      prepared = prepare(a["mask"], {key}, layout.batch, layout.q_pos)
    except axes.UnsupportedLayout as e:
      TRACE_COUNTS["routed"] += 1
      note_once(f"attn_backend=kvax does not serve {e}; those calls use Levanter's default "
                "attention path")
      return None
    TRACE_COUNTS["per_call_masks"] += 1
  TRACE_COUNTS["layer_calls"] += 1

  query, scale = _scale(query, a["Key"], a["scaling_factor"])
  cap = a["logits_soft_cap"]
  cap = None if cap is None else float(cap)
  if sinks is not None and cap is not None:
    # Levanter caps the sink logit too; kvax adds sinks uncapped.
    sinks = cap * jnp.tanh(sinks / cap)
  attention = prepared.attention
  if prepared.mesh is not None:
    heads = axes.head_axes(prepared.mesh, layout, prepared.tokens)
    query_specs, kv_specs = axes.specs(prepared.tokens, heads)
    attention = dataclasses.replace(attention, options=dataclasses.replace(
        attention.options, query_specs=query_specs, kv_specs=kv_specs))
    TRACE_COUNTS["sharded_calls"] += 1
    SHARDED_SPECS.add(query_specs)
  causal, window = key
  out = get_provider(attention.provider).apply(
      layout.query(query), layout.key(key_arr), layout.value(value), attention,
      LayerSettings(causal=causal, sliding_window=window, logits_soft_cap=cap, scale=scale),
      sinks=sinks)
  return layout.output(out)


def routed_dot_product_attention(original):
  """levanter.layers.attention.dot_product_attention with attn_backend=kvax served by kvax."""
  if getattr(original, "__kvax_original__", None) is not None:
    return original
  signature = inspect.signature(original)

  @functools.wraps(original)
  def dot_product_attention(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if not uses_kvax(a["attn_backend"]) or a["use_flash"] is False:
      return original(*args, **kwargs)
    out = kvax_attention(a)
    if out is not None:
      return out
    from levanter.layers.attention import AttentionBackend
    a["attn_backend"] = AttentionBackend.DEFAULT
    return original(*bound.args, **bound.kwargs)

  dot_product_attention.__kvax_original__ = original
  return dot_product_attention
