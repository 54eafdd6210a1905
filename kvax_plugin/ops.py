"""kvax 0.1.0's `kvax.ops`: code written against kvax switches by changing its import line.

    from kvax.ops import create_attention_mask, flash_attention          # kvax 0.1.0
    from kvax_plugin.ops import create_attention_mask, flash_attention   # the same program

Names, parameter order, defaults and return structures are kvax's; our extensions are
keyword-only. Two kvax conventions differ from the native API and are honoured here: `mesh=None`
means the surrounding mesh when specs are known; and with permute_tokens_for_load_balance=True
kv_positions / kv_segment_ids stay in natural order while everything else arrives permuted (the
adapter reorders the two). kvax's per-view class is `BlockTable` here. Every remaining
difference: docs/migrating-from-kvax.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvax_plugin.attention import api, specs, validation
from kvax_plugin.attention.block_mask import (AttentionMask, BlockTable, calculate_mask_sparsity,
                                              print_mask)
from kvax_plugin.attention.params import FlashAttentionParamsConfig
from kvax_plugin.attention.sharded_mask import ShardedAttentionMask
from kvax_plugin.attention.token_order import to_load_balanced_order


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
                          kv_specs: Any = None) -> AttentionMask:
  """kvax's create_attention_mask. query_positions / query_segment_ids: int32 [B, Sq] in the
  order the query arrives; kv_positions / kv_segment_ids: int32 [B, Skv] in natural order.
  Returns an AttentionMask that unpacks like kvax's tuple `(fwd,)` or `(fwd, dq, dkv)`."""
  mesh = specs.mesh_for_mask(mesh, query_specs)
  # The tables do not depend on the query order; flash_attention states each call's kv order.
  return api.create_attention_mask(
      query_positions, query_segment_ids, kv_positions, kv_segment_ids, fwd_params, bwd_params,
      calc_bwd_mask, skip_pad_tokens, mesh, causal=causal, sliding_window=sliding_window,
      query_specs=query_specs, kv_specs=kv_specs, permute_tokens_for_load_balance=False)


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
                    permute_tokens_for_load_balance: bool = True,
                    debug: bool = False,
                    mesh: Any = None,
                    *,
                    logits_soft_cap: float | None = None,
                    sinks: jax.Array | None = None,
                    backend: str = "auto",
                    deterministic_backward: bool | None = None,
                    query_specs: Any = None,
                    kv_specs: Any = None) -> jax.Array:
  """kvax's flash_attention: query [B, Sq, H, D], key / value [B, Skv, K, D] -> [B, Sq, H, D];
  ids int32 [B, S], kv ids in natural order under permute_tokens_for_load_balance=True. bias must
  be None (NotImplementedError). Other arguments as kvax_plugin.attention.api.flash_attention."""
  validation.check_bias(bias)
  mesh = specs.mesh_for_mask(mesh, query_specs)
  cp = specs.context_size(mesh, query_specs) if mesh is not None else 1
  permuted = bool(permute_tokens_for_load_balance) and cp > 1
  if permuted:
    kv_positions, kv_segment_ids = to_load_balanced_order(
        (kv_positions, kv_segment_ids), cp)
  if mesh is not None and isinstance(mask, ShardedAttentionMask):
    if mask.layout.overlap_kv_gather and permuted != (mask.token_order == "llama3"):
      raise ValueError(
          "mask was built with overlap_kv_gather=True, whose tables index each "
          "shard's key / value in the order they arrive: build it from kv positions / segment "
          "ids in this call's order (the native kvax_plugin.create_attention_mask with "
          "token_order=), or build it with the overlap off")
    # One mask serves both kv orders (the op restores natural order after the all-gather).
    mask = dataclasses.replace(mask, layout=dataclasses.replace(
        mask.layout, token_order="llama3" if permuted else "natural"))
  return api.flash_attention(
      query, key, value, query_positions, query_segment_ids, kv_positions, kv_segment_ids, mask,
      scale, None, fwd_params, bwd_params, assume_sequential_positions,
      memory_optimized_gqa_backward, permuted, debug, mesh, logits_soft_cap=logits_soft_cap,
      sinks=sinks, backend=backend, deterministic_backward=deterministic_backward,
      query_specs=query_specs, kv_specs=kv_specs)


__all__ = ["flash_attention", "create_attention_mask", "print_mask", "calculate_mask_sparsity",
           "BlockTable"]
