"""The `kvax` provider: our block-sparse FlashAttention behind the provider interface.

prepare() builds one AttentionMask per (causal, sliding_window) pair the model uses; apply()
picks the layer's mask and calls flash_attention. It uses only kvax_plugin's public API.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable

import jax
import jax.numpy as jnp

import kvax_plugin
from kvax_plugin.providers.base import AttentionProvider, LayerSettings, PreparedAttention

# Trace-time counters (once per trace, not per step), for tests and launchers.
TRACE_COUNTS: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class KvaxOptions:
  """Static settings of the kvax provider (hashable: they live in the pytree's aux data).

  backend: flash_attention's: "auto" (the fastest that runs here), "hopper", "mosaic",
    "triton", "jax" or "reference"; an explicit one that cannot run raises.
  fwd_params / bwd_params: block sizes the masks are built for (None: library defaults).
  memory_optimized_gqa_backward, deterministic_backward (None: each backend's own),
    kernel_options (KernelOptions, per-backend configs or a tuple; None: defaults):
    flash_attention's.
  skip_pad_tokens: skip blocks made only of padding.
  mesh: a jax.sharding.Mesh to run sharded, or None (single device, or let jit partition).
  token_order: with a context-parallel mesh, the order the tokens arrive in: "natural",
    "llama3" or "balanced" (the op never permutes them).
  query_specs / kv_specs: BSHD specs over `mesh` (mesh axis names per dimension); None lets
    the op use its attention_specs context or defaults.
  kv_grad_reduce_dtype / overlap_kv_gather: context parallelism's dk / dv sum dtype and kv
    exchange overlap (create_attention_mask's arguments of those names).
  """

  backend: str = "auto"
  fwd_params: kvax_plugin.FlashAttentionParamsConfig | None = None
  bwd_params: kvax_plugin.FlashAttentionParamsConfig | None = None
  memory_optimized_gqa_backward: bool = False
  deterministic_backward: bool | None = None
  kernel_options: Any = None
  skip_pad_tokens: bool = True
  mesh: Any = None
  token_order: str = "natural"
  query_specs: tuple | None = None
  kv_specs: tuple | None = None
  kv_grad_reduce_dtype: str = "auto"
  overlap_kv_gather: bool = False


def _check_tokens(name: str, x) -> jax.Array:
  if not hasattr(x, "shape") or len(x.shape) != 2:
    raise ValueError(f"{name} must be a [batch, seq_len] array, got {getattr(x, 'shape', x)!r}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
  return x.astype(jnp.int32)


def _mesh_kwargs(options: KvaxOptions) -> dict:
  if options.mesh is None:
    return {}
  return dict(mesh=options.mesh, query_specs=options.query_specs, kv_specs=options.kv_specs,
              token_order=options.token_order)


def _mask_mesh_kwargs(options: KvaxOptions) -> dict:
  if options.mesh is None:
    return {}
  return dict(kv_grad_reduce_dtype=options.kv_grad_reduce_dtype,
              overlap_kv_gather=options.overlap_kv_gather)


def prepare(query_positions: jax.Array,
            query_segment_ids: jax.Array,
            kv_positions: jax.Array | None = None,
            kv_segment_ids: jax.Array | None = None,
            *,
            mask_keys: Iterable[tuple[bool, int | None]] = ((True, None),),
            options: KvaxOptions | None = None,
            calc_bwd_mask: bool = True) -> PreparedAttention:
  """The per-step state: one block mask per distinct (causal, sliding_window). Segment ids:
  kvax's convention (PADDING_SEGMENT_ID marks padding); kv_* default to the query's."""
  options = options or KvaxOptions()
  if not isinstance(options, KvaxOptions):
    raise TypeError(f"options must be a KvaxOptions, got {type(options).__name__}")
  qp = _check_tokens("query_positions", query_positions)
  qs = _check_tokens("query_segment_ids", query_segment_ids)
  kp = qp if kv_positions is None else _check_tokens("kv_positions", kv_positions)
  ks = qs if kv_segment_ids is None else _check_tokens("kv_segment_ids", kv_segment_ids)
  keys = list(dict.fromkeys((bool(c), None if w is None else int(w)) for c, w in mask_keys))
  if not keys:
    raise ValueError("mask_keys must name at least one (causal, sliding_window) pair")
  TRACE_COUNTS["prepare"] += 1
  masks = {}
  for causal, window in keys:
    TRACE_COUNTS["mask_builds"] += 1
    masks[(causal, window)] = kvax_plugin.create_attention_mask(
        qp, qs, kp, ks, fwd_params=options.fwd_params, bwd_params=options.bwd_params,
        calc_bwd_mask=calc_bwd_mask, skip_pad_tokens=options.skip_pad_tokens, causal=causal,
        sliding_window=window, **_mesh_kwargs(options), **_mask_mesh_kwargs(options))
  return PreparedAttention(qp, qs, kp, ks, masks, "kvax", options)


def apply(query: jax.Array, key: jax.Array, value: jax.Array, prepared: PreparedAttention,
          settings: LayerSettings, *, sinks: jax.Array | None = None) -> jax.Array:
  """One layer's attention over the prepared mask: query [B, Sq, H, Dqk], key [B, Skv, K, Dqk],
  value [B, Skv, K, Dv] -> [B, Sq, H, Dv]."""
  if not isinstance(prepared, PreparedAttention) or prepared.provider != "kvax":
    of = f" of {prepared.provider}" if isinstance(prepared, PreparedAttention) else ""
    raise TypeError("prepared must come from the kvax provider's prepare(), got "
                    f"{type(prepared).__name__}{of}")
  if not isinstance(settings, LayerSettings):
    raise TypeError(f"settings must be a LayerSettings, got {type(settings).__name__}")
  options: KvaxOptions = prepared.options
  mask = prepared.mask_for(settings)
  TRACE_COUNTS["apply"] += 1
  return kvax_plugin.flash_attention(
      query, key, value, prepared.query_positions, prepared.query_segment_ids,
      prepared.kv_positions, prepared.kv_segment_ids, mask, scale=float(settings.scale),
      logits_soft_cap=settings.logits_soft_cap, sinks=sinks, fwd_params=options.fwd_params,
      bwd_params=options.bwd_params,
      memory_optimized_gqa_backward=options.memory_optimized_gqa_backward,
      deterministic_backward=options.deterministic_backward,
      kernel_options=options.kernel_options, backend=options.backend, **_mesh_kwargs(options))


KVAX_PROVIDER = AttentionProvider(
    name="kvax", prepare=prepare, apply=apply, options_type=KvaxOptions,
    description="block-sparse FlashAttention over packed documents (Triton on GPU, JAX elsewhere)")
