"""Block tables read in kvax 0.1.0's terms, as kvax's own suite reads them (scripts/kvax_suite.py).

kvax's test_attention_mask derives per-view tables of four bounds from the dense token mask and
compares them with create_attention_mask's. kvax_plugin.ops.create_attention_mask's mask unpacks
into tables in kvax's layout (ops._kvax_views), while the kernels read the mask's own, which
differ in four ways, pinned here against a block reference of both:

1. Shapes: ours [B, n] and, under context parallelism, [B, cp * n_local]; kvax's [B, 1, n], and
   [B, cp, n_kv] for dkv.
2. The dq view: ours has query blocks of bwd_params.query_block_size and kv blocks of
   kv_block_size; kvax's the other way round (its dq kernel tiles the other way).
3. A dkv row with no full block: ours keeps its empty full range at `lower`, kvax's at `upper`
   (forward and dq rows: at `lower` in both).
4. skip_pad_tokens=False: ours visits every block that holds padding (masked: padding still
   attends nothing); kvax's tables let padding attend padding like one more document.

Everything else is kvax's definition for kvax's layouts (contiguous documents, positions
increasing, padding at the end): lower / upper of every row, the full range of rows that have
one, and under context parallelism the per-shard rows (queries in load-balanced order, kv block
indices of the gathered kv in natural order for fwd / dq, local query block indices for dkv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import layouts
import kvax_plugin
from kvax_plugin.attention.block_mask import table_to_grid
from kvax_plugin.ops import BlockTable, create_attention_mask
from kvax_plugin.utils import (FlashAttentionParamsConfig, attention_specs,
                               permute_tokens_context_parallelism)

S = 512
FWD = FlashAttentionParamsConfig(32, 32, 4, 2)
BWD = FlashAttentionParamsConfig(16, 32, 4, 2)  # query block != kv block, as kvax's 64 / 128


def _row_layout(doc_lengths, pad):
  """kvax's generator layout: documents back to back, positions counting over the whole row
  (not per document), padding (-1) at the end."""
  seg = np.full(S, -1, np.int32)
  start = 0
  for i, n in enumerate(doc_lengths):
    seg[start:start + n] = i
    start += n
  seg[S - pad:] = -1
  return np.arange(S, dtype=np.int32), seg


# (documents of row 0, padding of row 0, documents of row 1, padding of row 1): rows differ, so
# a mix-up of batch rows shows (kvax's suite uses identical rows).
LAYOUTS = {
    "one_doc": ([S], 0, [S], 0),
    "one_doc_padded": ([S], 100, [S], 301),
    "three_docs_padded": ([200, 150, 162], 70, [37, 400, 75], 0),
    "twelve_docs_padded": ([40] * 12 + [32], 45, [100, 3, 1, 250, 158], 130),
    "all_padding_row": ([S], S, [S], 17),
}


def _inputs(name):
  docs0, pad0, docs1, pad1 = LAYOUTS[name]
  rows = [_row_layout(docs0, pad0), _row_layout(docs1, pad1)]
  return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def _bounds(keep, outer_block, inner_block, empty_full_at="lower"):
  """(lower, upper, full_lower, full_upper) int [B, n_outer] of bool keep [B, outer, inner]:
  the span of inner blocks holding a kept pair (0, 0 if none) and the span of fully kept ones
  (an empty range at `empty_full_at` if none)."""
  b, so, si = keep.shape
  blocks = keep.reshape(b, so // outer_block, outer_block, si // inner_block, inner_block)

  def span(x):
    idx = np.arange(x.shape[-1])
    has = x.any(-1)
    first = np.where(has, np.where(x, idx, x.shape[-1]).min(-1), 0)
    last = np.where(has, np.where(x, idx, -1).max(-1) + 1, 0)
    return first, last, has

  lower, upper, _ = span(blocks.any(axis=(2, 4)))
  full_lower, full_upper, has_full = span(blocks.all(axis=(2, 4)))
  empty = lower if empty_full_at == "lower" else upper
  return lower, upper, np.where(has_full, full_lower, empty), np.where(has_full, full_upper, empty)


def _assert_view(view, expected, what):
  """view's four fields equal expected's, compared in the view's shape."""
  for field, want in zip(("lower_bounds", "upper_bounds", "lower_full_bounds",
                          "upper_full_bounds"), expected):
    got = np.asarray(getattr(view, field))
    np.testing.assert_array_equal(got, np.reshape(want, got.shape), err_msg=f"{what}.{field}")


