"""kvax 0.1.0's `kvax.ops`: code written against kvax switches by changing its import line.

    from kvax.ops import create_attention_mask, flash_attention          # kvax 0.1.0
    from kvax_plugin.ops import create_attention_mask, flash_attention   # the same program

Names, parameter order, defaults and return structures are kvax's (its mask module's
`print_mask` and `calculate_mask_sparsity` live here too). Our extensions (causal,
sliding_window, logits_soft_cap, sinks, backend, deterministic_backward, query_specs, kv_specs)
are keyword-only after kvax's parameters. Two kvax conventions differ from the native API (kvax_plugin.attention.api)
and are honoured here:

* `mesh=None` means the mesh of the surrounding context (`with jax.set_mesh(mesh):`, or the
  older `with mesh:` kvax's README uses) when sharding specs are known (`attention_specs` or
  query_specs=); without a mesh anywhere, the op runs on one device.
* Context parallelism with permute_tokens_for_load_balance=True: query, key, value and the query
  positions / segment ids arrive in load-balanced order (permute_tokens_context_parallelism),
  while kv_positions / kv_segment_ids stay in natural order (kvax's README builds them before
  permuting). The native API takes every token array in the same (buffer) order instead; the
  adapter below reorders the two int arrays, which is cheap, and the rest is the native op.

kvax's per-view class (`kvax.ops.mask_creator.AttentionMask`, alias of kvax.utils.typing's: four
arrays lower_bounds / upper_bounds / lower_full_bounds / upper_full_bounds) is `BlockTable` here,
built with kvax's keywords or its own; `AttentionMask` names the whole mask create_attention_mask
returns. docs/migrating-from-kvax.md lists every remaining difference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvax_plugin.attention import api, context_parallel, validation
from kvax_plugin.attention.block_mask import (AttentionMask, BlockTable, calculate_mask_sparsity,
                                              print_mask)
from kvax_plugin.attention.params import FlashAttentionParamsConfig


def _mesh_for_call(mesh, query_specs) -> Any:
  """The explicit mesh; else, when specs are known, the surrounding one; else None."""
  if mesh is not None:
    return mesh
  if query_specs is None and context_parallel.current_attention_specs() is None:
    return None
  return context_parallel.ambient_mesh()


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
  """kvax's create_attention_mask: the block mask of one step, for every layer.

  query_positions / query_segment_ids: int32 [B, Sq], in the order the query arrives (permuted
  under context parallelism); kv_positions / kv_segment_ids: int32 [B, Skv] in natural order.
  Returns an AttentionMask that unpacks like kvax's tuple: `(fwd,)`, or `(fwd, dq, dkv)` with
  calc_bwd_mask=True, each view with lower_bounds / upper_bounds / lower_full_bounds /
  upper_full_bounds. Keyword-only extensions as in kvax_plugin.attention.api.
  """
  mesh = _mesh_for_call(mesh, query_specs)
  # kv in natural order is what the native op calls "not permuted": the tables are the same
  # whatever the query order, and flash_attention below states the kv order of each call.
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
  """kvax's flash_attention: query [B, Sq, H, D], key / value [B, Skv, K, D] -> [B, Sq, H, D].

  Positions / segment ids int32 [B, S]; `mask` from create_attention_mask (this module's or
  the native one). Under context parallelism with permute_tokens_for_load_balance=True the query
  side and key / value arrive permuted and kv_positions / kv_segment_ids in natural order, as
  in kvax. bias must be None (NotImplementedError otherwise, as kvax). Other arguments as
  kvax_plugin.attention.api.flash_attention.
  """
  validation.check_bias(bias)  # before anything else, as kvax
  mesh = _mesh_for_call(mesh, query_specs)
  cp = context_parallel.context_size(mesh, query_specs) if mesh is not None else 1
  permuted = bool(permute_tokens_for_load_balance) and cp > 1
  if permuted:
    # The native op wants kv positions / segment ids in the buffer order of key / value.
    kv_positions, kv_segment_ids = context_parallel.to_load_balanced_order(
        (kv_positions, kv_segment_ids), cp)
  if mesh is not None and isinstance(mask, context_parallel.ShardedAttentionMask):
    if mask.layout.overlap_kv_gather and permuted != (mask.token_order == "llama3"):
      raise ValueError(
          "mask was built with overlap_kv_gather=True, whose tables index each "
          "shard's key / value in the order they arrive: build it from kv positions / segment "
          "ids in this call's order (the native kvax_plugin.create_attention_mask with "
          "token_order=), or build it with the overlap off")
    # The tables index the gathered key / value in natural order either way (the op restores
    # it after the all-gather), so one mask serves both orders: state this call's.
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
