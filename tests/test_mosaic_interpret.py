"""The Mosaic GPU (Hopper) kernels on the CPU: Pallas' Mosaic GPU interpreter runs them with
simulated shared memory, TMA copies, barriers and warpgroups (and checks that every barrier
phase is observed), so their logic - table walking, masking, online softmax, the producer /
consumer ring, both backward modes - is tested here against the float32 reference. A second
test lowers them for CUDA (no GPU needed), which catches what Mosaic GPU cannot compile.
The GPU runs of the same kernels are tests/gpu/test_mosaic_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvax_plugin.attention.block_mask import create_attention_mask
from kvax_plugin.attention.kernels.mosaic import backend as mosaic
from kvax_plugin.attention.reference import reference_attention

import layouts


def _rel(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def _segments(segs):
  seg = np.asarray(segs, np.int32)
  pos = np.zeros_like(seg)
  for s in np.unique(seg):
    pos[seg == s] = np.arange((seg == s).sum())
  return jnp.asarray(pos)[None], jnp.asarray(seg)[None]


CASES = {
    # documents (one of one token), padding, GQA 4/2, fused-dq backward with the column-split
    # dq partials (head dim 128; the whole-partial path runs in prefill_mla, head dim 192)
    "docs_padding_gqa": dict(segs=[3] * 100 + [0] + [9] * 100 + [2] * 50 + [-1] * 5, h=4, kh=2,
                             dk=128),
    # window + soft cap + sinks, MQA, non-contiguous documents with huge ids, deterministic dq
    "window_cap_sinks_det": dict(segs=([5] * 64 + [2**30] * 64) * 2, h=4, kh=1, window=40,
                                 cap=20.0, sinks=True, det=True),
    # a sliding window over one long document: query tiles whose row has a masked run BEFORE its
    # full blocks (the window's edge) and one after (the diagonal), walked in the kernels'
    # visit order (masked runs first, then full); deterministic and fused backward
    "window_masked_full_masked_det": dict(segs=[7] * 640, h=2, kh=1, window=300, det=True),
    "window_masked_full_masked_fused": dict(segs=[7] * 640, h=2, kh=1, window=300),
    # Sq != Skv (queries are the last tokens), MLA-style head dims 192 / 128
    "prefill_mla": dict(segs=[0] * 384, sq=128, h=2, kh=2, dk=192, dv=128),
    # backward tables of 64-query blocks (kvax 0.1.0's Hopper default, bwd 64 x 128): the dq
    # kernel's 128-row tiles walk the union of two table rows (zero / NaN dq before 2026-11-26)
    "bwd_q64_docs_det": dict(segs=[4] * 70 + [8] * 1 + [6] * 120 + [-1] * 65, h=2, kh=1,
                             det=True, bwd=(64, 128)),
    "bwd_q64_causal_fused": dict(segs=[1] * 256, h=2, kh=2, bwd=(64, 128)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_in_interpreter_match_reference(name):
  c = dict(CASES[name])
  kv_pos, kv_seg = _segments(c["segs"])
  skv = kv_seg.shape[1]
  sq = c.get("sq", skv)
  q_pos, q_seg = kv_pos[:, skv - sq:], kv_seg[:, skv - sq:]
  h, kh, dk, dv = c["h"], c["kh"], c.get("dk", 64), c.get("dv", c.get("dk", 64))
  keys = jax.random.split(jax.random.PRNGKey(sum(map(ord, name))), 5)
  q = jax.random.normal(keys[0], (1, sq, h, dk), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, skv, kh, dk), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, skv, kh, dv), jnp.bfloat16)
  cot = jax.random.normal(keys[3], (1, sq, h, dv), jnp.float32)
  sinks = jax.random.normal(keys[4], (h,), jnp.float32) if c.get("sinks") else None
  window, cap = c.get("window"), c.get("cap")
  from kvax_plugin.attention.params import FlashAttentionParamsConfig
  bwd = FlashAttentionParamsConfig(*c["bwd"]) if "bwd" in c else None
  mask = create_attention_mask(q_pos, q_seg, kv_pos, kv_seg, calc_bwd_mask=True,
                               sliding_window=window, bwd_params=bwd)
  if "masked_full_masked" in name:  # the case is about rows with both masked runs
    for table in (mask.fwd, mask.dq, mask.dkv):
      lo, up, flo, fup = (np.asarray(x) for x in (table.lower, table.upper, table.full_lower,
                                                  table.full_upper))
      assert ((lo < flo) & (flo < fup) & (fup < up)).any(), table

  def ours(q, k, v, s):
    return mosaic.flash_attention_mosaic(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask,
                                         scale=dk ** -0.5, logits_soft_cap=cap, sinks=s,
                                         deterministic_backward=c.get("det", False),
                                         interpret=True)

  def ref(q, k, v, s):
    f32 = lambda x: x.astype(jnp.float32)
    return reference_attention(f32(q), f32(k), f32(v), q_pos, q_seg, kv_pos, kv_seg,
                               sliding_window=window, scale=dk ** -0.5, logits_soft_cap=cap,
                               sinks=s)

  def all_grads(fn):
    # One forward (the interpreter is slow): output and the vjp of every input at once.
    if sinks is None:
      out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None), q, k, v)
    else:
      out, vjp = jax.vjp(fn, q, k, v, sinks)
    return (out,) + vjp(cot.astype(out.dtype))

  mine, theirs = all_grads(ours), all_grads(ref)
  errs = [_rel(a, b) for a, b in zip(mine, theirs)]
  assert all(bool(jnp.all(jnp.isfinite(jnp.asarray(a, jnp.float32)))) for a in mine)
  assert max(errs) < 1.5e-2, errs  # bf16 inputs; P and dS rounded to bf16 (~3e-3 seen)
  pad = np.asarray(q_seg) == -1
  if pad.any():
    assert float(jnp.max(jnp.abs(mine[0].astype(jnp.float32)[pad]))) == 0.0
    assert float(jnp.max(jnp.abs(mine[1].astype(jnp.float32)[pad]))) == 0.0


@pytest.mark.parametrize("dims,det", [((128, 128), False), ((128, 128), True), ((256, 256), False),
                                      ((96, 96), False)])
def test_kernels_lower_for_cuda(dims, det, cap=30.0):
  """Forward + backward lower to Mosaic GPU's CUDA module (shared memory fits, every op has a
  GPU lowering) for the head dims the backend claims; no GPU is needed to lower."""
  s_len, h, kh = 512, 4, 2
  dk, dv = dims
  pos, seg = layouts.packed_documents(np.random.default_rng(0), 1, s_len, num_docs=3,
                                      pad_tail=9)
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)
  q = jnp.zeros((1, s_len, h, dk), jnp.bfloat16)
  k = jnp.zeros((1, s_len, kh, dk), jnp.bfloat16)
  v = jnp.zeros((1, s_len, kh, dv), jnp.bfloat16)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)

  def fwd_bwd(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: mosaic.flash_attention_mosaic(
        q, k, v, pos, seg, pos, seg, mask, scale=0.1, logits_soft_cap=cap, sinks=None,
        deterministic_backward=det), q, k, v)
    return out, vjp(out)

  text = jax.jit(fwd_bwd).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("env", [{"KVAX_MOSAIC_FWD_OPT_BARRIER": "1"},
                                 {"KVAX_MOSAIC_FWD_PREWAIT": "0"},
                                 {"KVAX_MOSAIC_DQ_AFTER_DKV": "1"},
                                 {"KVAX_MOSAIC_FWD_IDS_TMA": "1"},
                                 {"KVAX_MOSAIC_BWD_IDS_TMA": "1"},
                                 {"KVAX_MOSAIC_LPT": "1"},
                                 {"KVAX_MOSAIC_EXIT_AFTER_READ": "0"}])
def test_scheduling_hooks_match_reference_in_interpreter(env, monkeypatch):
  """The kernels' scheduling hooks (optimization barrier after the softmax; the next K awaited
  at the top of a step instead of behind the P V product, the default since session 7; the
  deterministic backward kernels awaiting their next ring slot behind a step's last product)
  compute the same attention: interpreter against the float32 reference (documents, padding,
  GQA, every barrier phase waited once), and lowered for CUDA."""
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  test_kernels_in_interpreter_match_reference("window_cap_sinks_det")
  test_kernels_lower_for_cuda((128, 128), True)


def test_longest_first_launch_order(monkeypatch):
  """KVAX_MOSAIC_LPT=1: every kernel takes its tile from forward.longest_first (a permutation,
  descending visited blocks, ties in tile order); the fused backward with documents, a one-token
  document and padding still matches the reference in the interpreter."""
  from kvax_plugin.attention.kernels.mosaic import forward as fw
  lower = jnp.array([[0, 0, 2, 2, 0]], jnp.int32)
  upper = jnp.array([[1, 2, 3, 5, 0]], jnp.int32)
  assert fw.longest_first(lower, upper, 1, 5).tolist() == [[3, 1, 0, 2, 4]]
  assert fw.longest_first(lower, upper, 2, 9).tolist() == [[6, 7, 2, 3, 0, 1, 4, 5, 8]]
  monkeypatch.setenv("KVAX_MOSAIC_LPT", "1")
  test_kernels_in_interpreter_match_reference("docs_padding_gqa")


# HEAD_LPT=1 is the default since session 15, so the interpreter run of window_cap_sinks_det and
# window_masked_full_masked_fused here was the same kernel configuration on the same inputs as
# test_kernels_in_interpreter_match_reference[<case>]: one case (documents, padding, GQA, both
# backward kernels) checks the setting reaches them; lowering checks it too
# (test_backward_launch_order_settings).
@pytest.mark.parametrize("case", ["docs_padding_gqa"])
def test_launch_order_over_heads(case, monkeypatch):
  """KVAX_MOSAIC_HEAD_LPT=1 (BwdConfig.head_lpt): the backward kernels map their launch position
  (head * n_tiles + tile) to the (head, tile) of forward.longest_first_over_heads: a permutation
  of all pairs, longest tile first, the heads of one tile together. Both backward kernels still
  match the float32 reference in the interpreter with documents, padding and GQA (the dk/dv
  kernel's heads are kv heads, the dq kernel's query heads), and lower for CUDA. The kernels
  must really get the setting."""
  from kvax_plugin.attention.kernels.mosaic import backward as bk
  from kvax_plugin.attention.kernels.mosaic import forward as fw
  lower = jnp.array([[0, 0, 2, 2, 0]], jnp.int32)
  upper = jnp.array([[1, 2, 3, 5, 0]], jnp.int32)
  # works per tile 1, 2, 1, 3, 0 (one tile per row); 2 heads: codes tile * 2 + head
  assert fw.longest_first_over_heads(lower, upper, 1, 5, 2).tolist() == [
      [6, 7, 2, 3, 0, 1, 4, 5, 8, 9]]
  order = fw.longest_first_over_heads(lower, upper, 2, 9, 3)
  assert sorted(order[0].tolist()) == list(range(27))  # every (head, tile) once
  monkeypatch.setenv("KVAX_MOSAIC_HEAD_LPT", "1")
  # documents + padding + GQA with the deterministic dq kernel (the case's default is fused)
  monkeypatch.setitem(CASES, "docs_padding_gqa", dict(CASES["docs_padding_gqa"], det=True))
  det = CASES[case].get("det", False)
  seen = []
  real_dkv, real_dq = bk.dkv_call, bk.dq_call
  monkeypatch.setattr(bk, "dkv_call", lambda cfg, *a: (seen.append(("dkv", cfg.head_lpt)),
                                                       real_dkv(cfg, *a))[1])
  monkeypatch.setattr(bk, "dq_call", lambda cfg, *a: (seen.append(("dq", cfg.head_lpt)),
                                                      real_dq(cfg, *a))[1])
  test_kernels_in_interpreter_match_reference(case)
  assert seen and all(on for _, on in seen), seen
  assert (("dq", True) in seen) == det, seen
  test_kernels_lower_for_cuda((128, 128), det)


def test_fold_changes_dkv_rounding_only(monkeypatch):
  """The deterministic dk/dv kernel folds lse / delta into its accumulators (the default), the
  fused one does not: in the interpreter (documents, a one-token document, padding, GQA) the
  forward is bitwise the same, dv is bitwise the same as the fused kernel's without the fold and
  within float32 rounding (then one bf16 rounding) with it; dk and dq differ by rounding in both
  (the interpreter's fused path sums dS K in another order). The GPU test
  test_fused_and_deterministic_backward_agree_and_deterministic_is_reproducible relies on this."""
  c = CASES["docs_padding_gqa"]
  kv_pos, kv_seg = _segments(c["segs"])
  h, kh, d = c["h"], c["kh"], c["dk"]
  s_len = kv_seg.shape[1]
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  q = jax.random.normal(keys[0], (1, s_len, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, s_len, kh, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, s_len, kh, d), jnp.bfloat16)
  cot = jax.random.normal(keys[3], (1, s_len, h, d), jnp.bfloat16)
  mask = create_attention_mask(kv_pos, kv_seg, kv_pos, kv_seg, calc_bwd_mask=True)

  def grads(det, fold):
    monkeypatch.setenv("KVAX_MOSAIC_DKV_FOLD", fold)
    out, vjp = jax.vjp(lambda q, k, v: mosaic.flash_attention_mosaic(
        q, k, v, kv_pos, kv_seg, kv_pos, kv_seg, mask, scale=d ** -0.5, logits_soft_cap=None,
        sinks=None, deterministic_backward=det, interpret=True), q, k, v)
    return (out,) + vjp(cot)

  fused, folded, unfolded = grads(False, "1"), grads(True, "1"), grads(True, "0")
  names = ["out", "dq", "dk", "dv"]
  with_fold = dict(zip(names, (_rel(a, b) for a, b in zip(folded, fused))))
  without = dict(zip(names, (_rel(a, b) for a, b in zip(unfolded, fused))))
  assert with_fold["out"] == 0.0 and without["out"] == 0.0
  assert without["dv"] == 0.0, without
  assert 0.0 < with_fold["dv"] < 2e-4, with_fold  # ~2.5e-5 seen
  assert max(with_fold.values()) < 2e-4 and max(without.values()) < 2e-4, (with_fold, without)


@pytest.mark.parametrize("env,head_lpt,lpt", [({}, True, False),
                                              ({"KVAX_MOSAIC_HEAD_LPT": "0"}, False, False),
                                              ({"KVAX_MOSAIC_LPT": "1"}, False, True)])
def test_backward_launch_order_settings(env, head_lpt, lpt, monkeypatch):
  """The backward's order over (head, tile) pairs is the default; KVAX_MOSAIC_HEAD_LPT=0 gives
  the grid's head-major order, KVAX_MOSAIC_LPT=1 the per-head longest-first order in every
  kernel (it replaces the head order). Both backward kernels must get the setting."""
  from kvax_plugin.attention.kernels.mosaic import backward as bk
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  seen = []
  real_dkv, real_dq = bk.dkv_call, bk.dq_call
  monkeypatch.setattr(bk, "dkv_call", lambda cfg, *a: (seen.append((cfg.head_lpt, cfg.lpt)),
                                                       real_dkv(cfg, *a))[1])
  monkeypatch.setattr(bk, "dq_call", lambda cfg, *a: (seen.append((cfg.head_lpt, cfg.lpt)),
                                                      real_dq(cfg, *a))[1])
  test_kernels_lower_for_cuda((128, 128), True)
  assert seen == [(head_lpt, lpt)] * 2, seen
  with pytest.raises(ValueError, match="KVAX_MOSAIC_HEAD_LPT='2'"):
    monkeypatch.setenv("KVAX_MOSAIC_HEAD_LPT", "2")
    test_kernels_lower_for_cuda((128, 128), True)


# The persistent snake-deal forward (3 CTAs) is the interpreter's default ("auto") at head dims
# 64 / 128, so window_cap_sinks_det and window_masked_full_masked_fused with snake=True ran the
# same kernels as test_kernels_in_interpreter_match_reference[<case>]: they are not repeated here.
# prefill_mla with snake=True stays (auto runs MLA per-tile: the persistent kernel's 64-row kv
# tile and separate O staging run only here).
@pytest.mark.parametrize("case,snake", [("prefill_mla", True),
                                        ("docs_padding_gqa", False), ("prefill_mla", False),
                                        ("odd_rounds_mqa", False)])
def test_persistent_forward_matches_reference(case, snake, monkeypatch):
  """KVAX_MOSAIC_FWD_PERSISTENT=1 (FwdConfig.num_ctas): 3 CTAs in the interpreter, each taking
  several (batch, query tile, head) items with one kv ring across them and Q loaded one item
  ahead; Dv != Dk with Sq != Skv (the separate O staging), documents + padding + GQA, odd
  rounds (soft cap + sinks + MQA and the sliding window run persistent in
  test_kernels_in_interpreter_match_reference, "auto"); against the float32 reference, and
  lowered for CUDA (one CTA per SM). The kernel must really run persistent, with the snake
  deal (the default: longest-first tiles, odd rounds mirrored) or the round robin
  (KVAX_MOSAIC_FWD_SNAKE=0)."""
  from kvax_plugin.attention.kernels.mosaic import forward as fw
  monkeypatch.setenv("KVAX_MOSAIC_FWD_PERSISTENT", "1")
  if not snake:
    monkeypatch.setenv("KVAX_MOSAIC_FWD_SNAKE", "0")
  seen = []
  real = fw.forward_call
  monkeypatch.setattr(fw, "forward_call", lambda cfg, *a: (seen.append(cfg.num_ctas),
                                                           assert_deal(cfg),
                                                           real(cfg, *a))[2])

  def assert_deal(cfg):
    assert (cfg.zigzag, cfg.lpt) == (snake, snake)
  # 2 query tiles x 2 heads = 4 items over 3 CTAs: one full round and a partial one, whose only
  # item belongs to the first CTA in the round robin (to the last under the snake deal, whose
  # second round is mirrored)
  monkeypatch.setitem(CASES, "odd_rounds_mqa", dict(segs=[1] * 130 + [2] * 100 + [-1] * 26,
                                                    h=2, kh=1))
  test_kernels_in_interpreter_match_reference(case)
  assert seen == [3], seen
  test_kernels_lower_for_cuda((128, 128), True)
  assert seen[-1] > 3, seen  # one CTA per SM when lowered for the GPU


# docs_padding_gqa here was the same run as test_kernels_in_interpreter_match_reference
# [docs_padding_gqa] ("auto" is the persistent snake deal there) with the same assertions as
# odd_rounds_mqa, whose odd second round (and deterministic backward) only this test runs.
@pytest.mark.parametrize("case", ["odd_rounds_mqa"])
def test_snake_deal_is_the_persistent_forwards_default(case, monkeypatch):
  """The snake deal (backend.Static.fwd_snake) reaches the persistent forward by default (the
  interpreter runs it persistent with FWD_PERSISTENT=1), against the float32 reference; the
  backward keeps its own order over (head, tile) pairs; the per-tile grid keeps its order;
  a bad value of KVAX_MOSAIC_FWD_SNAKE is an error naming it; the hooks it replaced are refused
  by name."""
  from kvax_plugin.attention.kernels.mosaic import backward as bk
  from kvax_plugin.attention.kernels.mosaic import forward as fw
  monkeypatch.setenv("KVAX_MOSAIC_FWD_PERSISTENT", "1")
  monkeypatch.setitem(CASES, "odd_rounds_mqa", dict(segs=[1] * 130 + [2] * 100 + [-1] * 26,
                                                    h=2, kh=1, det=True))
  seen = []
  real_fwd, real_dkv = fw.forward_call, bk.dkv_call
  monkeypatch.setattr(fw, "forward_call", lambda cfg, *a: (
      seen.append(("fwd", cfg.num_ctas > 0, cfg.lpt, cfg.zigzag)), real_fwd(cfg, *a))[1])
  monkeypatch.setattr(bk, "dkv_call", lambda cfg, *a: (
      seen.append(("dkv", cfg.lpt, cfg.head_lpt)), real_dkv(cfg, *a))[1])
  test_kernels_in_interpreter_match_reference(case)
  assert seen == [("fwd", True, True, True), ("dkv", False, True)], seen
  seen.clear()
  monkeypatch.setenv("KVAX_MOSAIC_FWD_PERSISTENT", "0")
  test_kernels_lower_for_cuda((128, 128), True)
  assert seen[0] == ("fwd", False, False, False), seen
  monkeypatch.setenv("KVAX_MOSAIC_FWD_SNAKE", "yes")
  with pytest.raises(ValueError, match="KVAX_MOSAIC_FWD_SNAKE='yes'"):
    test_kernels_lower_for_cuda((128, 128), True)
  monkeypatch.delenv("KVAX_MOSAIC_FWD_SNAKE")
  for name in ("KVAX_MOSAIC_FWD_ZIGZAG", "KVAX_MOSAIC_FWD_LPT"):
    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match=f"{name}: this benchmarking hook was removed "
                                         r"\(part of the snake deal"):
      test_kernels_lower_for_cuda((128, 128), True)
    monkeypatch.delenv(name)


# prefill_mla here was the same run as test_kernels_in_interpreter_match_reference[prefill_mla]
# ("auto" runs MLA per-tile with 128-row kv blocks) and tests/test_mosaic_races.py's
# test_mla_forward_output_in_q_memory_has_no_race; mla_docs (two query tiles, documents, GQA)
# checks the 128 block reaches the kernel.
@pytest.mark.parametrize("case", ["mla_docs"])
def test_mla_forward_stages_output_in_q_memory(case, monkeypatch):
  """Dv < Dk in the per-tile forward (KVAX_MOSAIC_FWD_PERSISTENT=0): O is staged in a RefUnion
  with Q (forward.o_in_q), both consumers meeting at a barrier after their last Q K^T product,
  which lets MLA (192 / 128) use 128-row kv blocks. Interpreter against the float32 reference
  (two query tiles, documents, GQA) and lowered for CUDA; the kernel must get the 128 block."""
  from kvax_plugin.attention.kernels.mosaic import forward as fw
  monkeypatch.setenv("KVAX_MOSAIC_FWD_PERSISTENT", "0")
  monkeypatch.setitem(CASES, "mla_docs", dict(segs=[4] * 100 + [7] * 130 + [-1] * 26, h=4, kh=2,
                                              dk=192, dv=128))
  seen = []
  real = fw.forward_call
  monkeypatch.setattr(fw, "forward_call", lambda cfg, *a: (seen.append((cfg.num_ctas,
                                                                        cfg.block_kv)),
                                                           real(cfg, *a))[1])
  test_kernels_in_interpreter_match_reference(case)
  assert seen == [(0, 128)], seen
  test_kernels_lower_for_cuda((192, 128), True)
  assert seen[-1] == (0, 128), seen
  assert fw.smem_bytes(128, 2, 192, 128, 2) <= mosaic.SMEM_BUDGET < fw.smem_bytes(
      128, 2, 192, 128, 2, q_buffers=2)


@pytest.mark.parametrize("env,kv_len,dims,persistent", [
    ("", 65536, (64, 64), True), ("", 65536 + 1, (64, 64), False), ("1", 65536 + 1, (64, 64), True),
    ("0", 4096, (64, 64), False), ("", 4096, (192, 128), False), ("1", 4096, (192, 128), True)])
def test_forward_grid_choice(env, kv_len, dims, persistent, monkeypatch):
  """KVAX_MOSAIC_FWD_PERSISTENT unset ("auto"): the persistent forward up to
  backend.PERSISTENT_MAX_KV padded kv rows, one CTA per (batch, query tile, head) above (13%
  faster at 128k causal on an H200, session 10), and also where the persistent kernel's second Q
  buffer would cost the kv tile (MLA 192 / 128: 64 rows against 128); "1" / "0" force either.
  Checked on the forward's config while lowering for CUDA (no GPU needed); a bad value is
  refused by name."""
  from kvax_plugin.attention.kernels.mosaic import backend as be
  from kvax_plugin.attention.kernels.mosaic import forward as fw
  monkeypatch.setenv("KVAX_MOSAIC_FWD_PERSISTENT", env)
  seen = []
  monkeypatch.setattr(fw, "forward_call", lambda cfg, q, *a: (
      seen.append(cfg.num_ctas),
      (jnp.zeros(q.shape[:3] + (a[1].shape[3],), q.dtype),
       jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)))[1])
  q_len, h = 128, 2
  d, dv = dims
  q_pos = jnp.arange(kv_len - q_len, kv_len, dtype=jnp.int32)[None]
  kv_pos = jnp.arange(kv_len, dtype=jnp.int32)[None]
  q_seg, kv_seg = jnp.zeros_like(q_pos), jnp.zeros_like(kv_pos)
  mask = create_attention_mask(q_pos, q_seg, kv_pos, kv_seg, calc_bwd_mask=False)
  q = jnp.zeros((1, q_len, h, d), jnp.bfloat16)
  kv = jnp.zeros((1, kv_len, 1, d), jnp.bfloat16)
  v = jnp.zeros((1, kv_len, 1, dv), jnp.bfloat16)
  jax.jit(lambda q, k, v: be.flash_attention_mosaic(
      q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask, scale=0.1, logits_soft_cap=None,
      sinks=None)).trace(q, kv, v).lower(lowering_platforms=("cuda",))
  assert len(seen) == 1 and (seen[0] > 0) == persistent, seen
  if env == "1":  # an explicit request that cannot fit is refused, not silently per-tile
    q256, kv256 = (jnp.zeros(x.shape[:3] + (256,), jnp.bfloat16) for x in (q, kv))
    with pytest.raises(ValueError, match=r"KVAX_MOSAIC_FWD_PERSISTENT=1: head dims \(256, 256\)"):
      be.flash_attention_mosaic(q256, kv256, kv256, q_pos, q_seg, kv_pos, kv_seg, mask,
                                scale=0.1, logits_soft_cap=None, sinks=None)
  monkeypatch.setenv("KVAX_MOSAIC_FWD_PERSISTENT", "yes")
  with pytest.raises(ValueError, match="KVAX_MOSAIC_FWD_PERSISTENT='yes'"):
    be.flash_attention_mosaic(q, kv, v, q_pos, q_seg, kv_pos, kv_seg, mask, scale=0.1,
                              logits_soft_cap=None, sinks=None)


# session 12: the step's products as two pairs (S^T with dP^T, then dV with dK); session 14:
# lse / delta folded into the accumulators (with a soft cap: delta only). Both are the defaults
# (EARLY_DP since session 12, FOLD since 15), so the cases with EARLY_DP=1, FOLD=1 or no
# setting ran the default kernels on inputs already run that way: window_masked_full_masked_det
# and window_cap_sinks_det by test_kernels_in_interpreter_match_reference[<case>] (the first also
# by tests/test_mosaic_races.py), docs_padding_gqa (deterministic) by
# test_launch_order_over_heads[docs_padding_gqa] and test_fold_changes_dkv_rounding_only (which
# also shows FOLD=1 reaching the kernel: dv changes). The non-default FOLD=0 stays on both
# feature sets, and the non-default EARLY_DP=0 (the step's products in their plain order) runs
# on the first.
@pytest.mark.parametrize("case,env,want", [
    ("docs_padding_gqa", {"KVAX_MOSAIC_DKV_EARLY_DP": "0", "KVAX_MOSAIC_DKV_FOLD": "0"},
     {"dkv_early_dp": False, "dkv_fold": False}),
    ("window_cap_sinks_det", {"KVAX_MOSAIC_DKV_FOLD": "0"},
     {"dkv_early_dp": True, "dkv_fold": False}),
])
def test_dkv_kernel_register_hooks_match_reference(case, env, want, monkeypatch):
  """The deterministic backward's step-order lever (BwdConfig.dkv_early_dp: two product pairs
  per dk/dv step, the default) and the accumulators started from -lse / scale and -delta
  (BwdConfig.dkv_fold): interpreter against the float32 reference with the fold off
  (documents, a one-token document, padding, GQA; soft cap and sinks), and lowered for CUDA.
  The kernel must really get the setting. (Session 9's register levers and session 12's
  software-pipelined dk/dv and dq steps were removed after measuring slower:
  test_removed_hooks_are_refused.)"""
  from kvax_plugin.attention.kernels.mosaic import backward as bk
  for name, v in env.items():
    monkeypatch.setenv(name, v)
  monkeypatch.setitem(CASES, "docs_padding_gqa", dict(CASES["docs_padding_gqa"], det=True))
  seen = []
  real = bk.dkv_call
  monkeypatch.setattr(bk, "dkv_call", lambda cfg, *a: (
      seen.append({field: getattr(cfg, field) for field in want}), real(cfg, *a))[1])
  test_kernels_in_interpreter_match_reference(case)
  assert seen == [want], seen
  test_kernels_lower_for_cuda((128, 128), True)
  assert seen[-1] == want, seen
  with pytest.raises(ValueError, match="consumer_regs=236"):
    bk.BwdConfig(table_q=128, table_kv=128, scale=1.0, soft_cap=0.0, causal=True, window=0,
                 with_dq=False, interpret=False, consumer_regs=236)


@pytest.mark.parametrize("name", sorted(mosaic.REMOVED_HOOKS))
def test_removed_hooks_are_refused(name, monkeypatch):
  """Benchmarking hooks removed (measured slower or no faster, sessions 6-18, or folded into a default,
  session 16) are refused by name, not silently ignored: a benchmark that sets one would
  otherwise time the default kernels under a stale label."""
  monkeypatch.setenv(name, "1")
  with pytest.raises(ValueError, match=f"{name}: this benchmarking hook was removed"):
    test_kernels_lower_for_cuda((128, 128), True)


@pytest.mark.parametrize("env,det", [({"KVAX_MOSAIC_BWD_REGS": "240"}, True),
                                     ({"KVAX_MOSAIC_BWD_REGS": "240"}, False),
                                     ({"KVAX_MOSAIC_DQ_KV_TILE": "64"}, True),
                                     ({"KVAX_MOSAIC_BWD_REGS": "240",
                                       "KVAX_MOSAIC_UNPAIRED": "1"}, False)])
def test_benchmarking_hooks_lower_for_cuda(env, det, monkeypatch):
  """The register split 240 / 24 and the dq kernel's 64-row kv steps (bench_attention rows
  mosaic_regs240, mosaic_dq64, ...) lower like the defaults, and their values reach the
  kernels (a bad value is refused naming the field)."""
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  test_kernels_lower_for_cuda((128, 128), det)
  from kvax_plugin.attention.kernels.mosaic import backward as bk
  cfg = dict(table_q=128, table_kv=128, scale=1.0, soft_cap=0.0, causal=True, window=0,
             with_dq=False, interpret=False)
  assert bk.BwdConfig(**cfg, consumer_regs=240).producer_regs == 24
  assert bk.BwdConfig(**cfg).producer_regs == 40
  with pytest.raises(ValueError, match="consumer_regs=244"):
    bk.BwdConfig(**cfg, consumer_regs=244)
  with pytest.raises(ValueError, match="dq_kv_tile=32"):
    bk.BwdConfig(**cfg, dq_kv_tile=32)
  from kvax_plugin.attention.kernels.mosaic import backend as mb
  monkeypatch.setenv("KVAX_MOSAIC_BWD_REGS", "many")
  with pytest.raises(ValueError, match="KVAX_MOSAIC_BWD_REGS='many': expected an integer"):
    mb._env_int("KVAX_MOSAIC_BWD_REGS", 232)


def test_nonfinite_inputs_follow_the_reference_in_the_interpreter():
  """The NaN / inf contract of tests/nonfinite_cases.py (shared with the jax and Triton tests),
  on the Mosaic kernels: bf16 inputs, 128-token blocks (the Mosaic tiles), deterministic dq,
  with the default lse / delta folded into the dk/dv kernel's accumulators (-inf and NaN then
  enter through the accumulator instead of a subtraction; the unfolded step, a hook since
  session 15, passed it too before the switch)."""
  import nonfinite_cases
  from kvax_plugin.attention.params import FlashAttentionParamsConfig

  def mosaic_fn(*args, **kwargs):
    return mosaic.flash_attention_mosaic(*args, **kwargs, interpret=True)

  failures = nonfinite_cases.run_cases(
      mosaic_fn, option_cases=("scale_nan", "soft_cap_with_q_inf", "sink_nan"),
      dtype=jnp.bfloat16, head_dim=64, tol=3e-2,
      params=FlashAttentionParamsConfig(128, 128, 8, 2))
  assert not failures, "\n".join(failures)




@pytest.mark.parametrize("saves_context,kernels", [(False, 4), (True, 3)])
def test_remat_policy_saving_context_keeps_the_forward(saves_context, kernels):
  """The forward's residuals (output, lse) carry MaxText's name "context"
  (custom_vjp.RESIDUAL_NAME): under jax.checkpoint with a policy that saves it (MaxText's
  minimal_with_context, save_dot_with_context_except_mlp) the backward does not run the forward
  kernel again: 3 Mosaic kernels (forward, dk/dv, dq) instead of 4 in the lowered loss-and-
  gradient step; with a policy that saves nothing (MaxText's default "full") the forward reruns."""
  import re
  from kvax_plugin.attention.kernels.custom_vjp import RESIDUAL_NAME
  s_len, h, kh, d = 512, 4, 2, 128
  pos, seg = layouts.packed_documents(np.random.default_rng(0), 1, s_len, num_docs=3,
                                      pad_tail=9)
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)
  q = jnp.zeros((1, s_len, h, d), jnp.bfloat16)
  k = jnp.zeros((1, s_len, kh, d), jnp.bfloat16)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)

  def layer(q, k, v):
    out = mosaic.flash_attention_mosaic(q, k, v, pos, seg, pos, seg, mask, scale=0.1,
                                        logits_soft_cap=None, sinks=None)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  policy = (jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME) if saves_context
            else jax.checkpoint_policies.nothing_saveable)
  step = jax.value_and_grad(jax.checkpoint(layer, policy=policy), argnums=(0, 1, 2))
  text = jax.jit(step).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"stablehlo.custom_call @mosaic_gpu", text)) == kernels


def test_lowered_kernel_fingerprints_hold_no_source_locations(tmp_path):
  """scripts/lowered_kernels.py (how a refactor is shown to leave GPU-verified kernels as they
  were), in a fresh process as it is meant to run (traces cached by earlier lowerings in the
  same process keep their source locations): the lowered text holds the serialized Mosaic
  kernels but no file path and no kernel hash, so two checkouts at different paths or line
  numbers can compare equal (session 12 did so for 50 cases between the GPU-tested commit and
  the cleaned-up kernels); the digest file lists the case."""
  import subprocess
  import sys
  from pathlib import Path
  root = Path(__file__).resolve().parents[1]
  done = subprocess.run([sys.executable, "scripts/lowered_kernels.py", "--out", str(tmp_path),
                         "--only", "d64_64_det1_capNone_wNone_s0"], cwd=root,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  text = (tmp_path / "d64_64_det1_capNone_wNone_s0.txt").read_text()
  assert "mosaic_gpu" in text
  assert "kernel_hash" not in text and "kvax_plugin/" not in text and ".py" not in text
  digests = (tmp_path / "digests.txt").read_text().split()
  assert digests[0] == "d64_64_det1_capNone_wNone_s0" and len(digests[1]) == 32
