"""The block mask: which key/value blocks each query block must visit, and which are full.

Token q attends kv iff seg[q] == seg[kv] != PADDING_SEGMENT_ID, and (causal) pos[kv] <= pos[q],
and (window w) pos[q] - pos[kv] < w (without causal also pos[kv] - pos[q] < w). A table holds,
per outer block, int32 lower <= full_lower <= full_upper <= upper: inner blocks [lower, upper)
are visited, [full_lower, full_upper) keep every pair (no mask math). Built from per-block
summaries: "may attend" is conservative, "full" exact. Views: `fwd` and `dq` (outer: query
blocks), `dkv` (outer: kv blocks). Design: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention import arguments
from kvax_plugin.attention.params import (DEFAULT_BWD_PARAMS, DEFAULT_FWD_PARAMS,
                                          PADDING_SEGMENT_ID, FlashAttentionParamsConfig,
                                          check_params)

_INT32_MAX = np.iinfo(np.int32).max
_INT32_MIN = np.iinfo(np.int32).min
# Largest number of [outer x inner] classification entries materialised at once while building.
_BUILD_CHUNK_ELEMENTS = 1 << 22


class _BlockTableFields(NamedTuple):
  lower: jax.Array
  upper: jax.Array
  full_lower: jax.Array
  full_upper: jax.Array


_KVAX_FIELDS = ("lower_bounds", "upper_bounds", "lower_full_bounds", "upper_full_bounds")


class BlockTable(_BlockTableFields):
  """One view of the block grid; every field is int32 [B, num_outer_blocks]. kvax 0.1.0's
  field names and flatten() / unflatten() also work (either spelling, not both)."""

  __slots__ = ()

  def __new__(cls, *args, **kwargs):
    kvax_names = [k for k in _KVAX_FIELDS if k in kwargs]
    if kvax_names:
      if args or len(kwargs) != len(kvax_names):
        raise TypeError("BlockTable takes either its own fields (lower, upper, full_lower, "
                        "full_upper) or kvax's (lower_bounds, upper_bounds, lower_full_bounds, "
                        f"upper_full_bounds), not a mix: got {len(args)} positional and "
                        f"{sorted(kwargs)}")
      missing = [k for k in _KVAX_FIELDS if k not in kwargs]
      if missing:
        raise TypeError(f"BlockTable() missing kvax field(s) {missing}")
      return super().__new__(cls, *(kwargs[k] for k in _KVAX_FIELDS))
    return super().__new__(cls, *args, **kwargs)

  @property
  def lower_bounds(self) -> jax.Array:
    return self.lower

  @property
  def upper_bounds(self) -> jax.Array:
    return self.upper

  @property
  def lower_full_bounds(self) -> jax.Array:
    return self.full_lower

  @property
  def upper_full_bounds(self) -> jax.Array:
    return self.full_upper

  def flatten(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(lower_bounds, upper_bounds, lower_full_bounds, upper_full_bounds), as kvax."""
    return tuple(self)

  @classmethod
  def unflatten(cls, flat) -> "BlockTable":
    return cls(*flat)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Static description of what a mask was built for (hashable; the pytree's aux data)."""

  batch: int
  q_len: int
  kv_len: int
  causal: bool
  sliding_window: int | None
  skip_pad_tokens: bool
  fwd_params: FlashAttentionParamsConfig
  bwd_params: FlashAttentionParamsConfig | None


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class AttentionMask:
  """Block tables for the forward pass and, optionally, the two backward passes.

  A pytree (tables are leaves, `spec` static) that also reads like kvax 0.1.0's tuple (fwd,) or
  (fwd, dq, dkv). `fingerprint` (uint32 [B, 4], mask_fingerprint) identifies the ids it was
  built from. `kvax_views` (kvax_plugin.ops): the tables in kvax's layout, which unpacking gives.
  """

  # Fingerprint columns flash_attention compares: all four (tables index tokens by buffer
  # position).
  checked_fingerprint_columns = (0, 1, 2, 3)

  spec: MaskSpec
  fwd: BlockTable
  dq: BlockTable | None = None
  dkv: BlockTable | None = None
  fingerprint: jax.Array | None = None
  kvax_views: tuple[BlockTable, ...] | None = None

  def tree_flatten(self):
    return (self.fwd, self.dq, self.dkv, self.fingerprint, self.kvax_views), self.spec

  @classmethod
  def tree_unflatten(cls, spec, children):
    fwd, dq, dkv, fingerprint, kvax_views = children
    return cls(spec, fwd, dq, dkv, fingerprint=fingerprint, kvax_views=kvax_views)

  @property
  def causal(self) -> bool:
    return self.spec.causal

  @property
  def sliding_window(self) -> int | None:
    return self.spec.sliding_window

  @property
  def has_backward(self) -> bool:
    return self.dq is not None

  def views(self) -> tuple[BlockTable, ...]:
    """(fwd,) or (fwd, dq, dkv): the order of kvax's tuple of masks (kvax_views where set)."""
    if self.kvax_views is not None:
      return self.kvax_views
    return (self.fwd,) if self.dq is None else (self.fwd, self.dq, self.dkv)

  def __len__(self) -> int:
    return len(self.views())

  def __getitem__(self, index):
    return self.views()[index]

  def __iter__(self):
    return iter(self.views())


class _BlockSummary(NamedTuple):
  """Per-block statistics of three token groups, each [B, num_blocks, 3]: the block's first real
  segment, its last (when different), every other real token; the segment test is a [min, max]
  overlap, exact for the first two."""

  seg_min: jax.Array
  seg_max: jax.Array
  pos_min: jax.Array
  pos_max: jax.Array
  nonempty: jax.Array
  uniform: jax.Array


def num_blocks(length: int, block: int) -> int:
  return -(-length // block)


def _pad_to_blocks(x: jax.Array, block: int, fill: int) -> jax.Array:
  length = x.shape[1]
  extra = num_blocks(length, block) * block - length
  if extra == 0:
    return x
  return jnp.pad(x, ((0, 0), (0, extra)), constant_values=fill)


def _summarise(positions: jax.Array, segment_ids: jax.Array, block: int,
               skip_pad_tokens: bool) -> _BlockSummary:
  """Summaries of each block of `block` tokens; the tail block is padded with padding tokens."""
  seg = _pad_to_blocks(segment_ids.astype(jnp.int32), block, PADDING_SEGMENT_ID)
  pos = _pad_to_blocks(positions.astype(jnp.int32), block, 0)
  b = seg.shape[0]
  seg = seg.reshape(b, -1, block)
  pos = pos.reshape(b, -1, block)
  real = seg != PADDING_SEGMENT_ID
  first_seg = jnp.take_along_axis(seg, jnp.argmax(real, axis=-1)[..., None], axis=-1)
  last_seg = jnp.take_along_axis(seg, (block - 1 - jnp.argmax(real[..., ::-1], axis=-1))[..., None],
                                 axis=-1)
  in_first = real & (seg == first_seg)
  in_last = real & (seg == last_seg) & (last_seg != first_seg)
  in_other = real & ~in_first & ~in_last
  groups = jnp.stack([in_first, in_last, in_other], axis=-2)
  seg_g, pos_g = seg[..., None, :], pos[..., None, :]
  seg_min = jnp.min(jnp.where(groups, seg_g, _INT32_MAX), axis=-1)
  seg_max = jnp.max(jnp.where(groups, seg_g, _INT32_MIN), axis=-1)
  # Positions over the group's tokens only: padding positions are arbitrary.
  pos_min = jnp.min(jnp.where(groups, pos_g, _INT32_MAX), axis=-1)
  pos_max = jnp.max(jnp.where(groups, pos_g, _INT32_MIN), axis=-1)
  nonempty = jnp.any(groups, axis=-1)
  uniform = (jnp.all(real, axis=-1) & ~jnp.any(in_last | in_other, axis=-1))[..., None]
  if not skip_pad_tokens:
    # Blocks holding padding are visited (masked): their third group is a wildcard.
    has_pad = ~jnp.all(real, axis=-1)
    wild = has_pad[..., None] & (jnp.arange(3) == 2)
    seg_min = jnp.where(wild, _INT32_MIN, seg_min)
    seg_max = jnp.where(wild, _INT32_MAX, seg_max)
    pos_min = jnp.where(wild, _INT32_MIN, pos_min)
    pos_max = jnp.where(wild, _INT32_MAX, pos_max)
    nonempty = nonempty | wild
  return _BlockSummary(seg_min, seg_max, pos_min, pos_max, nonempty, uniform)


def _classify(q: _BlockSummary, kv: _BlockSummary, causal: bool,
              window: int | None) -> tuple[jax.Array, jax.Array]:
  """(may_attend, full) for broadcastable query-block and kv-block summaries; "full" uses group
  0, which holds every token of a uniform block."""
  qg = jax.tree.map(lambda x: x[..., :, None], q)
  kg = jax.tree.map(lambda x: x[..., None, :], kv)
  may = (qg.nonempty & kg.nonempty & (qg.seg_min <= kg.seg_max) & (kg.seg_min <= qg.seg_max))
  if causal:
    may &= kg.pos_min <= qg.pos_max
  if window is not None:
    may &= diff_below(qg.pos_min, kg.pos_max, window)
    if not causal:
      may &= diff_below(kg.pos_min, qg.pos_max, window)
  may = jnp.any(may, axis=(-2, -1))

  q0 = jax.tree.map(lambda x: x[..., 0], q)
  k0 = jax.tree.map(lambda x: x[..., 0], kv)
  full = q0.uniform & k0.uniform & (q0.seg_min == k0.seg_min)
  if causal:
    full &= k0.pos_max <= q0.pos_min
  if window is not None:
    full &= diff_below(q0.pos_max, k0.pos_min, window)
    if not causal:
      full &= diff_below(k0.pos_max, q0.pos_min, window)
  return may, full & may


def diff_below(a: jax.Array, b: jax.Array, w: int) -> jax.Array:
  """a - b < w, exactly, for int32 a, b and 1 <= w < 2**32 (wrapping uint32 arithmetic)."""
  a, b = a.astype(jnp.int32), b.astype(jnp.int32)
  u = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
  return (a < b) | (u(a) - u(b) < jnp.uint32(w))


def _ranges(may: jax.Array, full: jax.Array) -> tuple[jax.Array, ...]:
  n = may.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  any_may = jnp.any(may, axis=-1)
  lower = jnp.where(any_may, jnp.min(jnp.where(may, idx, n), axis=-1), 0)
  upper = jnp.where(any_may, jnp.max(jnp.where(may, idx, -1), axis=-1) + 1, 0)
  # The full sub-range is the first run of consecutive full blocks (others stay "partial").
  any_full = jnp.any(full, axis=-1)
  full_lower = jnp.min(jnp.where(full, idx, n), axis=-1)
  after = idx > full_lower[..., None]
  full_upper = jnp.min(jnp.where(after & ~full, idx, n), axis=-1)
  full_upper = jnp.minimum(full_upper, upper)
  full_lower = jnp.where(any_full, full_lower, lower)
  full_upper = jnp.where(any_full, full_upper, lower)
  return tuple(x.astype(jnp.int32) for x in (lower, upper, full_lower, full_upper))


def _build_table(outer: _BlockSummary, inner: _BlockSummary, outer_is_query: bool,
                 causal: bool, window: int | None) -> BlockTable:
  """Table of `inner` blocks for every `outer` block, built in chunks of outer blocks so the
  [outer x inner] classification never exists whole."""
  n_outer = outer.seg_min.shape[1]
  n_inner = inner.seg_min.shape[1]

  def one_outer_block(o: _BlockSummary) -> tuple[jax.Array, ...]:
    o = jax.tree.map(lambda x: x[:, None], o)
    if outer_is_query:
      may, full = _classify(o, inner, causal, window)
    else:
      may, full = _classify(inner, o, causal, window)
    return _ranges(may, full)

  per_outer = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), outer)
  batch = inner.seg_min.shape[0]
  chunk = max(1, min(n_outer, _BUILD_CHUNK_ELEMENTS // max(1, 9 * batch * n_inner)))
  lower, upper, full_lower, full_upper = jax.lax.map(one_outer_block, per_outer,
                                                     batch_size=chunk)
  return BlockTable(*(jnp.moveaxis(x, 0, 1) for x in (lower, upper, full_lower, full_upper)))


def check_mask_inputs(query_positions, query_segment_ids, kv_positions, kv_segment_ids,
                      sliding_window=None) -> None:
  named = {"query_positions": query_positions, "query_segment_ids": query_segment_ids,
           "kv_positions": kv_positions, "kv_segment_ids": kv_segment_ids}
  for name, x in named.items():
    if not hasattr(x, "shape") or len(x.shape) != 2:
      raise ValueError(f"{name} must be a [batch, seq_len] array, got shape "
                       f"{getattr(x, 'shape', type(x).__name__)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must hold integers (int32), got dtype {x.dtype}")
  if query_positions.shape != query_segment_ids.shape:
    raise ValueError(f"query_positions {query_positions.shape} and query_segment_ids "
                     f"{query_segment_ids.shape} must have the same shape")
  if kv_positions.shape != kv_segment_ids.shape:
    raise ValueError(f"kv_positions {kv_positions.shape} and kv_segment_ids "
                     f"{kv_segment_ids.shape} must have the same shape")
  if query_positions.shape[0] != kv_positions.shape[0]:
    raise ValueError(f"batch of the query ({query_positions.shape[0]}) and of the key/value "
                     f"({kv_positions.shape[0]}) must match")
  arguments.normalize_window(sliding_window)


def normalize_mask_options(*, fwd_params, bwd_params, calc_bwd_mask, skip_pad_tokens, causal,
                           sliding_window) -> dict[str, Any]:
  """The options of create_attention_mask checked (errors name the argument) and normalised:
  bools and ints from Python or NumPy values, sliding_window >= 2**32 as None."""
  check_params("fwd_params", fwd_params)
  check_params("bwd_params", bwd_params)
  return dict(fwd_params=fwd_params, bwd_params=bwd_params,
              calc_bwd_mask=arguments.as_bool("calc_bwd_mask", calc_bwd_mask),
              skip_pad_tokens=arguments.as_bool("skip_pad_tokens", skip_pad_tokens),
              causal=arguments.as_bool("causal", causal),
              sliding_window=arguments.normalize_window(sliding_window))


def create_attention_mask(query_positions: jax.Array,
                          query_segment_ids: jax.Array,
                          kv_positions: jax.Array,
                          kv_segment_ids: jax.Array,
                          *,
                          fwd_params: FlashAttentionParamsConfig | None = None,
                          bwd_params: FlashAttentionParamsConfig | None = None,
                          calc_bwd_mask: bool = False,
                          skip_pad_tokens: bool = True,
                          causal: bool = True,
                          sliding_window: int | None = None) -> AttentionMask:
  """The block tables of one device's problem (api.create_attention_mask calls this per shard).

  Arguments as api.create_attention_mask; sliding_window of 2**32 or more is stored as None. A
  batch or a length of 0 gives tables that visit nothing.
  """
  check_mask_inputs(query_positions, query_segment_ids, kv_positions, kv_segment_ids,
                    sliding_window)
  options = normalize_mask_options(
      fwd_params=fwd_params, bwd_params=bwd_params, calc_bwd_mask=calc_bwd_mask,
      skip_pad_tokens=skip_pad_tokens, causal=causal, sliding_window=sliding_window)
  fwd_params, bwd_params = options["fwd_params"], options["bwd_params"]
  calc_bwd_mask, skip_pad_tokens = options["calc_bwd_mask"], options["skip_pad_tokens"]
  causal, sliding_window = options["causal"], options["sliding_window"]
  fwd_params = fwd_params or DEFAULT_FWD_PARAMS
  if calc_bwd_mask:
    bwd_params = bwd_params or DEFAULT_BWD_PARAMS
  window = None if sliding_window is None else int(sliding_window)
  spec = MaskSpec(batch=int(query_positions.shape[0]), q_len=int(query_positions.shape[1]),
                  kv_len=int(kv_positions.shape[1]), causal=bool(causal), sliding_window=window,
                  skip_pad_tokens=bool(skip_pad_tokens), fwd_params=fwd_params,
                  bwd_params=bwd_params if calc_bwd_mask else None)

  fingerprint = mask_fingerprint(query_positions, query_segment_ids, kv_positions,
                                 kv_segment_ids)
  if 0 in (spec.batch, spec.q_len, spec.kv_len):
    return AttentionMask(spec, *_empty_tables(spec), fingerprint=fingerprint)
  fwd, dq, dkv = _build_tables(query_positions, query_segment_ids, kv_positions, kv_segment_ids,
                                spec=spec)
  return AttentionMask(spec, fwd, dq, dkv, fingerprint=fingerprint)


def token_fingerprint(positions: jax.Array, segment_ids: jax.Array, *,
                      ordered: bool = False) -> jax.Array:
  """uint32 [B]: a cheap (non-cryptographic) hash of each row's (position, segment id) pairs;
  ordered=False is order-free, ordered=True mixes in each token's index."""
  u = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)  # noqa: E731
  h = (u(positions) * jnp.uint32(0x9E3779B1)) ^ (u(segment_ids) * jnp.uint32(0x85EBCA77)
                                                 + jnp.uint32(0x27D4EB2F))
  h = (h ^ (h >> 15)) * jnp.uint32(0x2C1B3C6D)
  h = (h ^ (h >> 12)) * jnp.uint32(0x297A2D39)
  if ordered:
    # The index enters before a nonlinear round, so a moved token cannot cancel out.
    idx = jnp.arange(positions.shape[1], dtype=jnp.uint32)[None, :]
    h = (h ^ (idx * jnp.uint32(0xCC9E2D51) + jnp.uint32(0x165667B1))) * jnp.uint32(0x1B873593)
    h = (h ^ (h >> 13)) * jnp.uint32(0x85EBCA6B)
  return jnp.sum(h ^ (h >> 15), axis=1, dtype=jnp.uint32)


@jax.jit
def mask_fingerprint(query_positions, query_segment_ids, kv_positions, kv_segment_ids):
  """uint32 [B, 4]: token_fingerprint of the query and kv sides, order-free (columns 0, 1) then
  ordered (2, 3)."""
  return jnp.stack([token_fingerprint(query_positions, query_segment_ids),
                    token_fingerprint(kv_positions, kv_segment_ids),
                    token_fingerprint(query_positions, query_segment_ids, ordered=True),
                    token_fingerprint(kv_positions, kv_segment_ids, ordered=True)], axis=1)


def _empty_tables(spec: MaskSpec):
  """(fwd, dq, dkv) tables that visit nothing, for a batch or a length of 0."""

  def table(n_outer: int) -> BlockTable:
    return BlockTable(*(jnp.zeros((spec.batch, n_outer), jnp.int32) for _ in range(4)))

  f, b = spec.fwd_params, spec.bwd_params
  fwd = table(num_blocks(spec.q_len, f.query_block_size))
  if b is None:
    return fwd, None, None
  return (fwd, table(num_blocks(spec.q_len, b.query_block_size)),
          table(num_blocks(spec.kv_len, b.kv_block_size)))


@functools.partial(jax.jit, static_argnames=("spec",))
def _build_tables(query_positions, query_segment_ids, kv_positions, kv_segment_ids, *,
                  spec: MaskSpec):
  """(fwd, dq, dkv) tables; dq and dkv are None without backward params."""

  def summaries(params):
    q = _summarise(query_positions, query_segment_ids, params.query_block_size,
                   spec.skip_pad_tokens)
    kv = _summarise(kv_positions, kv_segment_ids, params.kv_block_size, spec.skip_pad_tokens)
    return q, kv

  q_f, kv_f = summaries(spec.fwd_params)
  fwd = _build_table(q_f, kv_f, True, spec.causal, spec.sliding_window)
  if spec.bwd_params is None:
    return fwd, None, None
  q_b, kv_b = summaries(spec.bwd_params)
  dq = _build_table(q_b, kv_b, True, spec.causal, spec.sliding_window)
  dkv = _build_table(kv_b, q_b, False, spec.causal, spec.sliding_window)
  return fwd, dq, dkv


def token_keep(q_pos, q_seg, kv_pos, kv_seg, *, causal: bool,
               sliding_window: int | None) -> jax.Array:
  """The token rule on broadcastable arrays (the dense reference and the JAX backend's masked
  blocks)."""
  qp, kp = q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32)
  keep = (q_seg == kv_seg) & (q_seg != PADDING_SEGMENT_ID)
  if causal:
    keep &= kp <= qp
  if sliding_window is not None:
    keep &= diff_below(qp, kp, sliding_window)
    if not causal:
      keep &= diff_below(kp, qp, sliding_window)
  return keep