def test_block_table_takes_kvax_field_names():
  a, b, c, d = (jnp.full((2, 3), i, jnp.int32) for i in range(4))
  kvax_style = BlockTable(lower_bounds=a, upper_bounds=b, lower_full_bounds=c,
                          upper_full_bounds=d)
  ours = BlockTable(a, b, c, d)
  assert all(x is y for x, y in zip(kvax_style, ours))
  assert kvax_style.lower_bounds is a and kvax_style.upper_full_bounds is d
  assert BlockTable(lower=a, upper=b, full_lower=c, full_upper=d).full_lower is c
  assert kvax_style.flatten() == (a, b, c, d) and BlockTable.unflatten((a, b, c, d)) == ours
  through = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t))(kvax_style)
  assert type(through) is BlockTable and int(through.upper_bounds[0, 0]) == 2
  with pytest.raises(TypeError, match="not a mix"):
    BlockTable(a, upper_bounds=b, lower_full_bounds=c, upper_full_bounds=d, lower_bounds=a)
  with pytest.raises(TypeError, match="missing kvax field"):
    BlockTable(lower_bounds=a, upper_bounds=b)
  # The class kvax's per-view AttentionMask maps to is the class of our mask's views.
  pos, seg = _inputs("one_doc")
  mask = create_attention_mask(jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos),
                               jnp.asarray(seg), FWD)
  assert type(mask[0]) is BlockTable and "BlockTable" in kvax_plugin.ops.__all__


