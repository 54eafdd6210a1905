"""The Mosaic GPU (Hopper) kernels on the CPU: Pallas' Mosaic GPU interpreter runs them with
simulated shared memory, TMA copies, barriers and warpgroups (and checks that every barrier
phase is observed), so their logic - table walking, masking, online softmax, the producer /
consumer ring, both backward modes - is tested here against the float32 reference. A second
test lowers them for CUDA (no GPU needed), which catches what Mosaic GPU cannot compile.
The GPU runs of the same kernels are tests/gpu/test_mosaic_gpu.py.

An interpreter run costs ~10 s of CPU (a few thousand Python callbacks), so each (case, backward
mode, options) runs once per process (`case_run`, memoised) and every test about that run reads
it: the reference match, the launch configuration the kernels got, the fold comparison, and the
race detector (on for every run: tests/test_mosaic_races.py explains its model and checks it on
small ring kernels; its kernel tests read these runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
import pytest

from kvax_plugin.attention.block_mask import create_attention_mask
from kvax_plugin.attention.kernels.mosaic import backend as mosaic
from kvax_plugin.attention.kernels.mosaic import backward as bk
from kvax_plugin.attention.kernels.mosaic import forward as fw
from kvax_plugin.attention.options import KernelOptions
from kvax_plugin.attention.params import FlashAttentionParamsConfig
from kvax_plugin.attention.reference import reference_attention

import layouts
import race_reports


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
    # documents (one of one token), padding, GQA 4/2 (two kv heads: the dk/dv kernel's launch
    # order maps kv heads, the dq kernel's query heads), fused-dq backward with the column-split
    # dq partials (head dim 128; the whole-partial path runs in prefill_mla, head dim 192)
    "docs_padding_gqa": dict(segs=[3] * 100 + [0] + [9] * 100 + [2] * 50 + [-1] * 5, h=4, kh=2,
                             dk=128),
    # window + soft cap + sinks, MQA, non-contiguous documents with huge ids, deterministic dq
    "window_cap_sinks_det": dict(segs=([5] * 64 + [2**30] * 64) * 2, h=2, kh=1, window=40,
                                 cap=20.0, sinks=True, det=True),
    # a sliding window over one long document: query tiles whose row has a masked run BEFORE its
    # full blocks (the window's edge) and one after (the diagonal), walked in the kernels'
    # visit order (masked runs first, then full); deterministic and fused backward. 384 tokens
    # (3 tiles; 640 before, the interpreter's time grows with the tiles) are the fewest where
    # window 300 gives such a row in the forward, dq and dk/dv tables (the test asserts it).
    # One head: the case is about the tables (heads: the other cases)
    "window_masked_full_masked_det": dict(segs=[7] * 384, h=1, kh=1, window=300, det=True),
    "window_masked_full_masked_fused": dict(segs=[7] * 384, h=1, kh=1, window=300),
    # Sq != Skv (queries are the last tokens), MLA-style head dims 192 / 128, two heads (MHA)
    "prefill_mla": dict(segs=[0] * 384, sq=128, h=2, kh=2, dk=192, dv=128),
    # backward tables of 64-query blocks (kvax 0.1.0's Hopper default, bwd 64 x 128): the dq
    # kernel's 128-row tiles walk the union of two table rows (a wrong row stride: zero / NaN dq)
    "bwd_q64_docs_det": dict(segs=[4] * 70 + [8] * 1 + [6] * 120 + [-1] * 65, h=2, kh=1,
                             det=True, bwd=(64, 128)),
    "bwd_q64_causal_fused": dict(segs=[1] * 256, h=1, kh=1, bwd=(64, 128)),
}
# Cases run by one test each (below), not by test_kernels_in_interpreter_match_reference.
OTHER_CASES = {
    # 2 query tiles x 2 heads = 4 items over 3 CTAs: one full round and a partial one, whose
    # only item belongs to the last CTA (the second round is mirrored)
    "odd_rounds_mqa": dict(segs=[1] * 130 + [2] * 100 + [-1] * 26, h=2, kh=1, det=True),
    # two query tiles, documents, GQA, MLA head dims in the per-tile forward
    "mla_docs": dict(segs=[4] * 100 + [7] * 130 + [-1] * 26, h=2, kh=1, dk=192, dv=128,
                     options=KernelOptions(mosaic_forward_grid="per_tile")),
    # three query tiles visiting 1, 2 and 1 kv blocks: the per-tile forward launches them
    # longest first (1, 0, 2), not in reverse tile order
    "per_tile_docs_order": dict(segs=[1] * 256 + [2] * 128, h=2, kh=1,
                                options=KernelOptions(mosaic_forward_grid="per_tile")),
}

_WGMMA = plgpu.wgmma


def _wgmma_with_visible_reads(acc, a, b, **kwargs):
  """plgpu.wgmma whose shared-memory operands (refs; `a` may be registers) are also read, as
  plain loads, where the product is issued, so the race detector sees them (the detector does
  not check wgmma's operand reads: tests/test_mosaic_races.py, point 3)."""
  for operand in (a, b):
    if not isinstance(operand, jax.Array):
      operand[...]  # noqa: B018  (the read is the point; its value is not needed)
  return _WGMMA(acc, a, b, **kwargs)


@contextlib.contextmanager
def race_detection():
  """Kernels traced inside run under the interpreter's race detector, wgmma reads visible."""
  real_params, real_wgmma = plgpu.InterpretGPUParams, plgpu.wgmma
  plgpu.InterpretGPUParams = race_reports.detector_params()
  plgpu.wgmma = _wgmma_with_visible_reads
  try:
    yield
  finally:
    plgpu.InterpretGPUParams, plgpu.wgmma = real_params, real_wgmma


@dataclasses.dataclass
class Run:
  """One interpreter run of a case: (out, dq, dk, dv[, dsinks]) of ours and of the float32
  reference, what the race detector printed, and the launch configurations the kernels got."""
  case: dict
  mine: tuple
  theirs: tuple
  q_seg: np.ndarray
  printed: str
  forward: list  # FwdConfig of each forward kernel call
  backward: list  # ("dkv" | "dq", BwdConfig) of each backward kernel call


def _case(name: str, changes: dict) -> dict:
  c = dict(CASES[name] if name in CASES else OTHER_CASES[name], **changes)
  # None and the defaults, det absent and False: one run each
  c["options"] = c.get("options") or KernelOptions()
  c["det"] = bool(c.get("det", False))
  return c


def _key(c: dict) -> str:
  return repr(sorted(c.items()))


_INPUTS: dict = {}
_REFERENCES: dict = {}
_RUNS: dict = {}
# The fields inputs, mask and reference depend on (the rest is the backward mode / options).
_GEOMETRY = ("segs", "sq", "h", "kh", "dk", "dv", "sinks", "window", "cap", "bwd")


def _geometry(c: dict) -> str:
  return _key({f: c[f] for f in _GEOMETRY if f in c})


def _inputs(c: dict, seed: int):
  """(q, k, v, sinks, cotangent), (positions, segment ids) and mask of a case; memoised."""
  key = (_geometry(c), seed)
  if key not in _INPUTS:
    kv_pos, kv_seg = _segments(c["segs"])
    skv = kv_seg.shape[1]
    sq = c.get("sq", skv)
    q_pos, q_seg = kv_pos[:, skv - sq:], kv_seg[:, skv - sq:]
    h, kh, dk, dv = c["h"], c["kh"], c.get("dk", 64), c.get("dv", c.get("dk", 64))
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (1, sq, h, dk), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, skv, kh, dk), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, skv, kh, dv), jnp.bfloat16)
    cot = jax.random.normal(keys[3], (1, sq, h, dv), jnp.float32)
    sinks = jax.random.normal(keys[4], (h,), jnp.float32) if c.get("sinks") else None
    bwd = FlashAttentionParamsConfig(*c["bwd"]) if "bwd" in c else None
    mask = create_attention_mask(q_pos, q_seg, kv_pos, kv_seg, calc_bwd_mask=True,
                                 sliding_window=c.get("window"), bwd_params=bwd)
    _INPUTS[key] = (q, k, v, sinks, cot), (q_pos, q_seg, kv_pos, kv_seg), mask
  return _INPUTS[key]


