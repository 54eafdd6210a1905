"""The conformance matrix's generator and checks on the CPU (tests/conformance_cells.py), before
they reach a GPU (tests/gpu/test_conformance.py):

* the generator covers every value of every axis for every registered backend, asks the
  registry for each cell, and splits into disjoint parts;
* the CPU-sized matrix runs for the backends that run here (the JAX backend) through the
  public op and matches the float32 reference; a backend that cannot run here is checked to
  refuse by name;
* the checks catch what they are for: fake backends (registered for the test) that return
  zeros, one wrong row, non-zero padding, NaN, or refuse late, or that the registry refuses;
* (slow) one tiny cell through the Mosaic GPU interpreter.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance_cells as cc
from kvax_plugin.attention import api, kernels
from kvax_plugin.attention.kernels.capabilities import Capabilities
from kvax_plugin.attention.reference import reference_attention


def test_generator_covers_every_axis_value_of_every_backend():
  cells = cc.generate("quick")
  assert len({c.id for c in cells}) == len(cells)
  by_backend: dict[str, list[cc.Cell]] = {}
  for c in cells:
    by_backend.setdefault(c.backend, []).append(c)
  assert set(by_backend) == set(cc.matrix_backends())
  for backend, mine in by_backend.items():
    axes = cc._axes_for(backend, "gpu")
    for axis, values in axes.items():
      for value in values:
        holders = [c for c in mine if _row(c)[axis] == value]
        assert holders, f"{backend}: no cell with {axis}={value!r}"
    for c in mine:
      verdict, why = cc.registry_verdict(c)
      assert verdict == (c.predicted == "accept"), (c.id, why)
      if c.predicted == "refuse":
        assert c.reason and c.reason == why
  # Mosaic's backward 64 x 128 (kvax's Hopper default) in both backward modes, derived from
  # the record's options rather than listed
  mosaic = [c for c in by_backend["mosaic"] if c.blocks == "kvax_h100" and c.predicted == "accept"]
  modes = {dict(c.options)["deterministic_backward"] for c in mosaic}
  assert {True, False} <= modes, modes


def test_full_contains_quick_and_covers_the_risky_pairs():
  quick, full = cc.generate("quick"), cc.generate("full")
  assert {c.id for c in quick} == {c.id for c in full if "quick" in c.sizes}
  for backend in cc.matrix_backends():
    axes = cc._axes_for(backend, "gpu")
    rows = [_row(c) for c in full if c.backend == backend]
    accepted = [_row(c) for c in full if c.backend == backend and c.predicted == "accept"]
    for a, b in cc.RISKY_PAIRS:
      for x in axes[a]:
        for y in axes[b]:
          if any(r[a] == x and r[b] == y for r in accepted):
            continue
          # not run: then refused, in this pair's own cell or in one of its values' cell
          assert any(r[a] == x and r[b] == y for r in rows) or not all(
              any(r[k] == v for r in accepted) for k, v in ((a, x), (b, y))), (backend, a, x, b, y)


def _row(cell: cc.Cell) -> dict:
  row = dict(dtype=cell.dtype, dims=cell.dims, heads=cell.heads, batch=cell.batch,
             length=cell.length, qmode=cell.qmode, mask=cell.mask, logits=cell.logits,
             blocks=cell.blocks, skip_pad=cell.skip_pad)
  row.update({"opt:" + k: v for k, v in cell.options})
  return row


def test_parts_are_disjoint_whole_groups():
  cells = cc.generate("quick")
  parts = [cc.select(cells, f"{k}/3") for k in (1, 2, 3)]
  ids = [c.id for p in parts for c in p]
  assert sorted(ids) == sorted(c.id for c in cells)
  groups = [{c.group for c in p} for p in parts]
  assert not (groups[0] & groups[1]) and not (groups[1] & groups[2])
  assert all(parts)


def test_cpu_matrix_matches_the_reference(tmp_path):
  """The CPU-sized matrix for the backends that run here, and one cell of each backend that
  does not (it must raise BackendUnavailableError naming why)."""
  here = [b for b in cc.matrix_backends() if kernels.availability(b)[0]]
  assert "jax" in here
  cells = cc.generate("cpu", backends=here)
  elsewhere = [b for b in cc.matrix_backends() if b not in here]
  for backend in elsewhere:
    cells.append(cc.generate("cpu", backends=[backend])[0])
  records = [cc.run_cell(c) for c in cells]
  rep = cc.report(records, expected=cells)
  print("\n".join(cc.summary_lines(rep)))
  assert not rep["failures"], rep["failures"]
  statuses = {r["id"]: r["status"] for r in records}
  assert all(statuses[c.id] == cc.PASSED for c in cells if c.backend in here
             and c.predicted == "accept"), statuses
  assert all(statuses[c.id] == cc.UNAVAILABLE for c in cells if c.backend in elsewhere)
  # the report is what scripts/test_gpu.sh writes
  path = tmp_path / "records.jsonl"
  path.write_text("".join(json.dumps(r, default=str) + "\n" for r in records))
  merged = cc.report(cc.read_records([str(path)]))
  json.dumps(merged, default=str)
  for backend in here:
    counts = merged["counts"][backend]
    assert counts["run"] == counts["passed"] > 0, counts


# ----------------------------------------------------------------------------- fake backends

CAPABILITIES = Capabilities()  # what the fake backends below declare: everything


def _reference(query, key, value, q_pos, q_seg, kv_pos, kv_seg, mask, *, scale, logits_soft_cap,
               sinks):
  return reference_attention(query, key, value, q_pos, q_seg, kv_pos, kv_seg,
                             causal=mask.spec.causal, sliding_window=mask.spec.sliding_window,
                             scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks)


def fake_zeros(query, key, value, *args, **kwargs):
  return jnp.zeros(query.shape[:3] + value.shape[3:], query.dtype)


def fake_row_off(*args, **kwargs):
  """One (token, head) row off by 0.35 of the RMS row norm: under the relative L2 tolerance
  (about 0.35 / sqrt(rows)), over the row check's."""
  out = _reference(*args, **kwargs)
  f = out.astype(jnp.float32)
  rms = jnp.sqrt(jnp.mean(jnp.sum(f * f, axis=-1)))
  bump = jax.lax.stop_gradient(0.35 * rms / np.sqrt(out.shape[-1]))
  return (f.at[0, out.shape[1] // 2, 0].add(bump)).astype(out.dtype)


def fake_pad_leak(query, key, value, q_pos, q_seg, *args, **kwargs):
  out = _reference(query, key, value, q_pos, q_seg, *args, **kwargs)
  leak = jnp.where((q_seg == -1)[:, :, None, None], 1e-3, 0.0)
  return (out.astype(jnp.float32) + leak).astype(out.dtype)


def fake_nan(*args, **kwargs):
  out = _reference(*args, **kwargs)
  return out.at[0, 0, 0, 0].set(jnp.nan)


def fake_late_refusal(*args, **kwargs):
  raise ValueError("fake_late_refusal: these inputs are not supported after all")


def fake_refuses_masks(mask):
  return False, "fake: no mask is supported"


_FAKES = {
    "fake_zeros": (dict(function="fake_zeros"), cc.FAILED, "all zero"),
    "fake_row_off": (dict(function="fake_row_off"), cc.FAILED, "worst row"),
    "fake_pad_leak": (dict(function="fake_pad_leak"), cc.FAILED, "padding rows"),
    "fake_nan": (dict(function="fake_nan"), cc.FAILED, "non-finite"),
    "fake_late_refusal": (dict(function="fake_late_refusal"), cc.REFUSED_LATE, "after all"),
    "fake_refused": (dict(function="fake_zeros", mask_check="fake_refuses_masks"), cc.REFUSED,
                     "no mask is supported"),
}


@pytest.fixture
def fake_backends(monkeypatch):
  for name, (fields, _, _) in _FAKES.items():
    monkeypatch.setitem(kernels.KERNEL_BACKENDS, name, kernels.KernelBackend(
        name=name, module=__name__, description="a deliberately wrong backend (test)", **fields))
  names = ("auto",) + tuple(kernels.KERNEL_BACKENDS)
  monkeypatch.setattr(kernels, "BACKENDS", names)
  monkeypatch.setattr(api, "BACKENDS", names)


def test_checks_catch_wrong_backends(fake_backends):
  # bf16 (relative L2 2e-2, rows 0.2), 2 x 77 tokens x 4 heads, padding at the tail
  base = cc.Cell(backend="", dtype="bfloat16", dims=(16, 16), heads=(4, 2), batch=2, length=77,
                 qmode="self", mask="causal", logits="plain", blocks="16x32", skip_pad=True,
                 options=(), layout="pad_tail")
  for name, (_, status, words) in _FAKES.items():
    record = cc.run_cell(cc.dataclasses.replace(base, backend=name))
    text = record.get("error") or record.get("reason") or ""
    assert record["status"] == status and words in text, (name, record)
    if name == "fake_row_off":  # caught by the row check alone
      assert record["errors"]["out"] < cc.TOLERANCE["bfloat16"], record


@pytest.mark.slow
def test_one_cell_in_the_mosaic_interpreter():
  """The smallest Mosaic cell (one 128-token tile, bwd blocks 64 x 128, the fused backward)
  through the Mosaic GPU interpreter: the direct path the CPU uses for a GPU backend."""
  cell = cc.Cell(backend="mosaic", dtype="bfloat16", dims=(64, 64), heads=(1, 1), batch=1,
                 length=128, qmode="self", mask="causal", logits="plain", blocks="kvax_h100",
                 skip_pad=True, options=(("deterministic_backward", False),), layout="pad_middle")
  assert cc.registry_verdict(cell)[0]
  record = cc.run_cell(cell, direct=(("interpret", True),))
  assert record["status"] == cc.PASSED, record


def test_rows_that_vanish_by_cancellation_are_checked_absolutely():
  """A one-token document's query sees one key: its dq (and that key's dk) is 0 in exact
  arithmetic, so rounding noise there must pass (relative L2 over a ~0 reference can reach
  ~1e28) and a real error there must still fail."""
  cell = cc.Cell(backend="jax", dtype="bfloat16", dims=(8, 8), heads=(2, 2), batch=1, length=4,
                 qmode="self", mask="causal", logits="plain", blocks="16x16", skip_pad=True,
                 options=(), layout="one_token_docs")
  pos = np.zeros((1, 4), np.int32)
  seg = np.arange(4, dtype=np.int32)[None]
  rng = np.random.default_rng(0)
  out = rng.normal(size=(1, 4, 2, 8)).astype(np.float32)
  grad_ref = np.full((1, 4, 2, 8), 1e-30, np.float32)
  noise = 1e-3 * rng.normal(size=(1, 4, 2, 8)).astype(np.float32)
  theirs = (out, grad_ref, grad_ref, out)
  problems, errors = cc.check_results(cell, (out, noise, noise, out), theirs, pos, seg, pos, seg)
  assert not problems, problems
  assert errors["dq_cancelled_max"] < 1e-2 and errors["dq"] == 0.0, errors
  wrong = noise.copy()
  wrong[0, 2, 1, 3] = 0.5
  problems, _ = cc.check_results(cell, (out, wrong, noise, out), theirs, pos, seg, pos, seg)
  assert problems and "vanish by cancellation" in problems[0], problems


def test_row_errors_are_scaled_by_the_rows_that_can_be_nonzero():
  """One query against one-token documents (Sq = 1): one key of many is attended, the others'
  dk rows are exactly zero. The row check's scale is the RMS of the attended rows: a 1.5%
  rounding of the one real row passes (scaled over all rows it would read as about 0.22), a 50%
  error there fails, and a nonzero unattended row still fails."""
  cell = cc.Cell(backend="jax", dtype="bfloat16", dims=(8, 8), heads=(2, 2), batch=1, length=384,
                 qmode="self", mask="causal", logits="sinks", blocks="16x16", skip_pad=True,
                 options=(), layout="one_token_docs")
  # With sinks (as in the H200 cell) the sink's logit joins the softmax: no cancellation.
  q_pos, q_seg = np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32)
  kv_pos = np.zeros((1, 384), np.int32)
  kv_seg = np.arange(384, dtype=np.int32)[None]  # the query's document is key 0 alone
  rng = np.random.default_rng(0)
  out = rng.normal(size=(1, 1, 2, 8)).astype(np.float32)
  dk = np.zeros((1, 384, 2, 8), np.float32)
  dk[0, 0] = rng.normal(size=(2, 8))
  dsinks = rng.normal(size=(2,)).astype(np.float32)
  theirs = (out, out, dk, dk, dsinks)

  def check(dk_mine):
    return cc.check_results(cell, (out, out, dk_mine, dk, dsinks), theirs, q_pos, q_seg, kv_pos,
                            kv_seg)

  rounded = dk.copy()
  rounded[0, 0] *= 1.015
  problems, errors = check(rounded)
  assert not problems and errors["dk_row"] < 0.03, (problems, errors)
  assert cc._row_err(rounded, dk, 2) > cc.ROW_FACTOR * cc.TOLERANCE["bfloat16"]  # unscaled
  wrong = dk.copy()
  wrong[0, 0, 1] *= 1.5
  assert check(wrong)[0]
  leaked = rounded.copy()
  leaked[0, 5, 0, 0] = 1e-3
  assert any("no-pair" in p or "dk" in p for p in check(leaked)[0]), check(leaked)


def test_dsinks_is_checked_against_the_magnitude_of_its_terms():
  """dsinks = -sum over rows of p_sink delta: with one query row and one head its terms cancel,
  and the plain relative error measures that cancellation (on fp16 cells it exceeds the 1e-2
  tolerance while out / dq / dk / dv are well within it). The check divides by the terms'
  magnitude instead (the reference's dsinks_scale); a wrong dsinks still fails, and the
  reference's scale is sum |p_sink delta| computed directly."""
  import jax.numpy as jnp
  cell = cc.Cell(backend="jax", dtype="float16", dims=(4, 4), heads=(1, 1), batch=1, length=5,
                 qmode="self", mask="causal", logits="sinks", blocks="16x16", skip_pad=True,
                 options=(), layout="one_doc")
  pos = np.arange(5, dtype=np.int32)[None]
  seg = np.zeros((1, 5), np.int32)
  out = np.ones((1, 5, 1, 4), np.float32)
  theirs = (out, out, out, out, np.array([1e-3], np.float32))
  check = lambda dsinks: cc.check_results(cell, (out, out, out, out, dsinks), theirs, pos, seg,
                                          pos, seg, dsinks_scale=np.array([1.0], np.float32))
  problems, errors = check(np.array([6e-3], np.float32))  # 5x off itself, 0.5% of its terms
  assert not problems and errors["dsinks"] == 5e-3 and errors["dsinks_plain"] > 4, errors
  assert any("dsinks" in p for p in check(np.array([0.5], np.float32))[0])
  # The reference's scale against a direct computation (p_sink = exp(sink - lse)).
  rng = np.random.default_rng(1)
  q, k, v = (rng.standard_normal((1, 5, 2, 4)).astype(np.float32) for _ in range(3))
  cot = rng.standard_normal((1, 5, 2, 4)).astype(np.float32)
  sinks = np.array([0.3, -0.7], np.float32)
  _, reference = cc._programs()
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  *results, scale = reference(*map(jnp.asarray, (q, k, v, sinks, cot)), ints, causal=True,
                              window=None, scale=0.5, cap=None)
  logits = 0.5 * np.einsum("bqhd,bkhd->bhqk", q, k)
  logits = np.where(np.tril(np.ones((5, 5), bool)), logits, -np.inf)
  lse = np.logaddexp(np.logaddexp.reduce(logits, axis=-1), sinks[None, :, None])  # [B, H, Sq]
  p_sink = np.exp(sinks[None, :, None] - lse)
  delta = np.einsum("bqhd,bqhd->bhq", cot, np.asarray(results[0]))
  np.testing.assert_allclose(np.asarray(scale), np.abs(p_sink * delta).sum(axis=(0, 2)),
                             rtol=1e-4)


def test_cells_that_once_failed_stay_in_the_full_matrix():
  """cc.REGRESSIONS: in the full size for every backend, whatever the cover picks, with the ids
  (and so the inputs: the seed comes from the id) of the runs that failed."""
  full = {c.id: c for c in cc.generate("full")}
  for backend in cc.matrix_backends():
    for cell in cc._regression_cells(backend):
      assert "full" in full[cell.id].sizes and full[cell.id].predicted == "accept", cell.id
  # the hopper cell of the unrounded-cotangent regression, id for id
  assert ("hopper-bf16-d128-h8k1-b2-q384kv384-one_token_docs-full-plain-blkdefault-padvisit-"
          "detNone") in full