def dense_mask(query_positions, query_segment_ids, kv_positions, kv_segment_ids, *,
               causal: bool = True, sliding_window: int | None = None) -> jax.Array:
  """The token-level mask, bool [B, Sq, Skv]. O(S^2): for tests, the reference and pictures."""
  return token_keep(query_positions[:, :, None], query_segment_ids[:, :, None],
                    kv_positions[:, None, :], kv_segment_ids[:, None, :], causal=causal,
                    sliding_window=sliding_window)


def _blocks_per_tile(lower, upper, tiles_per_row: int, n_tiles: int):
  """int32 [B, n_tiles]: visited blocks per kernel tile (tiles_per_row tiles per table row)."""
  return jnp.repeat(upper - lower, tiles_per_row, axis=1)[:, :n_tiles]


def longest_first(lower, upper, tiles_per_row: int, n_tiles: int):
  """int32 [B, n_tiles]: the kernel tiles by descending visited blocks (ties in tile order), so a
  long tile does not start last and run alone."""
  counts = _blocks_per_tile(lower, upper, tiles_per_row, n_tiles)
  return jnp.argsort(-counts, axis=1, stable=True).astype(jnp.int32)


def documents_longest_first(lower, upper, tiles_per_row: int, n_tiles: int):
  """int32 [B, n_tiles]: the kernel tiles grouped by their last visited block (under a causal
  mask on packed documents, one group per document), the groups by descending summed visited
  blocks, each group's tiles in tile order (ties between groups: the group ending first).

  Each group's tiles run next to each other, so the tiles in flight share their documents'
  blocks in L2, and the documents with the most work start first, so that none is left to run
  alone at the end of the launch."""
  counts = _blocks_per_tile(lower, upper, tiles_per_row, n_tiles)
  ends = jnp.repeat(upper, tiles_per_row, axis=1)[:, :n_tiles]
  tiles = jnp.arange(n_tiles, dtype=jnp.int32)

  def row(ends, counts):
    by_end = jnp.argsort(ends, stable=True)
    sorted_ends = ends[by_end]
    group = jnp.cumsum(jnp.concatenate(
        [jnp.zeros(1, jnp.int32), (sorted_ends[1:] != sorted_ends[:-1]).astype(jnp.int32)]))
    work = jax.ops.segment_sum(counts[by_end], group, num_segments=n_tiles)[group]
    group_work = jnp.zeros_like(counts).at[by_end].set(work)
    return jnp.lexsort((tiles, ends, -group_work))

  return jax.vmap(row)(ends, counts).astype(jnp.int32)