def _outputs_and_grads(fn, q, k, v, sinks, cot, ints, mask):
  """(out, dq, dk, dv[, dsinks]) in one forward (the interpreter is slow), jitted with every
  array an argument (closed-over constants would be folded by XLA)."""
  @jax.jit
  def run(q, k, v, sinks, cot, ints, mask):
    if sinks is None:
      out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None, ints, mask), q, k, v)
    else:
      out, vjp = jax.vjp(lambda q, k, v, s: fn(q, k, v, s, ints, mask), q, k, v, sinks)
    return (out,) + vjp(cot.astype(out.dtype))
  return run(q, k, v, sinks, cot, ints, mask)


def _reference(c: dict, seed: int):
  """The float32 reference's (out, dq, dk, dv[, dsinks]) of a case; memoised (the backward
  modes and options of one case share it)."""
  key = (_geometry(c), seed)
  if key not in _REFERENCES:
    (q, k, v, sinks, cot), ints, mask = _inputs(c, seed)
    dk = q.shape[-1]

    def ref(q, k, v, s, ints, mask):
      f32 = lambda x: x.astype(jnp.float32)
      return reference_attention(f32(q), f32(k), f32(v), *ints, sliding_window=c.get("window"),
                                 scale=dk ** -0.5, logits_soft_cap=c.get("cap"), sinks=s)
    _REFERENCES[key] = _outputs_and_grads(ref, q, k, v, sinks, cot, ints, mask)
  return _REFERENCES[key]


