"""Per-rank work of context parallelism under a token order: context_parallel_balance."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention import arguments
from kvax_plugin.attention import block_mask as bm
from kvax_plugin.attention import token_order as orders
from kvax_plugin.attention.params import DEFAULT_FWD_PARAMS


def context_parallel_balance(positions, segment_ids, cp: int, *, order: str | None = None,
                             permute: bool | None = None, causal: bool = True,
                             sliding_window: int | None = None, fwd_params=None,
                             block: int | None = None) -> dict[str, Any]:
  """Per-rank work of self-attention under context parallelism `cp`. positions, segment_ids:
  int [B, S], natural order. order: "natural", "llama3", "balanced" (unit `block`, default the
  forward query block) or a token_order.TokenOrder; permute=True / False is the older spelling
  of "llama3" / "natural"; neither: "balanced". Returns a dict: cp, order, permuted, and per
  rank (summed over the batch) kept_pairs, visited_blocks, full_blocks; kept_max_over_min and
  visited_max_over_min."""
  cp = arguments.as_int("cp", cp, minimum=1)
  positions = np.asarray(positions)
  segment_ids = np.asarray(segment_ids)
  if positions.ndim != 2 or positions.shape != segment_ids.shape:
    raise ValueError(f"positions {positions.shape} and segment_ids {segment_ids.shape} must both "
                     "be [batch, seq_len] arrays of one shape")
  b, s = positions.shape
  if s % cp:
    raise ValueError(f"the sequence length ({s}) must be divisible by cp ({cp})")
  fwd_params = fwd_params or DEFAULT_FWD_PARAMS
  if isinstance(order, orders.TokenOrder):
    if permute is not None:
      raise ValueError("pass either order= or permute=, not both")
    name, tok = "custom", order
  else:
    name = orders.resolve_token_order(order, permute, default="balanced")
    tok = orders.token_order(positions, segment_ids, cp, order=name,
                             block=block or fwd_params.query_block_size,
                             kv_block=fwd_params.kv_block_size, causal=causal,
                             sliding_window=sliding_window)
  perm = np.asarray(tok.order)
  if perm.shape != (b, s):
    raise ValueError(f"the order has shape {perm.shape}, the batch {(b, s)}")
  if name == "balanced":
    kv = np.asarray(orders.document_order(positions, segment_ids))
    kv_pos = np.take_along_axis(positions, kv, axis=1)
    kv_seg = np.take_along_axis(segment_ids, kv, axis=1)
  else:
    kv_pos, kv_seg = positions, segment_ids
  n = s // cp
  counts = np.asarray(orders.kept_pairs_per_token(positions, segment_ids, causal=causal,
                                                  sliding_window=sliding_window), np.int64)
  counts = np.take_along_axis(counts, perm, axis=1)
  kept = [int(counts[:, r * n:(r + 1) * n].sum()) for r in range(cp)]
  # All ranks stacked on the batch axis (row r * B + i): one table build.
  qpos = np.take_along_axis(positions, perm, axis=1).reshape(b, cp, n).transpose(1, 0, 2)
  qseg = np.take_along_axis(segment_ids, perm, axis=1).reshape(b, cp, n).transpose(1, 0, 2)
  tile = lambda x: np.broadcast_to(x, (cp, b, s)).reshape(cp * b, s)
  mask = bm.create_attention_mask(jnp.asarray(qpos.reshape(cp * b, n)),
                                  jnp.asarray(qseg.reshape(cp * b, n)),
                                  jnp.asarray(tile(kv_pos)), jnp.asarray(tile(kv_seg)),
                                  fwd_params=fwd_params, causal=causal,
                                  sliding_window=sliding_window)
  fwd = [np.asarray(x).reshape(cp, -1) for x in mask.fwd]
  visited = [int(v) for v in (fwd[1] - fwd[0]).sum(axis=1)]
  full = [int(v) for v in (fwd[3] - fwd[2]).sum(axis=1)]

  def ratio(xs):
    return float(max(xs) / min(xs)) if min(xs) > 0 else float("inf")

  return {"cp": cp, "order": name, "permuted": name == "llama3", "kept_pairs": kept,
          "visited_blocks": visited, "full_blocks": full, "kept_max_over_min": ratio(kept),
          "visited_max_over_min": ratio(visited)}


__all__ = ["context_parallel_balance"]
