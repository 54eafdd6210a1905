"""Block tables against a block classification derived from the dense token mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import layouts
from kvax_plugin import FlashAttentionParamsConfig, create_attention_mask, mask_sparsity
from kvax_plugin.attention.block_mask import table_to_grid


def _block_classes(keep: np.ndarray, bq: int, bk: int):
  """(any, all) bool [B, nq, nk] from a dense mask; tail positions count as not kept."""
  b, sq, skv = keep.shape
  nq, nk = -(-sq // bq), -(-skv // bk)
  padded = np.zeros((b, nq * bq, nk * bk), bool)
  padded[:, :sq, :skv] = keep
  blocks = padded.reshape(b, nq, bq, nk, bk)
  return blocks.any(axis=(2, 4)), blocks.all(axis=(2, 4))


def _check_table(grid: np.ndarray, any_: np.ndarray, all_: np.ndarray, tight: bool):
  """grid [B, n_outer, n_inner] in {0 skip, 1 masked, 2 full} vs the dense classification."""
  visited = grid > 0
  full = grid == 2
  missed = any_ & ~visited
  assert not missed.any(), f"{missed.sum()} blocks with kept pairs are skipped"
  wrong_full = full & ~all_
  assert not wrong_full.any(), f"{wrong_full.sum()} blocks marked full are not fully kept"
  if tight:
    # Contiguous documents with increasing positions: the range is exactly the kept blocks' span
    # and every fully kept block is marked full.
    idx = np.arange(any_.shape[-1])
    first = np.where(any_.any(-1), np.where(any_, idx, 1 << 30).min(-1), 0)
    last = np.where(any_.any(-1), np.where(any_, idx, -1).max(-1) + 1, 0)
    vis_first = np.where(visited.any(-1), np.where(visited, idx, 1 << 30).min(-1), 0)
    vis_last = np.where(visited.any(-1), np.where(visited, idx, -1).max(-1) + 1, 0)
    np.testing.assert_array_equal(vis_first, first)
    np.testing.assert_array_equal(vis_last, last)
    np.testing.assert_array_equal(full, all_)


def _check_mask(qpos, qseg, kpos, kseg, *, causal, window, fwd, bwd, tight):
  mask = create_attention_mask(jnp.asarray(qpos), jnp.asarray(qseg), jnp.asarray(kpos),
                               jnp.asarray(kseg), fwd_params=fwd, bwd_params=bwd,
                               calc_bwd_mask=True, causal=causal, sliding_window=window)
  keep = layouts.dense_mask_np(qpos, qseg, kpos, kseg, causal, window)
  any_f, all_f = _block_classes(keep, fwd.query_block_size, fwd.kv_block_size)
  _check_table(table_to_grid(mask.fwd, any_f.shape[2]), any_f, all_f, tight)
  any_b, all_b = _block_classes(keep, bwd.query_block_size, bwd.kv_block_size)
  _check_table(table_to_grid(mask.dq, any_b.shape[2]), any_b, all_b, tight)
  any_t, all_t = any_b.transpose(0, 2, 1), all_b.transpose(0, 2, 1)
  _check_table(table_to_grid(mask.dkv, any_t.shape[2]), any_t, all_t, tight)
  return mask


P = FlashAttentionParamsConfig


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal,window", [(True, None), (True, 50), (False, None), (False, 33)])
def test_packed_documents_tight(seed, causal, window):
  rng = np.random.default_rng(seed)
  length = int(rng.choice([129, 448, 513]))  # few shapes: each new one compiles
  pad = int(rng.integers(0, length // 3))
  pos, seg = layouts.packed_documents(rng, 3, length, num_docs=int(rng.integers(1, 12)),
                                      pad_tail=pad, one_token_docs=int(rng.integers(0, 3)),
                                      huge_ids=seed % 2 == 1)
  _check_mask(pos, seg, pos, seg, causal=causal, window=window, fwd=P(32, 64), bwd=P(16, 32),
              tight=True)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal,window", [(True, None), (True, 70), (False, None)])
def test_non_contiguous_documents_exact(seed, causal, window):
  rng = np.random.default_rng(100 + seed)
  pos, seg = layouts.non_contiguous_documents(rng, 2, int(rng.choice([300, 513])), num_docs=4,
                                              chunk=int(rng.integers(1, 50)))
  _check_mask(pos, seg, pos, seg, causal=causal, window=window, fwd=P(32, 32), bwd=P(16, 64),
              tight=False)


@pytest.mark.parametrize("seed", range(4))
def test_random_positions_exact(seed):
  rng = np.random.default_rng(200 + seed)
  pos, seg = layouts.random_positions(rng, 2, 257, num_docs=2)
  _check_mask(pos, seg, pos, seg, causal=True, window=None, fwd=P(16, 16), bwd=P(16, 32),
              tight=False)
  # Two ids and arbitrary positions: some blocks are still fully kept in non-causal mode.
  seg1 = np.where(seg >= 0, 5, seg).astype(np.int32)
  seg1[:, :64] = 5
  mask = _check_mask(pos, seg1, pos, seg1, causal=False, window=None, fwd=P(16, 16),
                     bwd=P(16, 16), tight=False)
  assert int(jnp.sum(mask.fwd.full_upper - mask.fwd.full_lower)) > 0


@pytest.mark.parametrize("sq,skv", [(1, 300), (77, 513), (513, 77), (130, 130)])
def test_query_and_kv_lengths_differ(sq, skv):
  """Decode / prefill shapes: the query is the tail of the kv sequence (positions continue)."""
  rng = np.random.default_rng(sq * 1000 + skv)
  kpos, kseg = layouts.packed_documents(rng, 2, skv, num_docs=3, pad_tail=min(5, skv // 4))
  qpos = (kpos.max(axis=1, keepdims=True) + np.arange(sq)[None]).astype(np.int32)
  qseg = np.repeat(kseg[:, :1], sq, axis=1)
  # Also a padding row inside the query.
  qseg[:, -1] = -1
  _check_mask(qpos, qseg, kpos, kseg, causal=True, window=None, fwd=P(32, 64), bwd=P(16, 16),
              tight=True)


def test_all_padding_rows_visit_nothing():
  pos = np.zeros((2, 100), np.int32)
  seg = np.full((2, 100), -1, np.int32)
  seg[1, :10] = 4
  pos[1, :10] = np.arange(10)
  mask = create_attention_mask(jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos),
                               jnp.asarray(seg), fwd_params=P(16, 16))
  grid = table_to_grid(mask.fwd, 7)
  assert not grid[0].any()
  assert grid[1, 0, 0] == 1 and grid[1].sum() == 1
  with_pad = create_attention_mask(jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos),
                                   jnp.asarray(seg), fwd_params=P(16, 16), skip_pad_tokens=False)
  assert table_to_grid(with_pad.fwd, 7)[0].sum() > 0  # compatibility mode visits padding blocks


def test_single_causal_document_sparsity():
  s = 1024
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  seg = jnp.zeros((1, s), jnp.int32)
  mask = create_attention_mask(pos, seg, pos, seg, fwd_params=P(128, 128))
  stats = mask_sparsity(mask)
  n = s // 128
  assert stats["visited"] == pytest.approx((n * (n + 1) / 2) / n**2)
  assert stats["full"] == pytest.approx((n * (n - 1) / 2) / n**2)


def test_mask_is_pytree_through_jit_scan_checkpoint():
  rng = np.random.default_rng(0)
  pos, seg = layouts.packed_documents(rng, 2, 256, num_docs=3, pad_tail=20)
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)

  @jax.jit
  def build(pos, seg):
    return create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)

  mask = build(pos, seg)
  eager = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  for a, b in zip(jax.tree.leaves(mask), jax.tree.leaves(eager)):
    np.testing.assert_array_equal(a, b)

  def layer(carry, _):
    m = carry
    return m, jnp.sum(m.fwd.upper)

  _, sums = jax.lax.scan(jax.checkpoint(layer), mask, None, length=3)
  assert sums.shape == (3,) and int(sums[0]) == int(jnp.sum(eager.fwd.upper))
  assert mask.spec == eager.spec and hash(mask.spec) == hash(eager.spec)


def test_mask_memory_is_linear_in_length():
  """The tables are O(B * S / block) and building them never materialises S x S."""
  s = 32768
  pos = jnp.zeros((1, s), jnp.int32)
  seg = jnp.zeros((1, s), jnp.int32)
  fn = jax.jit(lambda p, g: create_attention_mask(p, g, p, g, calc_bwd_mask=True))
  compiled = fn.lower(pos, seg).compile()
  mem = compiled.memory_analysis()
  used = mem.temp_size_in_bytes + mem.output_size_in_bytes
  assert used < 64 * 2**20, f"mask build uses {used / 2**20:.1f} MiB at S={s}"
  mask = fn(pos, seg)
  assert sum(x.size for x in jax.tree.leaves(mask)) <= 4 * (s // 128 + 2 * (s // 64) + s // 128)