def case_run(name: str, forward_only: bool = False, **changes) -> Run:
  """CASES[name] (or OTHER_CASES[name]) with `changes` (det, options), run once per process in
  the interpreter with the race detector on; memoised. forward_only: the forward kernel alone
  (Run.mine is (out,), no backward calls): for a run only compared by its output, as the
  backward is half or more of a run; a full run of the same case serves it too."""
  c = _case(name, changes)
  key = _key(c)
  if forward_only and key in _RUNS:
    return _RUNS[key]
  if forward_only:
    key += " forward only"
  if key not in _RUNS:
    seed = sum(map(ord, name))
    (q, k, v, sinks, cot), ints, mask = _inputs(c, seed)
    dk = q.shape[-1]
    forward, backward = [], []

    def ours(q, k, v, s, ints, mask):
      return mosaic.flash_attention_mosaic(q, k, v, *ints, mask, scale=dk ** -0.5,
                                           logits_soft_cap=c.get("cap"), sinks=s,
                                           deterministic_backward=c["det"],
                                           kernel_options=c["options"], interpret=True)

    real = fw.forward_call, bk.dkv_call, bk.dq_call
    fw.forward_call = lambda cfg, *a: (forward.append(cfg), real[0](cfg, *a))[1]
    bk.dkv_call = lambda cfg, *a: (backward.append(("dkv", cfg)), real[1](cfg, *a))[1]
    bk.dq_call = lambda cfg, *a: (backward.append(("dq", cfg)), real[2](cfg, *a))[1]
    try:
      with race_detection(), race_reports.captured_reports() as printed:
        if forward_only:
          mine = (jax.block_until_ready(jax.jit(ours)(q, k, v, sinks, ints, mask)),)
        else:
          mine = jax.block_until_ready(_outputs_and_grads(ours, q, k, v, sinks, cot, ints,
                                                          mask))
    finally:
      fw.forward_call, bk.dkv_call, bk.dq_call = real
    _RUNS[key] = Run(c, mine, _reference(c, seed), np.asarray(ints[1]),
                     printed.getvalue(), forward, backward)
  return _RUNS[key]


def check_case(name: str, **changes) -> Run:
  """case_run(name, **changes) matches the float32 reference, pads with exact zeros and has
  no race reported."""
  run = case_run(name, **changes)
  errs = [_rel(a, b) for a, b in zip(run.mine, run.theirs)]
  assert all(bool(jnp.all(jnp.isfinite(jnp.asarray(a, jnp.float32)))) for a in run.mine)
  assert max(errs) < 1.5e-2, errs  # bf16 inputs; P and dS rounded to bf16 (~3e-3 seen)
  pad = run.q_seg == -1
  if pad.any():
    assert float(jnp.max(jnp.abs(run.mine[0].astype(jnp.float32)[pad]))) == 0.0
    assert float(jnp.max(jnp.abs(run.mine[1].astype(jnp.float32)[pad]))) == 0.0
  assert "RACE DETECTED" not in run.printed, run.printed[:4000]
  return run


def test_per_tile_forward_launches_tiles_longest_first(monkeypatch):
  """The per-tile forward takes each CTA's query tile from the longest-first order of the mask
  (block_mask.longest_first), as the persistent one deals its items: the case's order is
  (1, 0, 2), so a wrong lookup leaves a tile unwritten or written twice."""
  seen = []
  real = fw.longest_first

  def recorded(*args):
    order = real(*args)
    jax.debug.callback(lambda o: seen.append(np.asarray(o).tolist()), order)
    return order

  monkeypatch.setattr(fw, "longest_first", recorded)
  run = check_case("per_tile_docs_order")
  assert all(cfg.num_ctas == 0 for cfg in run.forward), run.forward
  assert seen and all(order == [[1, 0, 2]] for order in seen), seen


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_in_interpreter_match_reference(name):
  c = _case(name, {})
  if "masked_full_masked" in name:  # the case is about rows with both masked runs
    _, _, mask = _inputs(c, sum(map(ord, name)))
    for table in (mask.fwd, mask.dq, mask.dkv):
      lo, up, flo, fup = (np.asarray(x) for x in (table.lower, table.upper, table.full_lower,
                                                  table.full_upper))
      assert ((lo < flo) & (flo < fup) & (fup < up)).any(), table
  check_case(name)


@pytest.mark.parametrize("dims,det", [((128, 128), False), ((128, 128), True), ((256, 256), False),
                                      ((96, 96), False)])
def test_kernels_lower_for_cuda(dims, det, cap=30.0, options=None):
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
        deterministic_backward=det, kernel_options=options), q, k, v)
    return out, vjp(out)

  text = jax.jit(fwd_bwd).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("fields", [dict(dq_after_dkv=True), dict(mosaic_backward_id_rings=True)],
                         ids=["dq_after_dkv", "id_rings"])
