"""Token orders for context parallelism: natural, Llama 3, and a per-batch balanced order
(docs/context-parallelism.md). Rank r holds query tokens [r S / cp, (r + 1) S / cp) of the row
as it arrives; attention is exact in any order, the order only moves work between ranks.

Cost model: a rank pays kept (q, kv) pairs and visited kv blocks, both additive over units of
`block` natural-order tokens. The balanced order moves whole units and keeps each rank's units
ascending; the op sorts the gathered kv into document_order, so a unit's table row does not
depend on its rank. Assignment: deal units heaviest first in rounds of cp, each to the
least-loaded rank, then 4 cp swap steps between the heaviest and lightest ranks; the best of
that, natural and Llama 3 (worst-rank ratio) is returned, so it is never worse than either.

An order is int32 [B, S] with permuted[b, i] = natural[b, order[b, i]]; its inverse satisfies
natural[b, j] = permuted[b, inverse[b, j]]. A leaf: imports only numpy, jax and params.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention.params import PADDING_SEGMENT_ID

ORDERS = ("natural", "llama3", "balanced")

_INT32_MAX = np.iinfo(np.int32).max
_INT32_MIN = np.iinfo(np.int32).min
_SWAP_STEPS_PER_RANK = 4


class TokenOrder(NamedTuple):
  """A per-row permutation and its inverse, both int32 [B, S] (conventions above)."""

  order: jax.Array
  inverse: jax.Array


def _check_order_name(order: str) -> str:
  if order not in ORDERS:
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
  return order


def _check_cp(cp) -> int:
  if not isinstance(cp, (int, np.integer)) or isinstance(cp, bool) or cp < 1:
    raise ValueError(f"cp must be a positive int, got {cp!r}")
  return int(cp)


def _check_block(name: str, value) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


def _check_window(sliding_window) -> int | None:
  if sliding_window is None:
    return None
  if (not isinstance(sliding_window, (int, np.integer)) or isinstance(sliding_window, bool)
      or sliding_window < 1):
    raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
  return int(sliding_window)


def _check_rows(positions, segment_ids):
  for name, x in (("positions", positions), ("segment_ids", segment_ids)):
    if not hasattr(x, "shape") or len(x.shape) != 2:
      raise ValueError(f"{name} must be a [batch, seq_len] array, got shape "
                       f"{getattr(x, 'shape', type(x).__name__)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must hold integers (int32), got dtype {x.dtype}")
  if tuple(positions.shape) != tuple(segment_ids.shape):
    raise ValueError(f"positions {tuple(positions.shape)} and segment_ids "
                     f"{tuple(segment_ids.shape)} must have the same shape")


def _check_units(seq_len: int, cp: int, block: int) -> None:
  if seq_len % (cp * block):
    raise ValueError(
        f"the sequence length ({seq_len}) must be a multiple of cp * block = {cp} * {block} = "
        f"{cp * block}: every rank holds the same number of whole blocks of `block` tokens")


def natural_order(batch: int, seq_len: int) -> TokenOrder:
  idx = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
  return TokenOrder(idx, idx)


def llama3_chunk_order(cp: int) -> list[int]:
  """Chunk order of the Llama 3 layout: rank r holds chunks r and 2*cp-1-r of 2*cp chunks."""
  return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def llama3_order(batch: int, seq_len: int, cp: int) -> TokenOrder:
  """The Llama 3 order as a TokenOrder, int32 [batch, seq_len] (seq_len a multiple of 2*cp)."""
  cp = _check_cp(cp)
  if seq_len % (2 * cp):
    raise ValueError(f"the sequence length ({seq_len}) must be a multiple of 2 * cp = {2 * cp} "
                     "for the llama3 order (2*cp chunks)")
  chunk = seq_len // (2 * cp)
  order = np.concatenate([np.arange(c * chunk, (c + 1) * chunk)
                          for c in llama3_chunk_order(cp)]).astype(np.int32)
  inverse = np.argsort(order).astype(np.int32)
  bc = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch, seq_len))
  return TokenOrder(bc(order), bc(inverse))


def _sat_add(x: jax.Array, d: int) -> jax.Array:
  """x + d for int32 x, clamped to the int32 range instead of wrapping (|d| < 2**31)."""
  if d >= 0:
    return jnp.where(x > _INT32_MAX - d, _INT32_MAX, x + d)
  return jnp.where(x < _INT32_MIN - d, _INT32_MIN, x + d)


def _search(sorted_seg, sorted_pos, q_seg, q_pos, *, inclusive: bool, start, stop) -> jax.Array:
  """Per query key, the number of sorted (seg, pos) keys below it (at or below when
  `inclusive`), by a vectorised binary search within [start, stop). sorted_* [S], q_* [M]."""
  n = sorted_seg.shape[0]
  steps = max(1, math.ceil(math.log2(n + 1)))
  lo = start.astype(jnp.int32)
  hi = stop.astype(jnp.int32)

  def step(_, carry):
    lo, hi = carry
    active = lo < hi
    mid = (lo + hi) // 2
    ms = sorted_seg[jnp.minimum(mid, n - 1)]
    mp = sorted_pos[jnp.minimum(mid, n - 1)]
    below = (ms < q_seg) | ((ms == q_seg) & ((mp <= q_pos) if inclusive else (mp < q_pos)))
    lo = jnp.where(active & below, mid + 1, lo)
    hi = jnp.where(active & ~below, mid, hi)
    return lo, hi

  lo, _ = jax.lax.fori_loop(0, steps, step, (lo, hi))
  return lo


def _document_order_row(seg: jax.Array, pos: jax.Array) -> jax.Array:
  """One row: the stable permutation sorting by (padding last, segment id, position), as three
  stable single-key sorts (XLA's multi-operand sort is several times slower on CPU)."""
  order = jnp.argsort(pos, stable=True)
  order = order[jnp.argsort(seg[order], stable=True)]
  order = order[jnp.argsort(seg[order] == PADDING_SEGMENT_ID, stable=True)]
  return order.astype(jnp.int32)


def document_order(positions, segment_ids) -> jax.Array:
  """The kv arrangement the sharded op uses with the balanced order, int32 [B, S]: each row
  stably sorted by (padding last, segment id, position), so documents are contiguous; the
  natural order for the usual packing. sorted[b, i] = x[b, result[b, i]]."""
  _check_rows(positions, segment_ids)
  return jax.vmap(_document_order_row)(jnp.asarray(segment_ids).astype(jnp.int32),
                                       jnp.asarray(positions).astype(jnp.int32))


def _attended_ranges(positions, segment_ids, causal: bool, window: int | None):
  """One row [S]: per query token, (count, lo, hi): the exact number of attended kv tokens, which
  are the range [lo, hi) of the row in document order. Padding queries get count 0."""
  pos = positions.astype(jnp.int32)
  seg = segment_ids.astype(jnp.int32)
  s = pos.shape[0]
  idx = jnp.arange(s, dtype=jnp.int32)
  perm = _document_order_row(seg, pos)
  sseg, spos = seg[perm], pos[perm]
  new_seg = jnp.concatenate([jnp.ones((1,), bool), sseg[1:] != sseg[:-1]])
  new_key = new_seg | jnp.concatenate([jnp.ones((1,), bool), spos[1:] != spos[:-1]])
  seg_start = jax.lax.cummax(jnp.where(new_seg, idx, 0))
  last_of_seg = jnp.concatenate([new_seg[1:], jnp.ones((1,), bool)])
  last_of_key = jnp.concatenate([new_key[1:], jnp.ones((1,), bool)])
  seg_end = jax.lax.cummin(jnp.where(last_of_seg, idx + 1, s), reverse=True)
  key_end = jax.lax.cummin(jnp.where(last_of_key, idx + 1, s), reverse=True)
  # Lexicographic searches are valid: padding, the only id sorted out of place, never searches.
  if window is None:
    lo_sorted = seg_start
  else:
    lo_sorted = _search(sseg, spos, sseg, _sat_add(spos, -(window - 1)), inclusive=False,
                        start=seg_start, stop=seg_end)
  if causal:
    hi_sorted = key_end
  elif window is None:
    hi_sorted = seg_end
  else:
    hi_sorted = _search(sseg, spos, sseg, _sat_add(spos, window - 1), inclusive=True,
                        start=seg_start, stop=seg_end)
  lo = jnp.zeros((s,), jnp.int32).at[perm].set(lo_sorted)
  hi = jnp.zeros((s,), jnp.int32).at[perm].set(hi_sorted)
  count = jnp.where(seg == PADDING_SEGMENT_ID, 0, jnp.maximum(hi - lo, 0))
  return count, lo, hi


def kept_pairs_per_token(positions, segment_ids, *, causal: bool = True,
                         sliding_window: int | None = None) -> jax.Array:
  """Exact number of kv tokens each query token attends (self-attention), int32 [B, S]."""
  _check_rows(positions, segment_ids)
  window = _check_window(sliding_window)
  fn = jax.vmap(lambda p, s: _attended_ranges(p, s, bool(causal), window)[0])
  return fn(jnp.asarray(positions), jnp.asarray(segment_ids))


def _row_unit_costs(positions, segment_ids, block: int, kv_block: int, causal: bool,
                    window: int | None):
  """One row: (kept pairs, visited kv blocks) per unit, float32 [S / block]."""
  count, lo, hi = _attended_ranges(positions, segment_ids, causal, window)
  n = positions.shape[0] // block
  kept = count.astype(jnp.float32).reshape(n, block).sum(axis=1)
  some = count.reshape(n, block) > 0
  first = jnp.min(jnp.where(some, lo.reshape(n, block), _INT32_MAX), axis=1) // kv_block
  last = jnp.max(jnp.where(some, hi.reshape(n, block) - 1, -1), axis=1) // kv_block
  visited = jnp.where(jnp.any(some, axis=1), last - first + 1, 0).astype(jnp.float32)
  return kept, visited


def unit_costs(positions, segment_ids, *, block: int = 128, kv_block: int | None = None,
               causal: bool = True, sliding_window: int | None = None
               ) -> tuple[jax.Array, jax.Array]:
  """The cost model: (kept pairs, visited kv blocks) per unit, two float32 [B, S / block].

  positions, segment_ids: int [B, S] in natural order, S a multiple of `block`; kv blocks have
  `kv_block` tokens (default `block`) with key/value in document_order.
  """
  _check_rows(positions, segment_ids)
  block = _check_block("block", block)
  kv_block = block if kv_block is None else _check_block("kv_block", kv_block)
  window = _check_window(sliding_window)
  s = positions.shape[1]
  if s % block:
    raise ValueError(f"the sequence length ({s}) must be a multiple of block ({block})")
  fn = jax.vmap(lambda p, g: _row_unit_costs(p, g, block, kv_block, bool(causal), window))
  return fn(jnp.asarray(positions), jnp.asarray(segment_ids))


def _lpt_ranks(cost: jax.Array, cp: int) -> jax.Array:
  """Rank of every unit, int32 [n]: heaviest first, dealt in rounds of cp to the lightest ranks."""
  n = cost.shape[0]
  heavy_first = jnp.argsort(-cost, stable=True).astype(jnp.int32)
  rounds = heavy_first.reshape(n // cp, cp)

  def deal(loads, units):
    ranks = jnp.argsort(loads, stable=True).astype(jnp.int32)
    return loads.at[ranks].add(cost[units]), ranks

  _, ranks = jax.lax.scan(deal, jnp.zeros((cp,), jnp.float32), rounds)
  return jnp.zeros((n,), jnp.int32).at[rounds.reshape(-1)].set(ranks.reshape(-1))


def _objective(loads):
  """[2, C, cp] loads (mean 1) -> [C]: worst spread plus a variance term, so swaps progress
  where the worst rank is tied."""
  spread = jnp.max(jnp.max(loads, axis=2) - jnp.min(loads, axis=2), axis=0)
  return spread + 0.25 * jnp.sum(jnp.square(loads - 1.0), axis=(0, 2))


def _refine_by_swaps(ranks: jax.Array, kept: jax.Array, visited: jax.Array, cp: int,
                     steps: int) -> jax.Array:
  """Improve an assignment by up to `steps` unit swaps, balancing both costs at once.

  Each step takes the cost with the worse spread, its heaviest rank X and lightest Y, and swaps
  units that move load out of X or into Y; a swap moves c_a - c_b, best near half the load gap,
  so per (unit, other rank) the nearest-cost units (a searchsorted) are candidates, each scored
  by the exact new objective. Counts stay equal. O(n log n + n * cp) per step.
  """
  n = kept.shape[0]
  per = n // cp
  mean_k = jnp.maximum(jnp.sum(kept) / cp, 1e-30)
  mean_v = jnp.maximum(jnp.sum(visited) / cp, 1e-30)
  costs = jnp.stack([kept / mean_k, visited / mean_v])
  rank_ids = jnp.arange(cp, dtype=jnp.int32)

  def step(_, ranks):
    loads = jnp.zeros((2, cp), jnp.float32).at[:, ranks].add(costs)
    spreads = jnp.max(loads, axis=1) - jnp.min(loads, axis=1)
    objective = _objective(loads[:, None, :])[0]
    m = jnp.argmax(spreads)
    primary, lm = costs[m], loads[m]
    x, y = jnp.argmax(lm), jnp.argmin(lm)
    by_cost = jnp.argsort(primary, stable=True)
    grouped = by_cost[jnp.argsort(ranks[by_cost], stable=True)].astype(jnp.int32).reshape(cp, per)
    sorted_p = primary[grouped]
    search = jax.vmap(jnp.searchsorted, in_axes=(0, 1), out_axes=1)

    def around(targets):
      j = search(sorted_p, targets).astype(jnp.int32)
      idx = jnp.clip(j[..., None] + jnp.arange(-2, 2), 0, per - 1)
      return grouped[rank_ids[None, :, None], idx]

    a_out = jnp.broadcast_to(grouped[x][:, None, None], (per, cp, 4))
    b_out = around(primary[grouped[x]][:, None] - (lm[x] - lm)[None, :] / 2)
    b_in = jnp.broadcast_to(grouped[y][:, None, None], (per, cp, 4))
    a_in = around(primary[grouped[y]][:, None] + (lm - lm[y])[None, :] / 2)
    a = jnp.concatenate([a_out.reshape(-1), a_in.reshape(-1)])
    b = jnp.concatenate([b_out.reshape(-1), b_in.reshape(-1)])
    ra, rb = ranks[a], ranks[b]
    d = costs[:, a] - costs[:, b]
    new = (loads[:, None, :] - d[..., None] * (rank_ids == ra[:, None])
           + d[..., None] * (rank_ids == rb[:, None]))
    obj = _objective(new)
    obj = jnp.where(ra != rb, obj, jnp.inf)
    best = jnp.argmin(obj)
    swap = obj[best] < objective - 1e-6
    ab, bb = a[best], b[best]
    new_ranks = ranks.at[ab].set(ranks[bb]).at[bb].set(ranks[ab])
    return jnp.where(swap, new_ranks, ranks)

  return jax.lax.fori_loop(0, steps, step, ranks)


def _fixed_ranks(n: int, cp: int, kind: str) -> np.ndarray:
  unit = np.arange(n)
  if kind == "natural":
    return (unit // (n // cp)).astype(np.int32)
  chunk = unit // (n // (2 * cp))
  return np.where(chunk < cp, chunk, 2 * cp - 1 - chunk).astype(np.int32)


def _worst_rank(ranks: jax.Array, kept: jax.Array, visited: jax.Array, cp: int) -> jax.Array:
  """max over both costs of max / min rank load: 1.0 perfect, inf when a rank is idle."""
  def ratio(c):
    loads = jnp.zeros((cp,), jnp.float32).at[ranks].add(c)
    hi, lo = jnp.max(loads), jnp.min(loads)
    return jnp.where(hi <= 0, 1.0, jnp.where(lo > 0, hi / jnp.maximum(lo, 1e-30), jnp.inf))
  return jnp.maximum(ratio(kept), ratio(visited))


def _row_balanced_units(kept, visited, cp: int, try_llama3: bool):
  n = kept.shape[0]
  total_k, total_v = jnp.sum(kept), jnp.sum(visited)
  cost = (kept / jnp.maximum(total_k, 1e-30)) + (visited / jnp.maximum(total_v, 1e-30))
  dealt = _refine_by_swaps(_lpt_ranks(cost, cp), kept, visited, cp, _SWAP_STEPS_PER_RANK * cp)
  candidates = [dealt, jnp.asarray(_fixed_ranks(n, cp, "natural"))]
  if try_llama3:
    candidates.append(jnp.asarray(_fixed_ranks(n, cp, "llama3")))
  candidates = jnp.stack(candidates)
  worst = jax.vmap(lambda r: _worst_rank(r, kept, visited, cp))(candidates)
  return candidates[jnp.argmin(worst)]


def _order_from_unit_ranks(ranks: jax.Array, block: int) -> TokenOrder:
  b, n = ranks.shape
  unit_order = jnp.argsort(ranks, axis=1, stable=True).astype(jnp.int32)
  return _expand_unit_order(unit_order, block)


def _expand_unit_order(unit_order: jax.Array, block: int) -> TokenOrder:
  b, n = unit_order.shape
  within = jnp.arange(block, dtype=jnp.int32)
  order = (unit_order[:, :, None] * block + within).reshape(b, n * block)
  rows = jnp.arange(b)[:, None]
  inverse = jnp.zeros_like(order).at[rows, order].set(
      jnp.broadcast_to(jnp.arange(n * block, dtype=jnp.int32), (b, n * block)))
  return TokenOrder(order, inverse)


def balanced_order(positions, segment_ids, cp: int, *, block: int = 128,
                   kv_block: int | None = None, causal: bool = True,
                   sliding_window: int | None = None) -> TokenOrder:
  """The balanced order (module docstring) per batch row, a TokenOrder [B, S]; jit-able.

  positions, segment_ids: int [B, S] in natural order (padding = PADDING_SEGMENT_ID), S a
  multiple of cp * block. block: the unit moved whole, a multiple of every query block size in
  use; kv_block: the forward kv block size (default block). causal / sliding_window: the mask.
  """
  _check_rows(positions, segment_ids)
  cp = _check_cp(cp)
  block = _check_block("block", block)
  kv_block = block if kv_block is None else _check_block("kv_block", kv_block)
  window = _check_window(sliding_window)
  b, s = positions.shape
  _check_units(s, cp, block)
  return _balanced_order(jnp.asarray(positions), jnp.asarray(segment_ids), cp=cp, block=block,
                         kv_block=kv_block, causal=bool(causal), window=window)


@functools.partial(jax.jit, static_argnames=("cp", "block", "kv_block", "causal", "window"))
def _balanced_order(positions, segment_ids, *, cp, block, kv_block, causal, window):
  kept, visited = jax.vmap(
      lambda p, g: _row_unit_costs(p, g, block, kv_block, causal, window))(positions, segment_ids)
  n = kept.shape[1]
  try_llama3 = n % (2 * cp) == 0
  ranks = jax.vmap(lambda k, v: _row_balanced_units(k, v, cp, try_llama3))(kept, visited)
  return _order_from_unit_ranks(ranks, block)


def token_order(positions, segment_ids, cp: int, *, order: str = "balanced", block: int = 128,
                kv_block: int | None = None, causal: bool = True,
                sliding_window: int | None = None) -> TokenOrder:
  """The token order `order` ("natural", "llama3", "balanced") for positions, segment_ids int
  [B, S] in natural order (the fixed orders read only their shape)."""
  _check_order_name(order)
  _check_rows(positions, segment_ids)
  cp = _check_cp(cp)
  b, s = positions.shape
  if order == "natural":
    return natural_order(b, s)
  if order == "llama3":
    return llama3_order(b, s, cp)
  return balanced_order(positions, segment_ids, cp, block=block, kv_block=kv_block, causal=causal,
                        sliding_window=sliding_window)


def _take(x, index: jax.Array, axis: int, name: str):
  if x is None:
    return None
  ndim = len(x.shape)
  ax = axis + ndim if axis < 0 else axis
  if not 1 <= ax < ndim:
    raise ValueError(f"axis {axis} must name a sequence axis after the batch axis of {name} "
                     f"(shape {tuple(x.shape)})")
  b, s = index.shape
  if x.shape[0] != b or x.shape[ax] != s:
    raise ValueError(f"{name} of shape {tuple(x.shape)} does not match the order [{b}, {s}] "
                     f"(batch on axis 0, sequence on axis {axis})")
  if isinstance(x, np.ndarray) and isinstance(index, np.ndarray):
    idx = index.reshape((b,) + (1,) * (ax - 1) + (s,) + (1,) * (ndim - ax - 1))
    return np.take_along_axis(x, idx, axis=ax)
  # Under an explicit mesh (jax.set_mesh) a gather of a sharded array needs its output sharding
  # named: the same as the input's, the sequence staying where the caller sharded it.
  moved = jnp.moveaxis(x, ax, 1)
  rows = jnp.arange(b, dtype=jnp.int32)[:, None]
  sharding = getattr(jax.typeof(moved), "sharding", None)
  spec = getattr(sharding, "spec", None)
  explicit = spec is not None and not getattr(sharding.mesh, "empty", True) and any(
      t == jax.sharding.AxisType.Explicit for t in getattr(sharding.mesh, "axis_types", ()))
  if explicit:
    out = moved.at[rows, index].get(out_sharding=spec)
  else:
    out = moved[rows, index]
  return jnp.moveaxis(out, 1, ax)


def _map(fn, tree, label: str):
  if isinstance(tree, (tuple, list)):
    return type(tree)(_map(fn, x, f"{label}[{i}]") for i, x in enumerate(tree))
  if isinstance(tree, dict):
    return {k: _map(fn, v, f"{label}[{k!r}]") for k, v in tree.items()}
  return fn(tree, label)


def apply_token_order(x_or_tree, order: TokenOrder, axis: int = 1):
  """Natural -> permuted order along `axis` (batch on axis 0) for an array or a tuple / list /
  dict of arrays (None passes through)."""
  return _map(lambda x, n: _take(x, order.order, axis, n), x_or_tree, "x")


def undo_token_order(x_or_tree, order: TokenOrder, axis: int = 1):
  """Permuted -> natural order along `axis`: the exact inverse of apply_token_order."""
  return _map(lambda x, n: _take(x, order.inverse, axis, n), x_or_tree, "x")


def resolve_token_order(token_order: str | None, permute_tokens_for_load_balance: bool | None,
                        *, default: str = "llama3") -> str:
  """The order the inputs arrive in: `token_order` ("natural", "llama3", "balanced") or the older
  flag (True "llama3", False "natural"); neither: `default`; contradicting: ValueError."""
  if token_order is None:
    if permute_tokens_for_load_balance is None:
      return default
    return "llama3" if permute_tokens_for_load_balance else "natural"
  if token_order not in ORDERS:
    raise ValueError(f"token_order must be one of {ORDERS}, got {token_order!r}")
  if (permute_tokens_for_load_balance is not None
      and bool(permute_tokens_for_load_balance) != (token_order == "llama3")):
    raise ValueError(
        f"permute_tokens_for_load_balance={permute_tokens_for_load_balance} contradicts "
        f"token_order={token_order!r}: pass token_order alone (the flag True means \"llama3\", "
        "False means \"natural\")")
  return token_order


def _reorder_chunks(x, cp: int, axis: int, inverse: bool, name: str):
  if x is None:
    return None
  cp = _check_cp(cp)
  ndim = len(x.shape)
  ax = axis + ndim if axis < 0 else axis
  if not 0 <= ax < ndim:
    raise ValueError(f"axis {axis} is out of range for {name} of shape {tuple(x.shape)}")
  n = x.shape[ax]
  if n % (2 * cp):
    raise ValueError(f"{name}: the sequence axis (axis {axis}, length {n}) must be divisible by "
                     f"2 * cp = {2 * cp}")
  if cp == 1:
    return x
  xp = np if isinstance(x, np.ndarray) else jnp
  c = n // (2 * cp)
  order = llama3_chunk_order(cp)
  if inverse:
    order = list(np.argsort(order))
  # Static slices + concatenate: cheap copies whose transposes are slices again (no gathers).
  chunks = [jax.lax.slice_in_dim(x, i * c, (i + 1) * c, axis=ax) if xp is jnp
            else np.take(x, np.arange(i * c, (i + 1) * c), axis=ax) for i in order]
  return xp.concatenate(chunks, axis=ax)


def to_load_balanced_order(x_or_tuple, cp: int, axis: int = 1):
  """Natural order -> load-balanced order for context parallelism `cp`: the sequence `axis`
  (length a multiple of 2*cp) is cut into 2*cp chunks and rank r gets chunks r and 2*cp-1-r.
  Takes an array (numpy or jax) or a nested tuple / list of them (None passes through)."""
  return _map(lambda x, n: _reorder_chunks(x, cp, axis, False, n), x_or_tuple, "x")


def from_load_balanced_order(x_or_tuple, cp: int, axis: int = 1):
  """Inverse of `to_load_balanced_order` (load-balanced order -> natural order)."""
  return _map(lambda x, n: _reorder_chunks(x, cp, axis, True, n), x_or_tuple, "x")


__all__ = ["ORDERS", "TokenOrder", "natural_order", "llama3_order", "llama3_chunk_order",
           "balanced_order", "token_order", "document_order", "unit_costs", "kept_pairs_per_token",
           "apply_token_order", "undo_token_order", "resolve_token_order", "to_load_balanced_order",
           "from_load_balanced_order"]
