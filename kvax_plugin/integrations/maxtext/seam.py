"""The seam between MaxText and the kvax provider: one mask per step, read by every layer.

`decoder_entry` wraps NNXDecoder.__call__ and builds the prepared state once per decoder trace
into a ContextVar that `apply_attention` reads inside scan / remat bodies (MaxText passes a
layer only what its signature declares). MaxText's padding segment 0 is an ordinary segment
here, never kvax's PADDING_SEGMENT_ID. install() and the patched MaxText both call these.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import logging
import types

import jax
import jax.numpy as jnp

from kvax_plugin import PADDING_SEGMENT_ID
from kvax_plugin.providers import LayerSettings, PreparedAttention, get_provider
from kvax_plugin.integrations.maxtext import settings

ATTENTION_NAME = "kvax"
MAXTEXT_PADDING_SEGMENT_ID = 0

logger = logging.getLogger("kvax_plugin.integrations.maxtext")


@dataclasses.dataclass(frozen=True)
class _Scope:

  prepared: PreparedAttention | None
  unsupported: str | None = None
  by_positions: bool = False


_ACTIVE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("kvax_maxtext_scope",
                                                                        default=None)
_NOTED: set[str] = set()


def _note_once(message: str) -> None:
  # Once per reason, not per layer / trace.
  if message not in _NOTED:
    _NOTED.add(message)
    logger.warning(message)
    try:
      from maxtext.utils import max_logging
      max_logging.log(message)
    except ImportError:
      pass


def uses_kvax(config) -> bool:
  return getattr(config, "attention", None) == ATTENTION_NAME


def to_kvax_segment_ids(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
  """MaxText segment ids (1..n, 0 = padding; None = one document) -> kvax segment ids: the same
  mask as MaxText's, so 0 stays an ordinary segment and only negative ids (never keys in
  MaxText) become PADDING_SEGMENT_ID."""
  if segment_ids is None:
    return jnp.zeros((batch, length), jnp.int32)
  seg = segment_ids.astype(jnp.int32)
  return jnp.where(seg < 0, PADDING_SEGMENT_ID, seg)


def masks_by_positions(config, mesh) -> bool:
  """Whether MaxText's own attention reads causality / windows from segment_positions here
  (load-balanced context parallelism matching the query sharding), decided by MaxText's own
  methods on a stand-in op so the two cannot drift apart."""
  from maxtext.layers.attention_op import AttentionOp
  probe = types.SimpleNamespace(config=config, mesh=mesh)
  probe._logical_to_mesh_axes = functools.partial(AttentionOp._logical_to_mesh_axes, probe)
  probe._context_parallel_size = functools.partial(AttentionOp._context_parallel_size, probe)
  return bool(AttentionOp._load_balanced_context_parallel(probe))


def to_kvax_positions(positions: jax.Array | None, batch: int, length: int,
                      by_positions: bool) -> jax.Array:
  """kvax positions giving MaxText's causality: its positions when by_positions, else row
  indices."""
  if not by_positions or positions is None:
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  if positions.ndim == 3:
    positions = positions[..., 0]
  return positions.astype(jnp.int32)


def mask_keys_for(config) -> tuple[tuple[bool, int | None], ...]:
  """The (causal, window) masks a model may need: global, plus the sliding window if any
  (an unread mask is removed by XLA)."""
  keys = [(True, None)]
  window = int(getattr(config, "sliding_window_size", 0) or 0)
  if window > 0:
    keys.append((True, window))
  return tuple(keys)


def _model_modes():
  from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_PREFILL
  return MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_PREFILL


def _decoder_unsupported(config, model_mode, previous_chunk) -> str | None:
  autoregressive, _ = _model_modes()
  if model_mode == autoregressive:
    return "autoregressive decode"
  if previous_chunk is not None:
    return "chunked prefill (previous_chunk)"
  if getattr(config, "using_pipeline_parallelism", False):
    return "pipeline parallelism"
  return None


def prepare_for_maxtext(config, mesh, positions, segment_ids, batch: int, length: int,
                        by_positions: bool | None = None) -> PreparedAttention:
  """The kvax state for one decoder call. by_positions None: masks_by_positions decides."""
  from kvax_plugin.integrations.maxtext import mesh_rules
  if by_positions is None:
    by_positions = masks_by_positions(config, mesh)
  seg = to_kvax_segment_ids(segment_ids, batch, length)
  pos = to_kvax_positions(positions, batch, length, by_positions)
  options = settings.options_from_config(config, **mesh_rules.mesh_and_specs(config, mesh))
  return get_provider("kvax").prepare(pos, seg, mask_keys=mask_keys_for(config), options=options)


def decoder_entry(call):
  """Wrap NNXDecoder.__call__: build the prepared state once, expose it to the layers."""
  if getattr(call, "__kvax_original__", None) is not None:
    return call
  signature = inspect.signature(call)

  @functools.wraps(call)
  def wrapper(self, *args, **kwargs):
    config = self.config
    if not uses_kvax(config):
      return call(self, *args, **kwargs)
    bound = signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    tokens = a["decoder_input_tokens"]
    reason = _decoder_unsupported(config, a["model_mode"], a["previous_chunk"])
    if reason is None:
      batch, length = tokens.shape
      mesh = getattr(self, "mesh", None)
      by_positions = masks_by_positions(config, mesh)
      prepared = prepare_for_maxtext(config, mesh, a["decoder_positions"],
                                     a["decoder_segment_ids"], batch, length, by_positions)
      scope = _Scope(prepared, by_positions=by_positions)
    else:
      scope = _Scope(None, reason)
    token = _ACTIVE.set(scope)
    try:
      return call(self, *args, **kwargs)
    finally:
      _ACTIVE.reset(token)

  wrapper.__kvax_original__ = call
  return wrapper


def _layer_unsupported(op, model_mode, key, previous_chunk, bidirectional_mask, indexer_mask,
                       compressed_mask, record_max_logits, decoder_segment_ids_kv, pad_kv_total,
                       compress_ratio) -> str | None:
  from maxtext.common.common_types import AttentionType
  from maxtext.inference.kvcache import KVTensor
  autoregressive, _ = _model_modes()
  if model_mode == autoregressive:
    return "autoregressive decode"
  if previous_chunk is not None:
    return "chunked prefill (previous_chunk)"
  kind = op.attention_type
  if kind == AttentionType.CHUNK:
    return "chunked attention (attention_type=chunk)"
  if kind in (AttentionType.FULL, AttentionType.COMPRESSED, AttentionType.BLOCK_DIFFUSION):
    return f"non-causal attention (attention_type={kind.value})"
  if bidirectional_mask is not None:
    return "bidirectional (multimodal) mask"
  if indexer_mask is not None or compressed_mask is not None or compress_ratio:
    return "indexer / compressed attention masks"
  if decoder_segment_ids_kv is not None or pad_kv_total:
    return "separate key/value segment ids"
  if record_max_logits:
    return "max-logit recording (QK-clip)"
  if isinstance(key, KVTensor):
    return "quantized KV cache"
  return None


def layer_settings(op) -> LayerSettings:
  """Per-layer settings from the AttentionOp (MaxText pre-scales the query: scale 1.0)."""
  from maxtext.common.common_types import AttentionType
  window = None
  if op.attention_type == AttentionType.LOCAL_SLIDING:
    window = op.sliding_window_size
    if not isinstance(window, int) or window < 1:
      raise ValueError(f"attention=kvax: a local_sliding layer needs sliding_window_size > 0, got "
                       f"{window!r}")
  cap = op.attn_logits_soft_cap
  cap = None if not cap else float(cap)
  return LayerSettings(causal=True, sliding_window=window, logits_soft_cap=cap, scale=1.0)


def _maxtext_dot_product(op, query, key, value, decoder_segment_ids, segment_positions, model_mode,
                         previous_chunk, bidirectional_mask, sinks, indexer_mask, compressed_mask,
                         record_max_logits, decoder_segment_ids_kv, qk_product_einsum,
                         wv_product_einsum):
  return op.apply_attention_dot(
      query, key, value, decoder_segment_ids, model_mode, previous_chunk,
      segment_positions=segment_positions, bidirectional_mask=bidirectional_mask, sinks=sinks,
      indexer_mask=indexer_mask, compressed_mask=compressed_mask,
      record_max_logits=record_max_logits, decoder_segment_ids_kv=decoder_segment_ids_kv,
      qk_product_einsum=qk_product_einsum, wv_product_einsum=wv_product_einsum)


def apply_attention(op, query, key, value, decoder_segment_ids, segment_positions, lengths,
                    model_mode, use_ragged_attention=False, previous_chunk=None,
                    bidirectional_mask=None, sinks=None, indexer_mask=None, compressed_mask=None,
                    record_max_logits=False, decoder_segment_ids_kv=None, pad_kv_total=0,
                    compress_ratio=0, *, qk_product_einsum, wv_product_einsum):
  """AttentionOp.apply_attention for attention="kvax"; returns (out, None, None), normalised."""
  del lengths, use_ragged_attention
  reason = _layer_unsupported(op, model_mode, key, previous_chunk, bidirectional_mask,
                              indexer_mask, compressed_mask, record_max_logits,
                              decoder_segment_ids_kv, pad_kv_total, compress_ratio)
  scope = _ACTIVE.get()
  if reason is None and scope is not None and scope.unsupported is not None:
    reason = scope.unsupported
  if reason is not None:
    _note_once(f"attention=kvax does not serve {reason} yet; those calls use MaxText's "
               "dot_product path")
    return _maxtext_dot_product(op, query, key, value, decoder_segment_ids, segment_positions,
                                model_mode, previous_chunk, bidirectional_mask, sinks,
                                indexer_mask, compressed_mask, record_max_logits,
                                decoder_segment_ids_kv, qk_product_einsum, wv_product_einsum)
  op.check_attention_inputs(query, key, value)
  batch, q_len = query.shape[0], query.shape[1]
  kv_len = key.shape[1]
  prepared = None if scope is None else scope.prepared
  if prepared is not None and op._load_balanced_context_parallel() != scope.by_positions:
    # The entry decided without the layer's op; a disagreeing layer would get other causality.
    raise ValueError(
        "attention=kvax: the decoder entry built its masks with causality by "
        f"{'positions' if scope.by_positions else 'row index'}, but this layer's MaxText "
        "attention measures it by "
        f"{'row index' if scope.by_positions else 'positions'} (load-balanced context "
        "parallelism differs between the decoder and this layer's mesh / axis rules)")
  if prepared is not None and (tuple(prepared.query_positions.shape) != (batch, q_len)
                               or tuple(prepared.kv_positions.shape) != (batch, kv_len)):
    raise ValueError(
        f"attention=kvax: the mask prepared at the decoder entry is for "
        f"{tuple(prepared.query_positions.shape)} tokens, but this layer attends "
        f"query {tuple(query.shape[:2])} to key/value {tuple(key.shape[:2])}")
  if prepared is None:
    # Attention outside the decoder entry (e.g. multi-token prediction): mask built per call.
    _note_once("attention=kvax called outside the decoder entry: building its mask per call")
    if q_len != kv_len:
      raise ValueError(f"attention=kvax outside the decoder needs q_len == kv_len, got {q_len} "
                       f"and {kv_len}")
    prepared = prepare_for_maxtext(op.config, op.mesh, segment_positions, decoder_segment_ids,
                                   batch, q_len, op._load_balanced_context_parallel())
  if sinks is not None:
    sinks = sinks.astype(jnp.float32)
  out = get_provider(prepared.provider).apply(query, key, value, prepared, layer_settings(op),
                                            sinks=sinks)
  return out, None, None