def _as_document(seg):
  """Segment ids with padding relabelled as one more document (kvax's skip_pad_tokens=False)."""
  return np.where(seg == kvax_plugin.PADDING_SEGMENT_ID, seg.max() + 1, seg)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tables_in_kvax_terms(name):
  pos, seg = _inputs(name)
  keep = layouts.dense_mask_np(pos, seg, pos, seg, causal=True)
  args = [jnp.asarray(x) for x in (pos, seg, pos, seg)]
  mask = create_attention_mask(*args, FWD, BWD, True, True)
  # Unpacked, kvax's tables: [B, 1, n]; the dq view's query blocks of BWD's kv block size and kv
  # blocks of its query block size; a dkv row without a full block keeps it empty at `upper`.
  assert mask[0].lower_bounds.shape == mask[2].lower_bounds.shape == (2, 1, S // 32)
  assert mask[1].lower_bounds.shape == (2, 1, S // 32)
  _assert_view(mask[0], _bounds(keep, 32, 32), "fwd")
  _assert_view(mask[1], _bounds(keep, 32, 16), "dq")
  _assert_view(mask[2], _bounds(keep.transpose(0, 2, 1), 32, 16, empty_full_at="upper"), "dkv")
  # The tables the kernels read: the dq view tiled the other way, every empty range at `lower`.
  assert mask.fwd.lower.shape == (2, S // 32)
  _assert_view(mask.fwd, _bounds(keep, 32, 32), "own fwd")
  _assert_view(mask.dq, _bounds(keep, 16, 32), "own dq")
  _assert_view(mask.dkv, _bounds(keep.transpose(0, 2, 1), 32, 16), "own dkv")

  # skip_pad_tokens=False. kvax's tables: padding attends padding as one more document. The
  # kernels' own: the same full ranges as above, the visited ones grown to every block that
  # holds padding, from every row (padding still attends nothing).
  loose = create_attention_mask(*args, FWD, BWD, True, False)
  as_doc = layouts.dense_mask_np(pos, _as_document(seg), pos, _as_document(seg), causal=True)
  _assert_view(loose[0], _bounds(as_doc, 32, 32), "fwd, padding kept")
  _assert_view(loose[1], _bounds(as_doc, 32, 16), "dq, padding kept")
  _assert_view(loose[2], _bounds(as_doc.transpose(0, 2, 1), 32, 16, empty_full_at="upper"),
               "dkv, padding kept")
  own = (loose.fwd, loose.dq, loose.dkv)
  for view, strict, what in zip(own, (mask.fwd, mask.dq, mask.dkv), ("fwd", "dq", "dkv")):
    assert (np.asarray(view.lower_bounds) <= np.asarray(strict.lower_bounds)).all(), what
    assert (np.asarray(view.upper_bounds) >= np.asarray(strict.upper_bounds)).all(), what
    full = np.asarray(strict.upper_full_bounds) > np.asarray(strict.lower_full_bounds)
    for field in ("lower_full_bounds", "upper_full_bounds"):
      np.testing.assert_array_equal(np.asarray(getattr(view, field))[full],
                                    np.asarray(getattr(strict, field))[full], err_msg=what)
  padded_rows = (seg == kvax_plugin.PADDING_SEGMENT_ID).any(axis=1)
  np.testing.assert_array_equal(np.asarray(loose.fwd.upper)[padded_rows, 0], S // 32)


def test_kvax_views_are_not_computed_when_nobody_reads_them():
  # Under jit the swapped and relabelled builds are dead code unless a view is returned.
  pos, seg = _inputs("three_docs_padded")
  args = [jnp.asarray(x) for x in (pos, seg, pos, seg)]

  def own_tables(*a):
    m = create_attention_mask(*a, FWD, BWD, True, False)
    return m.fwd, m.dq, m.dkv

  def native_tables(*a):
    m = kvax_plugin.create_attention_mask(*a, FWD, BWD, True, False)
    return m.fwd, m.dq, m.dkv

  def views(*a):
    return tuple(create_attention_mask(*a, FWD, BWD, True, False))

  def ops(f):
    return sum(1 for line in jax.jit(f).lower(*args).compile().as_text().splitlines()
               if " = " in line)

  assert ops(own_tables) == ops(native_tables) < ops(views)
  native = kvax_plugin.create_attention_mask(*args, FWD, BWD, True, False)
  assert native.kvax_views is None and native[1].lower.shape == (2, S // 16)


@pytest.mark.parametrize("shape", [(2, 0), (0, 64), (2, 5)])
@pytest.mark.parametrize("skip_pad_tokens", [True, False])
def test_kvax_views_of_empty_and_short_rows(shape, skip_pad_tokens):
  ids = jnp.zeros(shape, jnp.int32)
  mask = create_attention_mask(ids, ids, ids, ids, FWD, BWD, True, skip_pad_tokens)
  n = -(-shape[1] // 32)
  assert [v.lower_bounds.shape for v in mask] == [(shape[0], 1, n)] * 3
  assert mask.fwd.lower.shape == (shape[0], n)


@pytest.mark.parametrize("name", ["one_doc_padded", "three_docs_padded", "twelve_docs_padded"])
@pytest.mark.parametrize("skip_pad_tokens", [True, False])
def test_context_parallel_tables_in_kvax_terms(name, skip_pad_tokens):
  """kvax's suite under context parallelism: query positions / segment ids permuted, kv ones in
  natural order, one mask for the mesh. Unpacked, kvax's tables: fwd and dq [B, 1, n] over the
  permuted queries, dkv [B, cp, n_kv] per query shard; the kernels' own are [B, cp * n_local]."""
  cp = 4
  if len(jax.devices()) < cp:
    pytest.skip("needs 4 devices (tests/conftest.py sets XLA_FLAGS for 8 CPU devices)")
  mesh = Mesh(np.array(jax.devices()[:cp]).reshape(1, cp), ("data", "context"))
  pos, seg = _inputs(name)
  with attention_specs(("data", "context", None, None), ("data", None, None, None)):
    q_pos, q_seg = permute_tokens_context_parallelism((jnp.asarray(pos), jnp.asarray(seg)),
                                                      mesh=mesh)
    mask = create_attention_mask(q_pos, q_seg, jnp.asarray(pos), jnp.asarray(seg), FWD, BWD,
                                 True, skip_pad_tokens, mesh)
  q_pos, q_seg = np.asarray(q_pos), np.asarray(q_seg)
  assert not np.array_equal(q_pos, pos)  # the query side really is in another order
  if not skip_pad_tokens:  # kvax's tables: padding as one more document
    fresh = seg.max() + 1
    q_seg, seg = (np.where(x == kvax_plugin.PADDING_SEGMENT_ID, fresh, x) for x in (q_seg, seg))
  keep = layouts.dense_mask_np(q_pos, q_seg, pos, seg, causal=True)  # rows: permuted queries
  _assert_view(mask[0], _bounds(keep, 32, 32), "fwd")
  _assert_view(mask[1], _bounds(keep, 32, 16), "dq")
  local = S // cp

  def per_shard(empty_full_at):
    shards = [_bounds(keep[:, i * local:(i + 1) * local].transpose(0, 2, 1), 32, 16,
                      empty_full_at) for i in range(cp)]
    return tuple(np.stack([shard[f] for shard in shards], axis=1) for f in range(4))

  assert mask[2].lower_bounds.shape == (2, cp, S // 32)
  _assert_view(mask[2], per_shard("upper"), "dkv")
  assert mask.dkv.lower.shape == (2, cp * (S // 32))
  if skip_pad_tokens:
    _assert_view(mask.dkv, per_shard("lower"), "own dkv")
  # kvax's print_mask draws a [B, cp, n] view with each shard's query blocks side by side.
  n_local = local // 16
  shards = [BlockTable(*(np.asarray(x)[:, i] for x in mask[2])) for i in range(cp)]
  np.testing.assert_array_equal(
      table_to_grid(mask[2], S // 16),
      np.concatenate([table_to_grid(t, n_local) for t in shards], axis=2))
  text = kvax_plugin.ops.print_mask(mask[2], S // 16, fit_in_screen=False)
  assert len(text.splitlines()) == 1 + 2 + S // 32 and "░░" in text