def test_kernel_options_match_reference_in_interpreter(fields):
  """The backward's options (the dq kernel ordered after the dk/dv kernel; positions / segment
  ids TMA-loaded into the rings with q and K) compute the same attention: interpreter against
  the float32 reference (window, soft cap, sinks, MQA, non-contiguous documents, deterministic
  backward: both backward kernels), and lowered for CUDA."""
  run = check_case("window_cap_sinks_det", options=KernelOptions(**fields))
  assert [(name, cfg.dq_after_dkv, cfg.ids_tma) for name, cfg in run.backward] == [
      (name, fields.get("dq_after_dkv", False), fields.get("mosaic_backward_id_rings", False))
      for name in ("dkv", "dq")], run.backward
  test_kernels_lower_for_cuda((128, 128), True, options=KernelOptions(**fields))


def test_documents_longest_first():
  """block_mask.documents_longest_first (the grouping of the CUDA backward's "documents" launch
  layout): a permutation of the tiles per batch row; tiles sharing their last visited block
  stay together in tile order; groups by descending summed visited blocks, a tie going to the
  group that ends first; one causal document is sequence order; padding tiles (nothing
  visited) last."""
  from kvax_plugin.attention import block_mask as bm
  # row 0: documents of tiles {0, 1} (ends 4, work 4 + 2), {2} (ends 6, work 2), {3, 4, 5}
  # (ends 12, work 6 + 4 + 2 = 12), then a padding tile; row 1 one causal document; row 2 a
  # tie: {0} and {1} both 3 blocks of work
  lower = jnp.asarray([[0, 2, 4, 6, 8, 10, 0], [0, 1, 2, 3, 4, 5, 6], [0, 3, 6, 6, 6, 6, 6]])
  upper = jnp.asarray([[4, 4, 6, 12, 12, 12, 0], [7, 7, 7, 7, 7, 7, 7], [3, 6, 7, 7, 7, 7, 7]])
  order = bm.documents_longest_first(lower, upper, 1, 7).tolist()
  assert order[0] == [3, 4, 5, 0, 1, 2, 6]
  assert order[1] == list(range(7))
  assert order[2] == [2, 3, 4, 5, 6, 0, 1]  # {2..6}: 5, then {0}: 3 before {1}: 3
  # two table rows per kernel tile: each row's tiles follow each other
  assert bm.documents_longest_first(lower[:1], upper[:1], 2, 14).tolist() == [
      [6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 12, 13]]


def test_longest_first_orders():
  """block_mask.longest_first (the persistent forward's deal: a permutation, descending visited
  blocks, ties in tile order) and block_mask.longest_first_over_heads (both Mosaic backward
  kernels' launch order: every (head, tile) pair once, longest tile first, the heads of one
  tile together)."""
  from kvax_plugin.attention import block_mask as bm
  lower = jnp.array([[0, 0, 2, 2, 0]], jnp.int32)
  upper = jnp.array([[1, 2, 3, 5, 0]], jnp.int32)
  assert bm.longest_first(lower, upper, 1, 5).tolist() == [[3, 1, 0, 2, 4]]
  assert bm.longest_first(lower, upper, 2, 9).tolist() == [[6, 7, 2, 3, 0, 1, 4, 5, 8]]
  # works per tile 1, 2, 1, 3, 0 (one tile per row); 2 heads: codes tile * 2 + head
  assert bm.longest_first_over_heads(lower, upper, 1, 5, 2).tolist() == [
      [6, 7, 2, 3, 0, 1, 4, 5, 8, 9]]
  order = bm.longest_first_over_heads(lower, upper, 2, 9, 3)
  assert sorted(order[0].tolist()) == list(range(27))  # every (head, tile) once


def test_launch_order_over_heads_with_gqa_documents():
  """Both backward kernels map their launch position (head * n_tiles + tile) to the (head,
  tile) of block_mask.longest_first_over_heads (the dk/dv kernel's heads are kv heads, the dq
  kernel's query heads): documents, padding and GQA with the deterministic dq kernel against
  the float32 reference (the case's default backward is the fused one)."""
  run = check_case("docs_padding_gqa", det=True)
  assert [name for name, _ in run.backward] == ["dkv", "dq"], run.backward


def test_fold_changes_dkv_rounding_only():
  """The deterministic dk/dv kernel folds lse / delta into its accumulators, the fused one does
  not (nor the deterministic one with mosaic_paired_products=False, whose step keeps the plain
  order): in the interpreter (documents, a one-token document, padding, GQA) the forward is
  bitwise the same and every gradient agrees within float32 rounding (then one bf16 rounding);
  the interpreter's fused path also sums dS K in another order. Whether dv's last bits move
  depends on how XLA's CPU compiler rounds exp2's argument (it can go either way), so
  only the size is checked. The GPU test
  test_fused_and_deterministic_backward_agree_and_deterministic_is_reproducible relies on this.
  The three runs are those of test_kernels_in_interpreter_match_reference[docs_padding_gqa],
  test_launch_order_over_heads_with_gqa_documents and
  test_unpaired_products_match_reference[docs_padding_gqa] (each checked against the reference
  there)."""
  fused = case_run("docs_padding_gqa").mine
  folded = case_run("docs_padding_gqa", det=True).mine
  unfolded = case_run("docs_padding_gqa", det=True,
                      options=KernelOptions(mosaic_paired_products=False)).mine
  names = ["out", "dq", "dk", "dv"]
  with_fold = dict(zip(names, (_rel(a, b) for a, b in zip(folded, fused))))
  without = dict(zip(names, (_rel(a, b) for a, b in zip(unfolded, fused))))
  assert with_fold["out"] == 0.0 and without["out"] == 0.0
  # ~3e-5 seen on dq / dk / dv (dv: 0 or ~2.5e-5, as XLA's CPU code rounds)
  assert max(with_fold.values()) < 2e-4 and max(without.values()) < 2e-4, (with_fold, without)


