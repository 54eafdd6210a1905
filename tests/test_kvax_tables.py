"""Block tables read in kvax 0.1.0's terms, as kvax's own suite reads them (scripts/kvax_suite.py).

kvax's test_attention_mask derives per-view tables of four bounds from the dense token mask and
compares them with create_attention_mask's. Through scripts/kvax_suite.py those cases now build
their views (kvax_plugin.ops.BlockTable takes kvax's field names) but still fail, because our
tables differ from kvax's in four deliberate ways, pinned here against our own block reference:

1. Shapes: [B, n] and, under context parallelism, [B, cp * n_local]; kvax's are [B, 1, n], and
   [B, cp, n_kv] for dkv (so kvax's equality check cannot even broadcast).
2. The dq view has query blocks of bwd_params.query_block_size and kv blocks of kv_block_size;
   kvax's dq table swaps the two (its dq kernel tiles the other way).
3. A dkv row with no full block stores its empty full range at `lower`; kvax stores it at `upper`
   (forward and dq rows: at `lower` in both).
4. skip_pad_tokens=False visits every block that holds padding (masked: padding still attends
   nothing); kvax then lets padding attend padding like one more document.

Everything else equals kvax's definitions for kvax's layouts (contiguous documents, positions
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
  for field, want in zip(("lower_bounds", "upper_bounds", "lower_full_bounds",
                          "upper_full_bounds"), expected):
    np.testing.assert_array_equal(np.asarray(getattr(view, field)), want, err_msg=f"{what}.{field}")


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


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tables_in_kvax_terms(name):
  pos, seg = _inputs(name)
  keep = layouts.dense_mask_np(pos, seg, pos, seg, causal=True)
  args = [jnp.asarray(x) for x in (pos, seg, pos, seg)]
  mask = create_attention_mask(*args, FWD, BWD, True, True)
  assert mask[0].lower_bounds.shape == (2, S // 32)  # kvax: (2, 1, S // 32)
  _assert_view(mask[0], _bounds(keep, 32, 32), "fwd")
  _assert_view(mask[1], _bounds(keep, 16, 32), "dq")  # kvax's dq: _bounds(keep, 32, 16)
  dkv = _bounds(keep.transpose(0, 2, 1), 32, 16)
  _assert_view(mask[2], dkv, "dkv")
  kvax_dkv = _bounds(keep.transpose(0, 2, 1), 32, 16, empty_full_at="upper")
  only_empty = (dkv[2] != kvax_dkv[2]) <= (dkv[2] == dkv[3])
  assert only_empty.all()  # the dkv difference is where an empty full range sits, nothing else

  # skip_pad_tokens=False: the same full ranges; the visited ranges grow to every block that
  # holds padding, from every row (kvax instead lets padding attend padding).
  loose = create_attention_mask(*args, FWD, BWD, True, False)
  for view, strict, what in zip(loose, mask, ("fwd", "dq", "dkv")):
    assert (np.asarray(view.lower_bounds) <= np.asarray(strict.lower_bounds)).all(), what
    assert (np.asarray(view.upper_bounds) >= np.asarray(strict.upper_bounds)).all(), what
    full = np.asarray(strict.upper_full_bounds) > np.asarray(strict.lower_full_bounds)
    for field in ("lower_full_bounds", "upper_full_bounds"):
      np.testing.assert_array_equal(np.asarray(getattr(view, field))[full],
                                    np.asarray(getattr(strict, field))[full], err_msg=what)
  padded_rows = (seg == kvax_plugin.PADDING_SEGMENT_ID).any(axis=1)
  np.testing.assert_array_equal(np.asarray(loose[0].upper_bounds)[padded_rows, 0], S // 32)


@pytest.mark.parametrize("name", ["one_doc_padded", "three_docs_padded", "twelve_docs_padded"])
def test_context_parallel_tables_in_kvax_terms(name):
  """kvax's suite under context parallelism: query positions / segment ids permuted, kv ones in
  natural order, one mask for the mesh. Our sharded views are [B, cp * n_local]; split into
  [B, cp, n_local] they are kvax's per-shard tables."""
  cp = 4
  if len(jax.devices()) < cp:
    pytest.skip("needs 4 devices (tests/conftest.py sets XLA_FLAGS for 8 CPU devices)")
  mesh = Mesh(np.array(jax.devices()[:cp]).reshape(1, cp), ("data", "context"))
  pos, seg = _inputs(name)
  with attention_specs(("data", "context", None, None), ("data", None, None, None)):
    q_pos, q_seg = permute_tokens_context_parallelism((jnp.asarray(pos), jnp.asarray(seg)),
                                                      mesh=mesh)
    mask = create_attention_mask(q_pos, q_seg, jnp.asarray(pos), jnp.asarray(seg), FWD, BWD,
                                 True, True, mesh)
  q_pos, q_seg = np.asarray(q_pos), np.asarray(q_seg)
  assert not np.array_equal(q_pos, pos)  # the query side really is in another order
  keep = layouts.dense_mask_np(q_pos, q_seg, pos, seg, causal=True)  # rows: permuted queries
  _assert_view(mask[0], _bounds(keep, 32, 32), "fwd")
  _assert_view(mask[1], _bounds(keep, 16, 32), "dq")
  local = S // cp
  per_shard = [_bounds(keep[:, i * local:(i + 1) * local].transpose(0, 2, 1), 32, 16)
               for i in range(cp)]
  dkv = tuple(np.concatenate([shard[f] for shard in per_shard], axis=1) for f in range(4))
  assert mask[2].lower_bounds.shape == (2, cp * (S // 32))  # kvax: (2, cp, S // 32)
  _assert_view(mask[2], dkv, "dkv")
