"""Token orders for context parallelism (kvax_plugin.attention.token_order).

The orders are exact permutations with exact inverses; the balanced one moves whole blocks,
keeps each rank's blocks ascending, and meets the balance targets (max / min over ranks within
1.05 for kept pairs and 1.10 for visited blocks at cp 2, 4 and 8, never worse than the better of
natural and Llama 3) measured on the real per-rank block tables; its cost model agrees with the
dense mask and with the block tables; attention is exact in any order.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvax_plugin.attention import block_mask as bm
from kvax_plugin.attention import token_order as to
from kvax_plugin.attention.api import create_attention_mask, flash_attention
from kvax_plugin.attention.context_parallel import context_parallel_balance
from kvax_plugin.attention.params import FlashAttentionParamsConfig

from layouts import dense_mask_np, non_contiguous_documents, packed_documents, random_positions

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from cp_layouts import balance_layouts  # noqa: E402

INT32_MAX = np.iinfo(np.int32).max
INT32_MIN = np.iinfo(np.int32).min


def _layouts(rng, batch, length):
  """Awkward layouts by name: packed with padding, huge ids, non-contiguous, arbitrary."""
  return {
      "packed": packed_documents(rng, batch, length, num_docs=7, pad_tail=length // 7,
                                 one_token_docs=2),
      "huge_ids": packed_documents(rng, batch, length, num_docs=4, huge_ids=True),
      "non_contiguous": non_contiguous_documents(rng, batch, length, num_docs=3, chunk=24),
      "arbitrary": random_positions(rng, batch, length, num_docs=3),
  }


# ----------------------------------------------------------------------------- permutations


@pytest.mark.parametrize("order", to.ORDERS)
@pytest.mark.parametrize("cp", [1, 4])
def test_orders_are_permutations_with_exact_inverses(order, cp):
  rng = np.random.default_rng(cp)
  pos, seg = packed_documents(rng, 3, 256, num_docs=5, pad_tail=40)
  tok = to.token_order(pos, seg, cp, order=order, block=16)
  o, inv = np.asarray(tok.order), np.asarray(tok.inverse)
  assert o.shape == inv.shape == (3, 256) and o.dtype == inv.dtype == np.int32
  for b in range(3):
    np.testing.assert_array_equal(np.sort(o[b]), np.arange(256))
    np.testing.assert_array_equal(o[b][inv[b]], np.arange(256))
  # Round trip on activations of every rank (batch first, sequence on axis 1 or 2).
  x = rng.standard_normal((3, 256, 2, 4)).astype(np.float32)
  y = to.apply_token_order((x, {"ids": seg}), tok)
  back = to.undo_token_order(y, tok)
  np.testing.assert_array_equal(np.asarray(back[0]), x)
  np.testing.assert_array_equal(np.asarray(back[1]["ids"]), seg)
  np.testing.assert_array_equal(np.asarray(y[0])[1, :, 1, 2], x[1, o[1], 1, 2])
  xt = np.swapaxes(x, 1, 2)  # [B, H, S, D]: sequence on axis 2
  np.testing.assert_array_equal(np.asarray(to.apply_token_order(xt, tok, axis=2)),
                                np.swapaxes(np.asarray(y[0]), 1, 2))


def test_fixed_orders():
  tok = to.llama3_order(1, 16, 2)  # chunks of 4: rank 0 holds chunks 0 and 3, rank 1 1 and 2
  np.testing.assert_array_equal(np.asarray(tok.order)[0],
                                [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  nat = to.natural_order(2, 8)
  np.testing.assert_array_equal(np.asarray(nat.order), np.tile(np.arange(8), (2, 1)))
  np.testing.assert_array_equal(np.asarray(nat.inverse), np.tile(np.arange(8), (2, 1)))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_moves_whole_blocks_ascending_per_rank(cp):
  rng = np.random.default_rng(7)
  s, block = 512, 16
  pos, seg = packed_documents(rng, 2, s, num_docs=6, pad_tail=50)
  o = np.asarray(to.balanced_order(pos, seg, cp, block=block).order)
  per_rank = s // cp
  for b in range(2):
    units = o[b].reshape(-1, block)
    # Whole natural blocks, each in its natural token order.
    np.testing.assert_array_equal(units % block, np.tile(np.arange(block), (len(units), 1)))
    np.testing.assert_array_equal(units[:, 0] % block, 0)
    starts = o[b, ::block].reshape(cp, per_rank // block)  # every rank: equal shares of blocks
    assert np.all(np.diff(starts, axis=1) > 0), "each rank's blocks must stay in natural order"


def test_balanced_rows_are_independent_and_deterministic():
  pos0, seg0 = balance_layouts(512)["two docs 3/4 + 1/4"]
  pos1, seg1 = balance_layouts(512)["long + many short"]
  pos, seg = np.concatenate([pos0, pos1]), np.concatenate([seg0, seg1])
  both = np.asarray(to.balanced_order(pos, seg, 4, block=16).order)
  for row, (p, g) in enumerate(((pos0, seg0), (pos1, seg1))):
    np.testing.assert_array_equal(both[row], np.asarray(to.balanced_order(
        np.concatenate([p, p]), np.concatenate([g, g]), 4, block=16).order)[0])
  np.testing.assert_array_equal(both, np.asarray(to.balanced_order(pos, seg, 4, block=16).order))
  assert not np.array_equal(both[0], both[1])


def test_balanced_under_jit_with_traced_inputs():
  rng = np.random.default_rng(4)
  pos, seg = packed_documents(rng, 2, 512, num_docs=6, pad_tail=50)
  eager = to.token_order(pos, seg, 4, order="balanced", block=16)
  jitted = jax.jit(lambda p, s: to.token_order(p, s, 4, order="balanced", block=16))(
      jnp.asarray(pos), jnp.asarray(seg))
  np.testing.assert_array_equal(np.asarray(jitted.order), np.asarray(eager.order))
  np.testing.assert_array_equal(np.asarray(jitted.inverse), np.asarray(eager.inverse))


# ----------------------------------------------------------------------------- cost model


@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (False, None), (False, 9)])
def test_kept_pairs_per_token_match_the_dense_mask(causal, window):
  rng = np.random.default_rng(3)
  for name, (pos, seg) in _layouts(rng, 2, 192).items():
    got = np.asarray(to.kept_pairs_per_token(pos, seg, causal=causal, sliding_window=window))
    want = dense_mask_np(pos, seg, pos, seg, causal=causal, window=window).sum(-1)
    np.testing.assert_array_equal(got, want, err_msg=name)


def test_kept_pairs_at_int32_extremes():
  # Positions at both ends of int32 (window arithmetic must saturate) and repeated positions.
  pos = np.array([[INT32_MIN, INT32_MIN + 1, 0, 0, 5, INT32_MAX - 1, INT32_MAX, INT32_MAX]],
                 np.int32)
  seg = np.array([[1, 1, 1, 1, 1, 1, 1, -1]], np.int32)
  for causal in (True, False):
    for window in (None, 1, 3, INT32_MAX):
      got = np.asarray(to.kept_pairs_per_token(pos, seg, causal=causal, sliding_window=window))
      want = dense_mask_np(pos, seg, pos, seg, causal=causal, window=window).sum(-1)
      np.testing.assert_array_equal(got, want, err_msg=f"causal={causal} window={window}")


@pytest.mark.parametrize("window", [None, 40])
def test_unit_costs_match_the_block_tables(window):
  # Contiguous documents with increasing positions: visited blocks are exact, per query block.
  rng = np.random.default_rng(11)
  pos, seg = packed_documents(rng, 2, 512, num_docs=9, pad_tail=70, one_token_docs=2)
  kept, visited = to.unit_costs(pos, seg, block=32, kv_block=16, sliding_window=window)
  params = FlashAttentionParamsConfig(query_block_size=32, kv_block_size=16)
  m = bm.create_attention_mask(jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos),
                               jnp.asarray(seg), fwd_params=params, sliding_window=window)
  np.testing.assert_array_equal(np.asarray(visited), np.asarray(m.fwd.upper - m.fwd.lower))
  dense = dense_mask_np(pos, seg, pos, seg, window=window).sum(-1).reshape(2, -1, 32).sum(-1)
  np.testing.assert_array_equal(np.asarray(kept), dense)


# ----------------------------------------------------------------------------- balance targets

BALANCE_S, BALANCE_BLOCK = 4096, 32  # 16 blocks per rank at cp 8
BALANCE_PARAMS = FlashAttentionParamsConfig(query_block_size=BALANCE_BLOCK,
                                            kv_block_size=BALANCE_BLOCK)


@pytest.fixture(scope="module")
def balance_rows():
  rows = {}
  for name, (pos, seg) in balance_layouts(BALANCE_S).items():
    for cp in (2, 4, 8):
      rows[name, cp] = {o: context_parallel_balance(pos, seg, cp, order=o,
                                                   fwd_params=BALANCE_PARAMS)
                        for o in to.ORDERS}
  return rows


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_meets_targets_on_every_layout(balance_rows, cp):
  for name in balance_layouts(64):
    r = balance_rows[name, cp]
    bal = r["balanced"]
    assert bal["kept_max_over_min"] <= 1.05, (name, cp, bal)
    assert bal["visited_max_over_min"] <= 1.10, (name, cp, bal)
    # Never worse than the better fixed order (worst of the two ratios).
    worst = lambda x: max(x["kept_max_over_min"], x["visited_max_over_min"])
    assert worst(bal) <= min(worst(r["natural"]), worst(r["llama3"])) + 1e-6, (name, cp, r)
    # Equal work in total: every order keeps the same pairs.
    assert sum(bal["kept_pairs"]) == sum(r["natural"]["kept_pairs"]) == sum(
        r["llama3"]["kept_pairs"])


def test_fixed_orders_show_the_imbalance_the_issue_measured(balance_rows):
  # The reasons for the balanced order (issue 16): Llama 3 is 4x off on 3/4 + 1/4 at every cp,
  # natural ~2*cp-1 on one document.
  for cp in (2, 4, 8):
    assert balance_rows["two docs 3/4 + 1/4", cp]["llama3"]["kept_max_over_min"] == pytest.approx(
        4.0, rel=0.02)
    assert balance_rows["one document", cp]["natural"]["kept_max_over_min"] == pytest.approx(
        2 * cp - 1, rel=0.02)
    assert balance_rows["one document", cp]["llama3"]["kept_max_over_min"] == pytest.approx(
        1.0, abs=1e-3)


# ----------------------------------------------------------------------------- the op


def test_attention_is_exact_in_any_order():
  """Permuted inputs give the permuted outputs and gradients (JAX backend, float32)."""
  window = 48
  rng = np.random.default_rng(5)
  b, s, h, k, d = 2, 256, 2, 1, 16
  pos, seg = packed_documents(rng, b, s, num_docs=5, pad_tail=30, one_token_docs=1)
  q = rng.standard_normal((b, s, h, d)).astype(np.float32)
  kv = rng.standard_normal((2, b, s, k, d)).astype(np.float32)
  w = rng.standard_normal((b, s, h, d)).astype(np.float32)
  fwd = FlashAttentionParamsConfig(query_block_size=32, kv_block_size=16)
  bwd = FlashAttentionParamsConfig(query_block_size=16, kv_block_size=32)

  def run(q, key, value, w, pos, seg):
    mask = create_attention_mask(pos, seg, pos, seg, fwd_params=fwd, bwd_params=bwd,
                                 calc_bwd_mask=True, sliding_window=window)

    def loss(q, key, value):
      out = flash_attention(q, key, value, pos, seg, pos, seg, mask, scale=0.25, backend="jax")
      return jnp.sum(out * w), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, key, value)
    return (out, *grads)

  run = jax.jit(run)
  natural = run(q, kv[0], kv[1], w, jnp.asarray(pos), jnp.asarray(seg))
  tok = to.token_order(pos, seg, 4, order="balanced", block=32, sliding_window=window)
  permuted = run(*to.apply_token_order((q, kv[0], kv[1], w, pos, seg), tok))
  assert float(jnp.max(jnp.abs(natural[0]))) > 0.1  # not trivially zero
  assert not np.array_equal(np.asarray(tok.order), np.asarray(to.natural_order(b, s).order))
  for name, got, want in zip(("out", "dq", "dk", "dv"), to.undo_token_order(permuted, tok),
                             natural):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5,
                               err_msg=name)


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
  pos = np.zeros((1, 96), np.int32)
  with pytest.raises(ValueError, match="order must be one of"):
    to.token_order(pos, pos, 2, order="striped")
  with pytest.raises(ValueError, match=r"multiple of cp \* block = 2 \* 64"):
    to.balanced_order(pos, pos, 2, block=64)
  with pytest.raises(ValueError, match="cp must be a positive int"):
    to.balanced_order(pos, pos, 0, block=16)
  with pytest.raises(ValueError, match="block must be a positive int"):
    to.balanced_order(pos, pos, 2, block=0)
  with pytest.raises(ValueError, match="sliding_window must be a positive int"):
    to.balanced_order(pos, pos, 2, block=16, sliding_window=0)
  with pytest.raises(ValueError, match="must have the same shape"):
    to.balanced_order(pos, pos[:, :48], 2, block=16)
  with pytest.raises(TypeError, match="segment_ids must hold integers"):
    to.balanced_order(pos, pos.astype(np.float32), 2, block=16)
  with pytest.raises(ValueError, match="multiple of 2 \\* cp = 8 for the llama3 order"):
    to.token_order(np.zeros((1, 12), np.int32), np.zeros((1, 12), np.int32), 4, order="llama3")
  tok = to.natural_order(1, 96)
  with pytest.raises(ValueError, match="does not match the order"):
    to.apply_token_order(np.zeros((1, 95, 2)), tok)
  with pytest.raises(ValueError, match="must name a sequence axis after the batch axis"):
    to.apply_token_order(np.zeros((1, 96)), tok, axis=0)


def test_orders_apply_to_arrays_sharded_under_an_explicit_mesh():
  # jax.set_mesh: the gather of a sharded array must name its output sharding (it did not, and
  # raised ShardingTypeError); the result keeps the input's sharding and is exact.
  from jax.sharding import PartitionSpec as P
  if jax.device_count() < 8:
    pytest.fail("tests/conftest.py simulates 8 CPU devices")
  b, s = 2, 512
  seg = np.repeat(np.arange(4, dtype=np.int32), s // 4)[None].repeat(b, 0)
  pos = np.tile(np.arange(s // 4, dtype=np.int32), 4)[None].repeat(b, 0)
  x = np.random.default_rng(0).standard_normal((b, s, 3, 4)).astype(np.float32)
  tok = to.token_order(jnp.asarray(pos), jnp.asarray(seg), cp=4, order="balanced")
  mesh = jax.make_mesh((2, 4), ("fsdp", "context"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P("fsdp", "context", None, None))
    permuted = to.apply_token_order(xs, tok)
    back = to.undo_token_order(permuted, tok)
    assert jax.typeof(permuted).sharding.spec == P("fsdp", "context", None, None)
  expected = np.take_along_axis(x, np.asarray(tok.order)[:, :, None, None], axis=1)
  np.testing.assert_array_equal(np.asarray(permuted), expected)
  np.testing.assert_array_equal(np.asarray(back), x)