def documents_longest_first_over_heads(lower, upper, tiles_per_row: int, n_tiles: int,
                                       n_heads: int, wave: int):
  """int32 [B, n_heads * n_tiles]: the (head, tile) each launch position runs, coded
  head * n_tiles + tile: documents_longest_first's groups (under a causal mask on packed
  documents, one per document) in its order, each group's pairs together.

  A group with more pairs (tiles x heads) than `wave` (the CTAs the GPU runs at once) runs its
  tiles in tile order once per head, the heads one after another: the pairs in flight are then
  one head's neighbouring tiles, which read the same query blocks (on one causal document, each
  head's tiles in sequence). A smaller group runs in one wave whatever its order, so its tiles'
  heads go together, and its longest tiles start first for every head."""
  order = documents_longest_first(lower, upper, tiles_per_row, n_tiles)
  ends = jnp.repeat(upper, tiles_per_row, axis=1)[:, :n_tiles]
  positions = jnp.arange(n_tiles, dtype=jnp.int32)

  def row(order, ends):
    sorted_ends = ends[order]
    first = jnp.concatenate([jnp.ones(1, bool), sorted_ends[1:] != sorted_ends[:-1]])
    start = jax.lax.cummax(jnp.where(first, positions, 0))  # the group's first position
    group = jnp.cumsum(first.astype(jnp.int32)) - 1
    size = jax.ops.segment_sum(jnp.ones(n_tiles, jnp.int32), group, num_segments=n_tiles)[group]
    heads = jnp.arange(n_heads, dtype=jnp.int32)[:, None]
    by_head = start * n_heads + heads * size + (positions - start)  # [n_heads, n_tiles]
    together = (start + (positions - start)) * n_heads + heads
    where = jnp.where(size * n_heads > wave, by_head, together)
    codes = heads * n_tiles + order
    return jnp.zeros(n_heads * n_tiles, jnp.int32).at[where.reshape(-1)].set(codes.reshape(-1))

  return jax.vmap(row)(order, ends)