# The persistent snake-deal forward (3 CTAs) is the interpreter's default ("auto") at head dims
# 64 / 128, so most cases of test_kernels_in_interpreter_match_reference run it already.
# prefill_mla stays here ("auto" runs MLA per-tile: the persistent kernel's 64-row kv tile and
# separate O staging run only here), with odd_rounds_mqa, whose odd second round (and
# deterministic backward) only this test runs.
@pytest.mark.parametrize("case", ["prefill_mla", "odd_rounds_mqa"])
def test_persistent_forward_matches_reference(case):
  """mosaic_forward_grid="persistent" (FwdConfig.num_ctas): 3 CTAs in the interpreter, each
  taking several (batch, query tile, head) items dealt as a snake draft, with one kv ring across
  them and Q loaded one item ahead; Dv != Dk with Sq != Skv (the separate O staging); odd
  rounds with MQA and padding; against the float32 reference. The kernel must really run
  persistent."""
  run = check_case(case, options=KernelOptions(mosaic_forward_grid="persistent"))
  assert [cfg.num_ctas for cfg in run.forward] == [3], run.forward


def test_persistent_and_per_tile_grids_lower_for_cuda(monkeypatch):
  """The persistent forward lowered for CUDA: one CTA per SM there; "per_tile" must really
  not be persistent. (Once: the lowering does not depend on the interpreter cases above.)"""
  seen = []
  real = fw.forward_call
  monkeypatch.setattr(fw, "forward_call", lambda cfg, *a: (seen.append(cfg.num_ctas),
                                                           real(cfg, *a))[1])
  test_kernels_lower_for_cuda((128, 128), True,
                              options=KernelOptions(mosaic_forward_grid="persistent"))
  assert seen[-1] > 3, seen  # one CTA per SM when lowered for the GPU
  test_kernels_lower_for_cuda((128, 128), True,
                              options=KernelOptions(mosaic_forward_grid="per_tile"))
  assert seen[-1] == 0, seen


# prefill_mla here was the same run as test_kernels_in_interpreter_match_reference[prefill_mla]
# ("auto" runs MLA per-tile with 128-row kv blocks); mla_docs (two query tiles, documents, GQA)
# checks the 128 block reaches the kernel.
@pytest.mark.parametrize("case", ["mla_docs"])
def test_mla_forward_stages_output_in_q_memory(case, monkeypatch):
  """Dv < Dk in the per-tile forward (mosaic_forward_grid="per_tile"): O is staged in a RefUnion
  with Q (forward.o_in_q), both consumers meeting at a barrier after their last Q K^T product,
  which lets MLA (192 / 128) use 128-row kv blocks. Interpreter against the float32 reference
  (two query tiles, documents, GQA) and lowered for CUDA; the kernel must get the 128 block."""
  run = check_case(case)
  assert [(cfg.num_ctas, cfg.block_kv) for cfg in run.forward] == [(0, 128)], run.forward
  seen = []
  real = fw.forward_call
  monkeypatch.setattr(fw, "forward_call", lambda cfg, *a: (seen.append((cfg.num_ctas,
                                                                        cfg.block_kv)),
                                                           real(cfg, *a))[1])
  test_kernels_lower_for_cuda((192, 128), True, options=OTHER_CASES[case]["options"])
  assert seen[-1] == (0, 128), seen
  assert fw.smem_bytes(128, 2, 192, 128, 2) <= mosaic.SMEM_BUDGET < fw.smem_bytes(
      128, 2, 192, 128, 2, q_buffers=2)


@pytest.mark.parametrize("grid,kv_len,dims,persistent", [
    ("auto", 32768, (64, 64), True), ("auto", 32768 + 1, (64, 64), False),
    ("persistent", 32768 + 1, (64, 64), True), ("per_tile", 4096, (64, 64), False),
    ("auto", 4096, (192, 128), False), ("persistent", 4096, (192, 128), True)])
