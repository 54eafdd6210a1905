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
import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvax_plugin.attention import api, specs, validation
from kvax_plugin.attention.block_mask import (AttentionMask, BlockTable, calculate_mask_sparsity,
                                              print_mask)
from kvax_plugin.attention.params import PADDING_SEGMENT_ID, FlashAttentionParamsConfig
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
  Returns an AttentionMask that unpacks like kvax's tuple `(fwd,)` or `(fwd, dq, dkv)`, into
  tables in kvax's layout (see _kvax_views)."""
  mesh = specs.mesh_for_mask(mesh, query_specs)
  # The tables do not depend on the query order; flash_attention states each call's kv order.
  build = functools.partial(
      api.create_attention_mask, mesh=mesh, causal=causal, sliding_window=sliding_window,
      query_specs=query_specs, kv_specs=kv_specs, permute_tokens_for_load_balance=False)
  ids = (query_positions, query_segment_ids, kv_positions, kv_segment_ids)
  mask = build(*ids, fwd_params, bwd_params, calc_bwd_mask, skip_pad_tokens)
  return dataclasses.replace(mask, kvax_views=_kvax_views(mask, build, ids, skip_pad_tokens))


def _kvax_views(mask: AttentionMask, build, ids, skip_pad_tokens: bool) -> tuple[BlockTable, ...]:
  """The mask's tables in kvax 0.1.0's layout, which unpacking the mask gives; the kernels read
  its own. Never computed under jit unless read. The differences: docs/migrating-from-kvax.md."""
  if not skip_pad_tokens:  # kvax's tables then let padding attend padding, as a document
    q_pos, q_seg, kv_pos, kv_seg = ids
    fresh = jnp.maximum(jnp.max(q_seg, initial=PADDING_SEGMENT_ID),
                        jnp.max(kv_seg, initial=PADDING_SEGMENT_ID)) + 1
    q_seg, kv_seg = (jnp.where(s == PADDING_SEGMENT_ID, fresh, s) for s in (q_seg, kv_seg))
    ids = (q_pos, q_seg, kv_pos, kv_seg)
  fwd_params, bwd_params = mask.spec.fwd_params, mask.spec.bwd_params
  base = mask if skip_pad_tokens else build(*ids, fwd_params, bwd_params, mask.has_backward, True)
  cp = mask.layout.context_size if isinstance(mask, ShardedAttentionMask) else 1
  fwd = BlockTable(*(x.reshape(x.shape[0], 1, x.shape[1]) for x in base.fwd))
  if not mask.has_backward:
    return (fwd,)
  if bwd_params.query_block_size == bwd_params.kv_block_size:
    dq = base.dq
  else:  # kvax's dq table has query blocks of kv_block_size and kv blocks of query_block_size
    swapped = dataclasses.replace(bwd_params, query_block_size=bwd_params.kv_block_size,
                                  kv_block_size=bwd_params.query_block_size)
    dq = build(*ids, fwd_params, swapped, True, True).dq
  dq = BlockTable(*(x.reshape(x.shape[0], 1, x.shape[1]) for x in dq))
  lower, upper, full_lower, full_upper = base.dkv
  no_full = full_lower == full_upper  # kvax keeps a dkv row's empty full range at `upper`
  dkv = BlockTable(lower, upper, jnp.where(no_full, upper, full_lower),
                   jnp.where(no_full, upper, full_upper))
  dkv = BlockTable(*(x.reshape(x.shape[0], cp, x.shape[1] // cp) for x in dkv))
  return fwd, dq, dkv


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