def longest_first_over_heads(lower, upper, tiles_per_row: int, n_tiles: int, n_heads: int):
  """int32 [B, n_heads * n_tiles]: the (head, tile) each launch position of a backward grid runs,
  coded tile * n_heads + head: tiles by descending visited blocks, heads interleaved."""
  counts = _blocks_per_tile(lower, upper, tiles_per_row, n_tiles)
  per_pair = jnp.repeat(counts, n_heads, axis=1)
  return jnp.argsort(-per_pair, axis=1, stable=True).astype(jnp.int32)


def table_to_grid(table: BlockTable, n_inner: int) -> np.ndarray:
  """Expand a table to int8 [B, n_outer, n_inner]: 0 skipped, 1 visited (masked), 2 full. In
  kvax's layout [B, shards, n_outer], shard s's inner blocks start at s * n_inner / shards."""
  lower, upper, fl, fu = (np.asarray(x) for x in table)
  if lower.ndim == 2:
    lower, upper, fl, fu = (x[:, None] for x in (lower, upper, fl, fu))
  lower, upper, fl, fu = (x[..., None] for x in (lower, upper, fl, fu))
  local = np.arange(n_inner // lower.shape[1])
  grid = ((local >= lower) & (local < upper)).astype(np.int8)
  grid[(local >= fl) & (local < fu)] = 2
  return grid.transpose(0, 2, 1, 3).reshape(grid.shape[0], grid.shape[2], -1)


def _table_sum(x) -> float:
  """Sum of a table on the host (an eager jnp op would compile a program per shape); a table
  spread over processes is summed where it lives."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return float(jnp.sum(x))
  return float(np.sum(np.asarray(x), dtype=np.int64))


def mask_sparsity(mask: AttentionMask) -> dict[str, float]:
  """Share of forward blocks visited and share full, over the whole [Sq x Skv] block grid."""
  spec = mask.spec
  nq = num_blocks(spec.q_len, spec.fwd_params.query_block_size)
  nk = num_blocks(spec.kv_len, spec.fwd_params.kv_block_size)
  total = spec.batch * nq * nk
  if total == 0:
    return {"blocks_total": 0.0, "visited": 0.0, "full": 0.0, "partial": 0.0, "skipped": 0.0}
  t = mask.fwd
  visited = _table_sum(t.upper) - _table_sum(t.lower)
  full = _table_sum(t.full_upper) - _table_sum(t.full_lower)
  return {"blocks_total": float(total), "visited": visited / total, "full": full / total,
          "partial": (visited - full) / total, "skipped": 1.0 - visited / total}


def partial_share(table: BlockTable) -> jax.Array:
  """float32 scalar, traceable: of the blocks `table` visits over all rows, the share it keeps
  only partly (those run the mask math); 0 when it visits none."""
  visited = jnp.sum(table.upper - table.lower)
  whole = jnp.sum(table.full_upper - table.full_lower)
  return (visited - whole).astype(jnp.float32) / jnp.maximum(visited, 1).astype(jnp.float32)


def draw_mask(mask: AttentionMask, path: str, *, batch_index: int = 0, view: str = "fwd",
              title: str | None = None) -> str:
  """Draw one batch row of a block table as a PNG (skipped / masked / full) and return the path."""
  if not isinstance(mask, AttentionMask):
    raise TypeError(f"mask must be an AttentionMask from create_attention_mask, got "
                    f"{type(mask).__name__}")
  views = ("fwd", "dq", "dkv")
  if view not in views:
    raise ValueError(f"view must be one of {views} (forward, backward dq, backward dk/dv "
                     f"tables), got {view!r}")
  spec = mask.spec
  batch_index = arguments.as_int("batch_index", batch_index, minimum=0)
  if batch_index >= spec.batch:
    raise ValueError(f"batch_index {batch_index} is out of range for a mask of batch {spec.batch}")
  table = getattr(mask, view)
  if table is None:
    raise ValueError(f"view={view!r} is absent: build the mask with calc_bwd_mask=True")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.colors import ListedColormap

  params = spec.fwd_params if view == "fwd" else spec.bwd_params
  if view == "dkv":
    n_inner = num_blocks(spec.q_len, params.query_block_size)
    ylabel, xlabel = "kv block", "query block"
  else:
    n_inner = num_blocks(spec.kv_len, params.kv_block_size)
    ylabel, xlabel = "query block", "kv block"
  grid = table_to_grid(table, n_inner)[batch_index]
  fig, ax = plt.subplots(figsize=(6, 6))
  cmap = ListedColormap(["#f2f2f2", "#f39c12", "#1f77b4"])
  ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  shares = np.bincount(grid.ravel(), minlength=3) / grid.size
  ax.set_title(title or f"{view} block mask: {shares[1]:.1%} masked, {shares[2]:.1%} full, "
               f"{shares[0]:.1%} skipped", fontsize=9)
  from matplotlib.patches import Patch
  ax.legend(handles=[Patch(color=c, label=l) for c, l in
                     zip(cmap.colors, ["skipped", "visited, masked", "visited, full"])],
            loc="upper right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _as_table(mask: "AttentionMask | BlockTable", name: str) -> BlockTable:
  if isinstance(mask, AttentionMask):
    return mask.fwd
  if isinstance(mask, BlockTable):
    return mask
  raise TypeError(f"{name} must be an AttentionMask or one of its views (mask[0], mask[1], "
                  f"mask[2]), got {type(mask).__name__}")


def calculate_mask_sparsity(mask: "AttentionMask | BlockTable", query_block_size: int,
                            kv_block_size: int, query_seq_len: int, kv_seq_len: int) -> float:
  """kvax's calculate_mask_sparsity: the share of blocks the view visits (1.0 = dense). mask: a
  view or a whole mask (its forward view); block sizes and lengths are the view's."""
  table = _as_table(mask, "mask")
  batch = table.lower.shape[0]
  visited = float(jnp.sum(table.upper - table.lower))
  return visited / (query_seq_len // query_block_size) / (kv_seq_len // kv_block_size) / batch


_PRINT_MAX_ROWS, _PRINT_MAX_COLUMNS = 32, 64


def print_mask(mask: "AttentionMask | BlockTable", num_inner_blocks: int,
               print_only_first_in_batch: bool = True, fit_in_screen: bool = True) -> str:
  """kvax's print_mask: a view as text ("██" full, "░░" masked, "  " skipped), logged at INFO
  on the `kvax_plugin` logger and returned; fit_in_screen averages down to 32 x 64 cells."""
  table = _as_table(mask, "mask")
  grid = table_to_grid(table, int(num_inner_blocks))
  rows = grid[:1] if print_only_first_in_batch else grid
  text = ["Attention masks:"]
  for g in rows:
    g = g.astype(np.float64)
    if fit_in_screen:
      g = _average_cells(g, -(-g.shape[0] // _PRINT_MAX_ROWS),
                         -(-g.shape[1] // _PRINT_MAX_COLUMNS))
    cells = np.where(g == 2, "██", np.where(g == 0, "  ", "░░"))
    text.append("  " + "==" * g.shape[1])
    text += ["||" + "".join(row) + "||" for row in cells]
    text.append("  " + "==" * g.shape[1])
  out = "\n".join(text) + "\n"
  logging.getLogger("kvax_plugin").info(out)
  return out


def _average_cells(grid: np.ndarray, row_step: int, col_step: int) -> np.ndarray:
  """Mean of each row_step x col_step group of cells (edges padded with skipped cells)."""
  if row_step <= 1 and col_step <= 1:
    return grid
  r = -(-grid.shape[0] // row_step) * row_step
  c = -(-grid.shape[1] // col_step) * col_step
  padded = np.zeros((r, c))
  padded[:grid.shape[0], :grid.shape[1]] = grid
  return padded.reshape(r // row_step, row_step, c // col_step, col_step).mean(axis=(1, 3))
