"""Public entry points: create_attention_mask, flash_attention (with a prebuilt mask) and
attention (one-off). A call is validated (validation.py), planned once (plan.py: backend, options,
token order, mesh and specs) and run (run.py, on a mesh sharded.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvax_plugin.attention import block_mask, sharded, specs, validation
from kvax_plugin.attention.block_mask import AttentionMask
from kvax_plugin.attention.kernels import BACKENDS, BackendUnavailableError, resolve_backend
from kvax_plugin.attention.kv_exchange import KV_GRAD_REDUCE_CHOICES
from kvax_plugin.attention.options import (HopperOptions, KernelOptions, MosaicOptions,
                                           TritonOptions)
from kvax_plugin.attention.params import PADDING_SEGMENT_ID, FlashAttentionParamsConfig
from kvax_plugin.attention.plan import make_plan
from kvax_plugin.attention.run import run
from kvax_plugin.attention.token_order import resolve_token_order


def create_attention_mask(query_positions: jax.Array,
                          query_segment_ids: jax.Array,
                          kv_positions: jax.Array,
                          kv_segment_ids: jax.Array,
                          fwd_params: FlashAttentionParamsConfig | None = None,
                          bwd_params: FlashAttentionParamsConfig | None = None,
                          calc_bwd_mask: bool = False,
                          skip_pad_tokens: bool = True,
                          mesh: Any = None,
                          *,
                          causal: bool = True,
                          sliding_window: int | None = None,
                          query_specs: Any = None,
                          kv_specs: Any = None,
                          permute_tokens_for_load_balance: bool | None = None,
                          token_order: str | None = None,
                          overlap_kv_gather: bool = False,
                          kv_grad_reduce_dtype: str = "auto") -> AttentionMask:
  """Build the block mask (an AttentionMask pytree of O(B * S / block) int32 tables) once per
  step; pass it to `flash_attention` in every layer. The parameters up to `mesh` are kvax
  0.1.0's, in its order; the rest are keyword-only.

  Args:
    query_positions, query_segment_ids: int32 [B, Sq]; kv_positions, kv_segment_ids: int32 [B, Skv].
    fwd_params / bwd_params: block sizes the tables are built for (None: defaults).
    calc_bwd_mask: also build the dq and dkv tables the backward pass needs.
    skip_pad_tokens: skip blocks made only of padding (False visits them, masked; slower).
    causal: keep only kv_pos <= q_pos.
    sliding_window: keep only q_pos - kv_pos < sliding_window (both directions without causal).
    mesh: build per-shard tables (a ShardedAttentionMask recording mesh and specs) for
      flash_attention on that mesh. None: the surrounding mesh when specs are known
      (query_specs= or attention_specs), else one device.
    query_specs, kv_specs: with a mesh, the BSHD specs (None: from `attention_specs`).
    token_order: with context parallelism, the order the tokens arrive in: "natural", "llama3"
      or "balanced"; must match the flash_attention call. None: from the flag below, else "llama3".
    permute_tokens_for_load_balance: older spelling of token_order (True "llama3", False
      "natural"); contradicting token_order raises ValueError.
    overlap_kv_gather: with context parallelism, split each shard's attention into its own kv and
      the other shards', so the kv exchange runs behind the first part (backends "hopper",
      "mosaic", "triton" or "jax").
    kv_grad_reduce_dtype: with context parallelism, the dtype the shards' dk / dv are summed in:
      "auto", "float32" or "input" (see kv_exchange.kv_grad_reduce_dtype).
  """
  options = dict(fwd_params=fwd_params, bwd_params=bwd_params, calc_bwd_mask=calc_bwd_mask,
                 skip_pad_tokens=skip_pad_tokens, causal=causal, sliding_window=sliding_window)
  mesh = specs.mesh_for_mask(mesh, query_specs)
  order = resolve_token_order(token_order, permute_tokens_for_load_balance)
  if mesh is None:
    return block_mask.create_attention_mask(query_positions, query_segment_ids, kv_positions,
                                            kv_segment_ids, **options)
  block_mask.check_mask_inputs(query_positions, query_segment_ids, kv_positions, kv_segment_ids,
                               sliding_window)
  options = block_mask.normalize_mask_options(**options)
  validation.check_choice("kv_grad_reduce_dtype", kv_grad_reduce_dtype, KV_GRAD_REDUCE_CHOICES)
  return sharded.create_attention_mask_sharded(
      query_positions, query_segment_ids, kv_positions, kv_segment_ids, mesh=mesh,
      query_specs=query_specs, kv_specs=kv_specs, token_order=order,
      overlap_kv_gather=overlap_kv_gather, kv_grad_reduce_dtype=kv_grad_reduce_dtype, **options)


def flash_attention(query: jax.Array,
                    key: jax.Array,
                    value: jax.Array,
                    query_positions: jax.Array,
                    query_segment_ids: jax.Array,
                    kv_positions: jax.Array,
                    kv_segment_ids: jax.Array,
                    mask: AttentionMask,
                    scale: float = 1.0,
                    bias: jax.Array | None = None,
                    fwd_params: FlashAttentionParamsConfig | None = None,
                    bwd_params: FlashAttentionParamsConfig | None = None,
                    assume_sequential_positions: bool = False,
                    memory_optimized_gqa_backward: bool = False,
                    permute_tokens_for_load_balance: bool | None = None,
                    debug: bool = False,
                    mesh: Any = None,
                    *,
                    logits_soft_cap: float | None = None,
                    sinks: jax.Array | None = None,
                    backend: str = "auto",
                    deterministic_backward: bool | None = None,
                    kernel_options: (KernelOptions | MosaicOptions | HopperOptions | TritonOptions
                                     | tuple | None) = None,
                    query_specs: Any = None,
                    kv_specs: Any = None,
                    token_order: str | None = None) -> jax.Array:
  """Attention over packed documents, visiting only the blocks the mask lists; returns
  [B, Sq, H, Dv] in query.dtype. The parameters up to `mesh` are kvax 0.1.0's, in its order and
  with its defaults; the rest are keyword-only.

  Args:
    query: [B, Sq, H, Dqk]; key: [B, Skv, K, Dqk]; value: [B, Skv, K, Dv]; H a multiple of K.
    query_positions, query_segment_ids: int32 [B, Sq]; kv_positions, kv_segment_ids: int32 [B, Skv].
      PADDING_SEGMENT_ID (-1) marks padding; its output rows and gradients are 0.
    mask: from `create_attention_mask` on the same ids (it carries causal and sliding_window);
      build it with calc_bwd_mask=True to take gradients.
    scale: multiplies q k^T (MaxText pre-scales the query and passes 1.0).
    bias: not supported; anything but None raises NotImplementedError.
    logits_soft_cap: cap * tanh(logits / cap) before masking (Gemma 2).
    sinks: [H] extra logit per query head in the softmax denominator (gpt-oss).
    fwd_params, bwd_params: must equal the mask's when given.
    assume_sequential_positions: accepted for kvax compatibility; ignored.
    memory_optimized_gqa_backward: Triton only (TritonOptions' field). True: accumulate a GQA
      group's dk/dv in place; False: in place when the launch still fills the GPU. Deterministic.
    permute_tokens_for_load_balance: True: inputs arrive in the Llama 3 order, False: natural;
      None defers to token_order. Contradicting token_order raises ValueError.
    token_order: with context parallelism, the order the inputs arrive in ("natural", "llama3",
      "balanced"); must match the mask's. Neither given: the sharded mask's order, else "llama3".
    backend: "auto" (the fastest that runs the call here; `python -m kvax_plugin.info` shows it)
      or a name of kernels.KERNEL_BACKENDS ("mosaic", "hopper", "triton", "jax", "reference"); an
      explicit name that cannot run raises BackendUnavailableError.
    deterministic_backward: None: each backend's own. Mosaic True: dq from its own kernel,
      bitwise reproducible (the default); False: dq reduce-added in float32 by the dk/dv kernel
      (order varies between runs). backend="hopper" has only the latter: True raises ValueError.
    kernel_options: the kernels' tuning (None: defaults): a per-backend config (MosaicOptions,
      HopperOptions, TritonOptions), a tuple of them, or the flat KernelOptions. The backend that
      runs receives only its own config.
    debug: print the backend and shapes at trace time, and check the mask against these ids.
    mesh: a jax.sharding.Mesh to run sharded; the mask must come from create_attention_mask with
      the same mesh and specs. None: the mask's mesh (and specs unless given), else the
      surrounding mesh when specs are known, else one device.
    query_specs, kv_specs: with a mesh, the BSHD specs (None: from `attention_specs`).
  """
  del assume_sequential_positions
  scale, logits_soft_cap, kernel_options = validation.check_call(
      query, key, value, query_positions, query_segment_ids, kv_positions, kv_segment_ids, mask,
      bias=bias, scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks, backend=backend,
      backends=BACKENDS, fwd_params=fwd_params, bwd_params=bwd_params,
      kernel_options=kernel_options, debug=debug)
  plan = make_plan(query, key, value, mask, scale=scale, logits_soft_cap=logits_soft_cap,
                   sinks=sinks, backend=backend, token_order=token_order,
                   permute_tokens_for_load_balance=permute_tokens_for_load_balance,
                   deterministic_backward=deterministic_backward, kernel_options=kernel_options,
                   memory_optimized_gqa_backward=memory_optimized_gqa_backward, mesh=mesh,
                   query_specs=query_specs, kv_specs=kv_specs, debug=debug)
  return run(plan, query, key, value, query_positions, query_segment_ids, kv_positions,
             kv_segment_ids, mask, sinks)


def positions_from_segment_ids(segment_ids: jax.Array) -> jax.Array:
  """Per-document positions (the number of earlier tokens of the same segment), also for
  non-contiguous documents. int32 [B, S] -> int32 [B, S]."""
  s = segment_ids.shape[1]
  order = jnp.argsort(segment_ids, axis=1, stable=True)
  sorted_ids = jnp.take_along_axis(segment_ids, order, axis=1)
  idx = jnp.arange(s, dtype=jnp.int32)[None, :]
  new_group = jnp.concatenate([jnp.ones_like(sorted_ids[:, :1], bool),
                               sorted_ids[:, 1:] != sorted_ids[:, :-1]], axis=1)
  group_start = jax.lax.cummax(jnp.where(new_group, idx, 0), axis=1)
  rank_sorted = (idx - group_start).astype(jnp.int32)
  inverse = jnp.argsort(order, axis=1)
  return jnp.take_along_axis(rank_sorted, inverse, axis=1)


def attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
              segment_ids: jax.Array | None = None,
              positions: jax.Array | None = None,
              causal: bool = True,
              sliding_window: int | None = None,
              logits_soft_cap: float | None = None,
              sinks: jax.Array | None = None,
              scale: float | None = None,
              backend: str = "auto",
              mesh: Any = None,
              query_specs: Any = None,
              kv_specs: Any = None,
              permute_tokens_for_load_balance: bool | None = None,
              token_order: str | None = None) -> jax.Array:
  """One-off attention: builds the block mask itself (use flash_attention to reuse one).

  query [B, Sq, H, D], key/value [B, Skv, K, D(v)] with Sq == Skv; segment_ids and positions
  int32 [B, Sq] shared by query and key/value. segment_ids None: one document; positions None:
  derived from segment_ids (explicit ones needed when tokens arrive permuted); scale None:
  1/sqrt(Dqk). The mesh arguments as in flash_attention, but the default order is "natural".
  """
  validation.check_qkv(query, key, value)
  b, sq, _, dqk = query.shape
  skv = key.shape[1]
  if segment_ids is None:
    segment_ids = jnp.zeros((b, sq), jnp.int32)
  order = resolve_token_order(token_order, permute_tokens_for_load_balance, default="natural")
  if positions is None:
    if mesh is not None and order != "natural":
      raise ValueError(f"positions must be given when the tokens arrive in token_order={order!r}"
                       ": positions derived from permuted segment_ids would follow buffer order")
    validation.check_tokens("segment_ids", segment_ids, "segment_ids", segment_ids, b, sq)
    positions = positions_from_segment_ids(segment_ids)
  if sq != skv:
    raise ValueError(f"attention() shares segment_ids/positions between query ({sq} tokens) and "
                     f"key/value ({skv} tokens); use create_attention_mask + flash_attention "
                     "for Sq != Skv")
  scale = dqk ** -0.5 if scale is None else scale
  validation.check_tokens("positions", positions, "segment_ids", segment_ids, b, sq)
  mask = create_attention_mask(positions, segment_ids, positions, segment_ids,
                               calc_bwd_mask=True, causal=causal, sliding_window=sliding_window,
                               mesh=mesh, query_specs=query_specs, kv_specs=kv_specs,
                               token_order=order)
  return flash_attention(query, key, value, positions, segment_ids, positions, segment_ids, mask,
                         scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                         backend=backend, mesh=mesh, query_specs=query_specs, kv_specs=kv_specs,
                         token_order=order)


__all__ = ["flash_attention", "attention", "create_attention_mask", "PADDING_SEGMENT_ID",
           "BackendUnavailableError", "resolve_backend", "positions_from_segment_ids"]
