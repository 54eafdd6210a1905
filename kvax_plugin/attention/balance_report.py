"""How evenly a token order spreads attention work over context-parallel ranks (a report).

For a batch in natural order and a token order (kvax_plugin.attention.token_order), rank r holds
query tokens [r*S/cp, (r+1)*S/cp) of the permuted row and attends all S kv tokens, which the
sharded op arranges before building its tables: in natural order for the natural and Llama 3
orders, in document order (token_order.document_order) for the balanced one. Per rank this
reports the two costs the order balances: exact kept (q, kv) pairs, and the forward blocks
(visited / full) of the block tables the sharded op builds for that rank, as it builds them
(block_mask.create_attention_mask on the rank's queries against the arranged kv). Host-side
numpy results; meant for benchmarks and tests.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention import block_mask as bm
from kvax_plugin.attention import token_order as to
from kvax_plugin.attention.params import DEFAULT_FWD_PARAMS


def _ratio(xs) -> float:
  return float(max(xs) / min(xs)) if min(xs) > 0 else float("inf")


def order_balance(positions, segment_ids, cp: int, *, order: str | to.TokenOrder = "balanced",
                  causal: bool = True, sliding_window: int | None = None,
                  fwd_params=None, block: int | None = None,
                  kv_arrangement: str | None = None) -> dict[str, Any]:
  """Per-rank work of self-attention under context parallelism `cp` in token order `order`.

  positions, segment_ids: int [B, S] in natural order. order: "natural", "llama3", "balanced"
  (computed here, with unit `block`, default the forward query block size) or a TokenOrder.
  kv_arrangement: "natural" or "documents", the kv order the tables are built on; default as
  the sharded op does it for `order` ("documents" for balanced, "natural" otherwise).
  Returns a dict: `order` (name or "custom"), `kept_pairs`, `visited_blocks`, `full_blocks`
  (lists over ranks, summed over the batch) and `kept_max_over_min`, `visited_max_over_min`.
  """
  positions = np.asarray(positions)
  segment_ids = np.asarray(segment_ids)
  if positions.ndim != 2 or positions.shape != segment_ids.shape:
    raise ValueError(f"positions {positions.shape} and segment_ids {segment_ids.shape} must be "
                     "[batch, seq_len] arrays of the same shape")
  b, s = positions.shape
  cp = to._check_cp(cp)
  if s % cp:
    raise ValueError(f"the sequence length ({s}) must be divisible by cp ({cp})")
  fwd_params = fwd_params or DEFAULT_FWD_PARAMS
  if isinstance(order, str):
    name = to._check_order_name(order)
    tok = to.token_order(positions, segment_ids, cp, order=order,
                         block=block or fwd_params.query_block_size,
                         kv_block=fwd_params.kv_block_size, causal=causal,
                         sliding_window=sliding_window)
  elif isinstance(order, to.TokenOrder):
    name, tok = "custom", order
  else:
    raise TypeError(f"order must be one of {to.ORDERS} or a TokenOrder, got {type(order).__name__}")
  perm = np.asarray(tok.order)
  if perm.shape != (b, s):
    raise ValueError(f"the order has shape {perm.shape}, the batch {(b, s)}")
  if kv_arrangement is None:
    kv_arrangement = "documents" if name == "balanced" else "natural"
  if kv_arrangement == "documents":
    kv = np.asarray(to.document_order(positions, segment_ids))
    kv_pos = np.take_along_axis(positions, kv, axis=1)
    kv_seg = np.take_along_axis(segment_ids, kv, axis=1)
  elif kv_arrangement == "natural":
    kv_pos, kv_seg = positions, segment_ids
  else:
    raise ValueError(f'kv_arrangement must be "natural", "documents" or None, got '
                     f"{kv_arrangement!r}")
  n = s // cp
  counts = np.asarray(to.kept_pairs_per_token(positions, segment_ids, causal=causal,
                                              sliding_window=sliding_window), np.int64)
  counts = np.take_along_axis(counts, perm, axis=1)
  kept = [int(counts[:, r * n:(r + 1) * n].sum()) for r in range(cp)]
  # Every rank's queries against the arranged kv, ranks stacked on the batch axis: one
  # table build for all ranks (row r * B + i = rank r, batch row i).
  qpos = np.take_along_axis(positions, perm, axis=1).reshape(b, cp, n).transpose(1, 0, 2)
  qseg = np.take_along_axis(segment_ids, perm, axis=1).reshape(b, cp, n).transpose(1, 0, 2)
  tile = lambda x: np.broadcast_to(x, (cp, b, s)).reshape(cp * b, s)
  m = bm.create_attention_mask(jnp.asarray(qpos.reshape(cp * b, n)),
                               jnp.asarray(qseg.reshape(cp * b, n)),
                               jnp.asarray(tile(kv_pos)), jnp.asarray(tile(kv_seg)),
                               fwd_params=fwd_params, causal=causal,
                               sliding_window=sliding_window)
  fwd = [np.asarray(x).reshape(cp, -1) for x in m.fwd]
  visited = [int(v) for v in (fwd[1] - fwd[0]).sum(axis=1)]
  full = [int(v) for v in (fwd[3] - fwd[2]).sum(axis=1)]
  return {"cp": cp, "order": name, "kv_arrangement": kv_arrangement, "kept_pairs": kept, "visited_blocks": visited,
          "full_blocks": full, "kept_max_over_min": _ratio(kept),
          "visited_max_over_min": _ratio(visited)}


__all__ = ["order_balance"]