def test_forward_grid_choice(grid, kv_len, dims, persistent, monkeypatch):
  """mosaic_forward_grid "auto" (the default): the persistent forward up to
  backend.PERSISTENT_MAX_KV padded kv rows, one CTA per (batch, query tile, head) above (faster
  on long causal rows, docs/tuning-history.md), and also where the persistent kernel's second Q
  buffer would cost the kv tile (MLA 192 / 128: 64 rows against 128); "persistent" / "per_tile"
  force either. Checked on the forward's config while lowering for CUDA (no GPU needed); a
  persistent request that cannot fit is refused by name, as is an unknown grid."""
  from kvax_plugin.attention.kernels.mosaic import backend as be
  from kvax_plugin.attention.kernels.mosaic import forward as fw
  options = KernelOptions(mosaic_forward_grid=grid)
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
      sinks=None, kernel_options=options)).trace(q, kv, v).lower(lowering_platforms=("cuda",))
  assert len(seen) == 1 and (seen[0] > 0) == persistent, seen
  if grid == "persistent":  # an explicit request that cannot fit is refused, not per-tile
    q256, kv256 = (jnp.zeros(x.shape[:3] + (256,), jnp.bfloat16) for x in (q, kv))
    with pytest.raises(ValueError, match=r"mosaic_forward_grid='persistent': head dims "
                                         r"\(256, 256\)"):
      be.flash_attention_mosaic(q256, kv256, kv256, q_pos, q_seg, kv_pos, kv_seg, mask,
                                scale=0.1, logits_soft_cap=None, sinks=None,
                                kernel_options=options)
  with pytest.raises(ValueError, match="mosaic_forward_grid='yes': expected one of"):
    KernelOptions(mosaic_forward_grid="yes")


# The forward's overlapped schedule (KernelOptions.mosaic_forward_overlap_blocks): rows of at
# least that many kv blocks overlap a block's softmax with the previous block's P V. The CPU
# cases' rows have 1-3 blocks: by default (None) the plain ones of head dim 128 overlap every row
# and the others take the ping-pong; here 1 overlaps every row and 2 splits the rows of a case
# between the schedules.
@pytest.mark.parametrize("name,blocks", [(n, 1) for n in sorted(CASES)] +
                         [("docs_padding_gqa", 2), ("window_masked_full_masked_det", 2),
                          ("mla_docs", 2)])
def test_overlapped_forward_matches_reference_and_ping_pong(name, blocks):
  """Against the float32 reference (outputs and gradients, no race), and the forward output
  bitwise equal to the ping-pong's (a forward-only run: only its output is compared): the
  schedule changes, the sums and their order do not. The per-tile grid: mla_docs, prefill_mla
  (MLA's "auto"); the others run the persistent one."""
  grid = dict(mosaic_forward_grid="per_tile") if name == "mla_docs" else {}
  run = check_case(name, options=KernelOptions(mosaic_forward_overlap_blocks=blocks, **grid))
  assert {cfg.overlap_min_blocks for cfg in run.forward} == {blocks}, run.forward
  if grid:
    assert all(cfg.num_ctas == 0 for cfg in run.forward), run.forward
  plain = case_run(name, forward_only=True,
                   options=KernelOptions(mosaic_forward_overlap_blocks=0, **grid))
  assert {cfg.overlap_min_blocks for cfg in plain.forward} == {0}, plain.forward
  np.testing.assert_array_equal(np.asarray(run.mine[0], np.float32),
                                np.asarray(plain.mine[0], np.float32))
  if blocks > 1:  # the case has rows on both sides of the threshold
    _, _, mask = _inputs(_case(name, {}), sum(map(ord, name)))
    cfg = run.forward[0]
    counts = np.asarray(mask.fwd.upper - mask.fwd.lower) * (cfg.table_kv // cfg.block_kv)
    assert (counts >= blocks).any() and ((counts > 0) & (counts < blocks)).any(), counts


def _lowered_forward(monkeypatch, options, d=128, soft_cap=None):
  """The Mosaic module of the forward of a 512-token causal row (4 / 2 heads of dim d), as
  lowered for CUDA on this CPU machine (captured where Mosaic serializes it)."""
  import jax.experimental.mosaic.gpu.core as mgpu_core
  modules = []
  serde = mgpu_core._run_serde_pass
  monkeypatch.setattr(mgpu_core, "_run_serde_pass",
                      lambda module, **kw: (modules.append(str(module)), serde(module, **kw))[1])
  pos = jnp.arange(512, dtype=jnp.int32)[None]
  seg = jnp.zeros_like(pos)
  mask = create_attention_mask(pos, seg, pos, seg)
  q = jnp.zeros((1, 512, 4, d), jnp.bfloat16)
  kv = jnp.zeros((1, 512, 2, d), jnp.bfloat16)
  jax.jit(lambda q, kv: mosaic.flash_attention_mosaic(
      q, kv, kv, pos, seg, pos, seg, mask, scale=0.1, logits_soft_cap=soft_cap, sinks=None,
      kernel_options=options)).trace(q, kv).lower(lowering_platforms=("cuda",))
  assert len(modules) == 1, len(modules)
  return modules[0]


@pytest.mark.parametrize("d", [128, 64])
def test_overlapped_forward_lowers_for_cuda(d, monkeypatch):
  """The forward lowered for CUDA (the CPU cases above run the interpreter, which has no wgmma
  pipeline): with the overlap, a step waits for its Q K^T product alone while P V stays in
  flight (a wgmma wait for "at most 1 in flight"), which the ping-pong never does."""
  lowered = lambda blocks: _lowered_forward(
      monkeypatch, KernelOptions(mosaic_forward_overlap_blocks=blocks), d)
  waits = {blocks: lowered(blocks).count("wgmma.wait_group.sync.aligned 1;") for blocks in (0, 1)}
  assert waits[0] == 0 and waits[1] > 0, waits


def test_forward_registers_reach_the_kernel(monkeypatch):
  """KernelOptions.mosaic_forward_registers sets the forward's register split, as lowered for
  CUDA: the consumers' setmaxnreg to it, the producer's to 504 - 2 x it (default 240 / 24)."""
  for options, (consumers, producer) in ((KernelOptions(), (240, 24)),
                                         (KernelOptions(mosaic_forward_registers=232), (232, 40))):
    module = _lowered_forward(monkeypatch, options)
    assert f"setmaxnreg.inc.sync.aligned.u32 {consumers};" in module
    assert f"setmaxnreg.dec.sync.aligned.u32 {producer};" in module


@pytest.mark.parametrize("d", [128, 64])
def test_overlap_blocks_default_resolves_where_measured(d, monkeypatch):
  """mosaic_forward_overlap_blocks=None (the default) lowers the same kernel as its resolved
  threshold (head dims 128 / 128 without soft cap, window or sinks: 1, every row; else 16), not
  as the other one; an explicit value holds up to v head dim 128, and above it the ping-pong
  runs."""
  # each lowering numbers its kernel (entry_0, entry_1, ...)
  lowered = lambda blocks: re.sub(r"entry_\d+", "entry", _lowered_forward(
      monkeypatch, KernelOptions(mosaic_forward_overlap_blocks=blocks), d))
  own = mosaic.overlap_min_blocks(None, d, d, plain=True)
  assert own == {128: 1, 64: 16}[d]
  default = lowered(None)
  assert default == lowered(own)
  assert default != lowered({1: 16, 16: 1}[own])
  assert [mosaic.overlap_min_blocks(o, d, d, plain=True) for o in (0, 3)] == [0, 3]
  # timed only on plain calls at 128 / 128: soft cap, window, sinks and MLA keep 16
  assert mosaic.overlap_min_blocks(None, d, d, plain=False) == 16
  assert mosaic.overlap_min_blocks(None, 192, 128, plain=True) == 16
  assert [mosaic.overlap_min_blocks(o, 256, 256, plain=True) for o in (None, 3)] == [0, 0]
  # and the backend passes a soft cap through: its default is the 16-block kernel
  capped = lambda blocks: re.sub(r"entry_\d+", "entry", _lowered_forward(
      monkeypatch, KernelOptions(mosaic_forward_overlap_blocks=blocks), d, soft_cap=30.0))
  assert capped(None) == capped(16)


@pytest.mark.parametrize("bad", [-1, True, 2.0])
def test_overlap_blocks_option_is_checked(bad):
  with pytest.raises(ValueError, match="mosaic_forward_overlap_blocks"):
    KernelOptions(mosaic_forward_overlap_blocks=bad)


# The deterministic dk/dv step's two product pairs and the lse / delta fold (both settled
# defaults) need paired products; mosaic_paired_products=False runs the plain step (1 + 2 + 1
# products, no fold) and the dq kernel's products one by one: here on both feature sets
# (documents, a one-token document, padding, GQA; soft cap, sinks, window, MQA).
@pytest.mark.parametrize("case", ["docs_padding_gqa", "window_cap_sinks_det"])
def test_unpaired_products_match_reference(case):
  """mosaic_paired_products=False in the deterministic backward: interpreter against the float32
  reference and lowered for CUDA; the kernels must really get the setting."""
  run = check_case(case, det=True, options=KernelOptions(mosaic_paired_products=False))
  assert [cfg.paired for _, cfg in run.backward] == [False, False], run.backward


@pytest.mark.parametrize("fields,det", [(dict(mosaic_backward_registers=240), True),
                                        (dict(mosaic_backward_registers=240), False),
                                        (dict(mosaic_backward_registers=240,
                                              mosaic_paired_products=False), False)],
                         ids=["regs240_det", "regs240_fused", "regs240_unpaired_fused"])
def test_backward_register_split_lowers_for_cuda(fields, det, monkeypatch):
  """The register split 240 / 24 (alone, and unpaired in the fused backward: the fastest fused
  variant) lowers like the defaults, and its value reaches the kernels; a bad value is refused
  naming the field."""
  from kvax_plugin.attention.kernels.mosaic import backward as bk
  seen = []
  real = bk.dkv_call
  monkeypatch.setattr(bk, "dkv_call", lambda cfg, *a: (
      seen.append((cfg.consumer_regs, cfg.producer_regs, cfg.paired)), real(cfg, *a))[1])
  options = KernelOptions(**fields)
  test_kernels_lower_for_cuda((128, 128), det, options=options)
  assert seen == [(240, 24, options.mosaic_paired_products)], seen
  cfg = dict(table_q=128, table_kv=128, scale=1.0, soft_cap=0.0, causal=True, window=0,
             with_dq=False, interpret=False)
  assert bk.BwdConfig(**cfg).producer_regs == 40
  with pytest.raises(ValueError, match="consumer_regs=244"):
    bk.BwdConfig(**cfg, consumer_regs=244)
  with pytest.raises(ValueError, match="mosaic_backward_registers=244: expected a multiple of 8"):
    KernelOptions(mosaic_backward_registers=244)


def test_kernel_options_reach_the_kernels_through_the_public_op(monkeypatch):
  """kvax_plugin.flash_attention(kernel_options=...) reaches the Mosaic kernels' launch
  configurations through the registry (lowered for CUDA, with the registry told the Mosaic
  backend runs here): None gives the defaults, every Mosaic field arrives, and something that
  is not a KernelOptions is refused by name."""
  import kvax_plugin
  from kvax_plugin.attention import kernels
  from kvax_plugin.attention.kernels.mosaic import backward as bk
  from kvax_plugin.attention.kernels.mosaic import forward as fw
  real = kernels.availability
  monkeypatch.setattr(kernels, "availability", lambda name: (
      (True, "pretend Hopper") if name == "mosaic" else real(name)))
  seen = []
  real_fwd, real_dkv, real_dq = fw.forward_call, bk.dkv_call, bk.dq_call
  monkeypatch.setattr(fw, "forward_call", lambda cfg, *a: (
      seen.append(("fwd", cfg.num_ctas > 0)), real_fwd(cfg, *a))[1])
  for name, real_call in (("dkv", real_dkv), ("dq", real_dq)):
    monkeypatch.setattr(bk, f"{name}_call", lambda cfg, *a, name=name, real_call=real_call: (
        seen.append((name, cfg.consumer_regs, cfg.paired, cfg.ids_tma, cfg.dq_after_dkv)),
        real_call(cfg, *a))[1])
  pos, seg = layouts.packed_documents(np.random.default_rng(0), 1, 512, num_docs=3, pad_tail=9)
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)
  q = jnp.zeros((1, 512, 4, 64), jnp.bfloat16)
  k = jnp.zeros((1, 512, 2, 64), jnp.bfloat16)
  mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)

  def lower(options):
    seen.clear()

    def fwd_bwd(q, k, v):
      out, vjp = jax.vjp(lambda q, k, v: kvax_plugin.flash_attention(
          q, k, v, pos, seg, pos, seg, mask, scale=0.1, backend="mosaic",
          kernel_options=options), q, k, v)
      return out, vjp(out)
    jax.jit(fwd_bwd).trace(q, k, k).lower(lowering_platforms=("cuda",))
    return list(seen)

  assert lower(None) == [("fwd", True), ("dkv", 232, True, False, False),
                         ("dq", 232, True, False, False)]
  tuned = kvax_plugin.KernelOptions(mosaic_forward_grid="per_tile", mosaic_backward_registers=240,
                                    mosaic_paired_products=False, mosaic_backward_id_rings=True,
                                    dq_after_dkv=True)
  assert lower(tuned) == [("fwd", False), ("dkv", 240, False, True, True),
                          ("dq", 240, False, True, True)]
  with pytest.raises(TypeError, match="kernel_options must be a kvax_plugin.KernelOptions"):
    lower({"mosaic_backward_registers": 240})


def test_nonfinite_inputs_follow_the_reference_in_the_interpreter():
  """The NaN / inf contract of tests/nonfinite_cases.py (shared with the jax and Triton tests),
  on the Mosaic kernels: bf16 inputs, 128-token blocks (the Mosaic tiles), deterministic dq,
  with the default lse / delta folded into the dk/dv kernel's accumulators (-inf and NaN then
  enter through the accumulator instead of a subtraction; the unfolded step passed it too
  before the fold became the default). Two query heads over one kv head (GQA): each head is
  more interpreter work, and no case needs more."""
  import nonfinite_cases

  def mosaic_fn(*args, **kwargs):
    return mosaic.flash_attention_mosaic(*args, **kwargs, interpret=True)

  failures = nonfinite_cases.run_cases(
      mosaic_fn, option_cases=("scale_nan", "soft_cap_with_q_inf", "sink_nan"),
      dtype=jnp.bfloat16, head_dim=64, tol=3e-2,
      params=FlashAttentionParamsConfig(128, 128, 8, 2), heads=(2, 1))
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
  numbers can compare equal (a cleaned-up kernel against a GPU-tested commit); the digest file
  lists the case."""
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
