"""benchmarks/gate.py, the speed gate, on CPU: the verdict's arithmetic on made-up medians
(median over rounds, candidate / base, fail above 1 + threshold, the mask build reported but not
gated), and a dry run end to end (--smoke, backend "jax", 2 rounds) against a copy of this
tree's kvax_plugin: each tree's processes import their own kvax_plugin, and the results file
holds the conditions, every round and a ratio for every case. The same for
benchmarks/bisect_commits.py, the gate's timing over several trees."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a package of the repository, not installed
  sys.path.insert(0, str(ROOT))

from benchmarks import bisect_commits, cases, gate, gate_worker  # noqa: E402


def _rounds(**medians):
  """Rounds of medians: name -> list of per-round ms."""
  n = len(next(iter(medians.values())))
  return [{k.replace("__", "/"): v[i] for k, v in medians.items()} for i in range(n)]


def test_verdict_thresholds():
  base = _rounds(c__fwd=[10.0, 10.0, 10.0], c__fwd_bwd=[20.0, 20.0, 20.0], c__mask=[1.0] * 3)
  # 2% slower passes at 3%; 4% slower fails; the mask build, 50% slower, is not gated
  cand = _rounds(c__fwd=[10.2, 10.2, 10.2], c__fwd_bwd=[20.8, 20.8, 20.8], c__mask=[1.5] * 3)
  v = gate.verdict(base, cand, threshold=0.03)
  assert v["cases"]["c/fwd"]["ratio"] == pytest.approx(1.02) and not v["cases"]["c/fwd"]["slower"]
  assert v["cases"]["c/fwd_bwd"]["slower"] and v["failed"] == ["c/fwd_bwd"] and not v["passed"]
  assert v["cases"]["c/mask"]["ratio"] == pytest.approx(1.5) and not v["cases"]["c/mask"]["gated"]
  assert gate.verdict(base, cand, threshold=0.05)["passed"]
  # the median over rounds: one slow round of the candidate (a clock dip) does not fail it
  cand = _rounds(c__fwd=[10.0, 13.0, 10.1], c__fwd_bwd=[19.9, 20.0, 30.0], c__mask=[1.0] * 3)
  v = gate.verdict(base, cand, threshold=0.03)
  assert v["passed"] and v["cases"]["c/fwd"]["candidate_ms"] == pytest.approx(10.1)
  # exactly at the threshold passes; faster always passes
  at = gate.verdict(_rounds(c__fwd=[100.0]), _rounds(c__fwd=[103.0]), threshold=0.03)
  assert at["passed"] and at["cases"]["c/fwd"]["ratio"] == pytest.approx(1.03)
  assert gate.verdict(_rounds(c__fwd=[10.0]), _rounds(c__fwd=[5.0]), 0.0)["passed"]
  assert "FAIL" in gate.table(gate.verdict(base, _rounds(c__fwd=[11.0] * 3,
                                                             c__fwd_bwd=[20.0] * 3,
                                                             c__mask=[1.0] * 3), 0.03))


def test_gate_documents_layout_is_the_specified_one(tmp_path):
  """The documents row: rng = default_rng(0), 11 cuts of 1..S-1001, 12 documents with segment
  ids 0..11 and positions from 0, then 1000 padding tokens (segment -1, positions 0..999)."""
  spec = json.loads(gate.write_spec(tmp_path, "quick", False, "auto", 10).read_text())
  assert [c["name"] for c in spec["cases"]] == ["16k-causal", "16k-docs"]
  assert (spec["heads"], spec["kv_heads"], spec["head_dim"], spec["dtype"]) == (
      32, 8, 128, "bfloat16")
  docs = np.load(spec["cases"][1]["layout"])
  pos, seg = docs["positions"][0], docs["segment_ids"][0]
  s = 16384
  rng = np.random.default_rng(0)
  cuts = sorted(rng.choice(np.arange(1, s - 1000), 11, replace=False))
  bounds = [0, *cuts, s - 1000]
  for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
    assert (seg[a:b] == i).all() and (pos[a:b] == np.arange(b - a)).all()
  assert (seg[s - 1000:] == cases.PAD).all() and (pos[s - 1000:] == np.arange(1000)).all()
  causal = np.load(spec["cases"][0]["layout"])
  assert (causal["positions"][0] == np.arange(s)).all() and (causal["segment_ids"] == 0).all()
  assert [c["name"] for c in json.loads(gate.write_spec(tmp_path, "full", False, "auto", 10)
                                        .read_text())["cases"]][2:] == ["64k-causal", "64k-docs"]
  assert [c["name"] for c in json.loads(gate.write_spec(tmp_path, "long", False, "auto", 10)
                                        .read_text())["cases"]] == ["64k-causal", "64k-docs"]
  # --head-dim replaces only the head dim
  wide = json.loads(gate.write_spec(tmp_path, "quick", False, "auto", 10, 256).read_text())
  assert (wide["heads"], wide["kv_heads"], wide["head_dim"], wide["dtype"]) == (
      32, 8, 256, "bfloat16")
  assert gate.shapes_for(True, 64) == dict(gate.SMOKE_SHAPES, head_dim=64)
  # several head dims: every case at each, named by it, one layout file per case
  many = json.loads(gate.write_spec(tmp_path, "quick", False, "auto", 10, (64, 256)).read_text())
  assert [(c["name"], c["head_dim"]) for c in many["cases"]] == [
      ("16k-causal-d64", 64), ("16k-causal-d256", 256), ("16k-docs-d64", 64),
      ("16k-docs-d256", 256)]
  assert many["cases"][0]["layout"] == many["cases"][1]["layout"]
  assert [c["head_dim"] for c in spec["cases"]] == [128, 128]


def test_gate_worker_times_each_case_at_its_head_dim(tmp_path, monkeypatch):
  """The worker builds q / k / v / dO at the case's head dim (a spec of several head dims)."""
  seen = []

  def fake_attention(q, k, v, *args, **kwargs):
    seen.append((q.shape[-1], k.shape[-1], v.shape[-1], kwargs["scale"]))
    return q

  monkeypatch.setattr(gate_worker.kvax_plugin, "flash_attention", fake_attention)
  spec = json.loads(gate.write_spec(tmp_path, "quick", True, "jax", 1, (64, 128)).read_text())
  spec["warmup"] = 0
  for case in spec["cases"][:2]:
    gate_worker.time_case(spec, case)
  assert {s[:3] for s in seen} == {(64, 64, 64), (128, 128, 128)}
  assert sorted({round(s[3], 6) for s in seen}) == [round(128 ** -0.5, 6), round(64 ** -0.5, 6)]


def test_gate_refuses_bad_head_dims(tmp_path, capsys):
  for bad in ("96", "64,64", "64,x", ""):
    with pytest.raises(SystemExit):
      gate.main(["--base-tree", str(tmp_path), "--smoke", "--head-dims", bad])
    assert "--head-dims" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    gate.main(["--base-tree", str(tmp_path), "--head-dim", "64", "--head-dims", "64,128"])


def _copy_of_this_tree(folder: Path) -> tuple[Path, dict]:
  """A copy of this tree's kvax_plugin under folder, and the environment of a timing run on one
  CPU device."""
  shutil.copytree(ROOT / "kvax_plugin", folder / "kvax_plugin",
                  ignore=shutil.ignore_patterns("__pycache__"))
  env = dict(os.environ, XLA_FLAGS=" ".join(
      f for f in os.environ.get("XLA_FLAGS", "").split()
      if "xla_force_host_platform_device_count" not in f))
  return folder, env


def test_gate_smoke_against_a_copy_of_this_tree(tmp_path):
  base, env = _copy_of_this_tree(tmp_path / "base")
  out = tmp_path / "gate.json"
  # CPU timings of two equal trees differ by noise: a loose threshold
  done = subprocess.run([sys.executable, "-m", "benchmarks.gate", "--base-tree", str(base),
                         "--backend", "jax", "--smoke", "--rounds", "2", "--threshold", "10",
                         "--base-name", "da03dbb (a copy)",
                         "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads(out.read_text())
  keys = {f"256-{c}/{p}" for c in ("causal", "docs") for p in ("mask", "fwd", "fwd_bwd")}
  assert set(result["ratios"]) == keys and all(r > 0 for r in result["ratios"].values())
  assert len(result["rounds"]["base"]) == len(result["rounds"]["candidate"]) == 2
  assert all(set(r) == keys for r in result["rounds"]["base"] + result["rounds"]["candidate"])
  v = result["verdict"]
  assert v["passed"] and not v["failed"]
  assert {k for k, c in v["cases"].items() if c["gated"]} == {k for k in keys if "mask" not in k}
  cond = result["conditions"]
  # each tree's processes imported that tree's kvax_plugin
  assert cond["base"]["kvax_plugin_file"] == str(base / "kvax_plugin" / "__init__.py")
  assert cond["candidate"]["kvax_plugin_file"] == str(ROOT / "kvax_plugin" / "__init__.py")
  assert cond["base"]["commit"].startswith("unknown")
  assert cond["base"]["name"] == "da03dbb (a copy)" and "name" not in cond["candidate"]
  assert cond["gpu"] == "cpu" and cond["jax"] and cond["jaxlib"] and cond["rounds"] == 2
  assert cond["shapes"]["head_dim"] == 32 and cond["smoke"] and cond["threshold"] == 10
  assert "verdict: PASS" in done.stdout and "| 256-docs/fwd_bwd |" in done.stdout
  wall = result["wall_s"]
  assert len(wall["rounds"]["base"]) == 2 and all(s > 0 for s in wall["rounds"]["candidate"])
  assert wall["total"] >= sum(wall["rounds"]["base"]) + sum(wall["rounds"]["candidate"])


def _scripted_gate(tmp_path, monkeypatch, candidate_ms, argv):
  """gate.main with its timing processes replaced: the base's rounds time every case at 1.0 ms,
  the candidate's k-th process (warm-up first) candidate_ms[k] on 256-docs/fwd, 1.0 elsewhere."""
  (tmp_path / "base" / "kvax_plugin").mkdir(parents=True)
  (tmp_path / "base" / "kvax_plugin" / "__init__.py").write_text("")
  keys = [f"256-{c}/{p}" for c in ("causal", "docs") for p in ("mask", "fwd", "fwd_bwd")]
  calls = {"base": 0, "candidate": 0}
  both_warming = threading.Barrier(2, timeout=30)

  def worker(tree, spec, timeout, cache=None, env_extra=None):
    name = "base" if tree == (tmp_path / "base").resolve() else "candidate"
    k = calls[name]
    calls[name] += 1
    warm_up = k == 0
    # the warm-ups run side by side (each waits here for the other), with one timed round and
    # without JAX's preallocation; the rounds as configured
    assert (env_extra == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) == warm_up
    assert json.loads(Path(spec).read_text())["calls"] == (1 if warm_up else 10)
    if warm_up:
      both_warming.wait()
    medians = dict.fromkeys(keys, 1.0)
    if name == "candidate":
      medians["256-docs/fwd"] = candidate_ms[k]
    return dict(medians_ms=medians, platform="cpu", jax="x", jaxlib="x",
                kvax_plugin_file=str(tree / "kvax_plugin" / "__init__.py"))

  monkeypatch.setattr(gate, "run_worker", worker)
  out = tmp_path / "gate.json"
  code = gate.main(["--base-tree", str(tmp_path / "base"), "--smoke", "--out", str(out)] + argv)
  return code, json.loads(out.read_text()), calls


def test_gate_confirms_a_failure_before_its_verdict(tmp_path, monkeypatch):
  """A case slower than the threshold after --rounds is timed again (--confirm-rounds more
  rounds of both trees) and judged over all rounds: one slow process among few passes, a
  slowdown in every round still fails; --confirm-rounds 0 keeps the first verdict."""
  # warm-up, then 3 rounds (one 5% slower: the median of 1.0, 1.05, 1.05 fails), 3 confirming
  code, result, calls = _scripted_gate(tmp_path / "a", monkeypatch,
                                       [1.0, 1.0, 1.05, 1.05, 1.0, 1.0, 1.0], ["--rounds", "3"])
  assert code == 0 and calls == {"base": 7, "candidate": 7}
  assert result["first_verdict"]["failed"] == ["256-docs/fwd"]
  assert result["verdict"]["passed"] and len(result["rounds"]["candidate"]) == 6
  assert result["conditions"]["confirm_rounds"] == 3
  # each process's wall time: both warm-ups, then one entry per round and tree, confirming too
  wall = result["wall_s"]
  assert set(wall["warm_up"]) == {"base", "candidate"} and all(
      s >= 0 for s in wall["warm_up"].values())
  assert len(wall["rounds"]["base"]) == len(wall["rounds"]["candidate"]) == 6
  assert wall["total"] >= max(wall["warm_up"].values())
  code, result, calls = _scripted_gate(tmp_path / "b", monkeypatch, [1.0] + [1.05] * 6,
                                       ["--rounds", "3"])
  assert code == 1 and result["verdict"]["failed"] == ["256-docs/fwd"]
  assert len(result["rounds"]["base"]) == 6
  code, result, calls = _scripted_gate(tmp_path / "c", monkeypatch, [1.0, 1.0, 1.05, 1.05],
                                       ["--rounds", "3", "--confirm-rounds", "0"])
  assert code == 1 and result["first_verdict"] is None and calls["candidate"] == 4
  code, result, calls = _scripted_gate(tmp_path / "d", monkeypatch, [1.0] * 3, ["--rounds", "2"])
  assert code == 0 and result["first_verdict"] is None and calls["candidate"] == 3
  with pytest.raises(SystemExit):
    gate.main(["--base-tree", str(tmp_path / "a" / "base"), "--smoke", "--confirm-rounds", "-1"])


def test_gate_refuses_a_tree_without_kvax_plugin(tmp_path):
  with pytest.raises(SystemExit, match="has no kvax_plugin"):
    gate.main(["--base-tree", str(tmp_path), "--smoke", "--rounds", "1"])


def test_an_extracted_tree_is_not_given_its_enclosing_checkouts_commit(tmp_path):
  from pathlib import Path

  from benchmarks import gate
  root = Path(gate.ROOT)
  inside = root / ".gate" / "describe-test"
  inside.mkdir(parents=True, exist_ok=True)
  try:
    assert gate.describe(inside, None)["commit"].startswith("unknown")
    assert gate.describe(inside, "abc1234")["commit"] == "abc1234"
    head = gate.describe(root, None)["commit"]
    assert len(head) == 40 and all(c in "0123456789abcdef" for c in head)
  finally:
    inside.rmdir()


def test_gate_worker_times_rounds_of_back_to_back_calls():
  """Each timed value is one round's ms per call, a round as many calls as last about 20 ms,
  waited for once at its end (the host's dispatch latency is not what the gate compares)."""
  from benchmarks import gate_worker
  calls = []

  def fn(x):
    calls.append(x)
    return x

  times = gate_worker.round_times(fn, (1,), warmup=3, rounds=4, min_round_ms=1e-6)
  assert len(times) == 4 and all(t >= 0 for t in times)
  assert len(calls) == 3 + 1 + 4  # warm-ups, the call that sizes a round, 4 rounds of 1 call


def test_bisect_summary_is_each_trees_median_over_rounds_against_the_first():
  rounds = {"old": [{"c/fwd": 10.0}, {"c/fwd": 12.0}, {"c/fwd": 11.0}],
            "mid": [{"c/fwd": 11.0}, {"c/fwd": 30.0}, {"c/fwd": 11.0}],
            "new": [{"c/fwd": 9.0}, {"c/fwd": 8.0}, {"c/fwd": 8.5}]}
  cases = bisect_commits.summarize(rounds)
  assert list(cases["c/fwd"]) == ["old", "mid", "new"]
  assert cases["c/fwd"]["old"] == dict(ms=11.0, ratio=1.0)
  assert cases["c/fwd"]["mid"]["ms"] == 11.0  # one slow round does not move the median
  assert cases["c/fwd"]["new"]["ratio"] == pytest.approx(8.5 / 11.0)
  table = bisect_commits.table(cases)
  assert "| c/fwd | 11.000 (1.000) | 11.000 (1.000) | 8.500 (0.773) |" in table


def test_bisect_tree_arguments_are_checked(tmp_path):
  with pytest.raises(Exception, match="expected NAME=PATH"):
    bisect_commits.parse_tree(str(tmp_path))
  with pytest.raises(Exception, match="has no kvax_plugin"):
    bisect_commits.parse_tree(f"x={tmp_path}")
  with pytest.raises(SystemExit):
    bisect_commits.main(["--tree", f"a={ROOT}"])  # one tree: nothing to compare
  with pytest.raises(SystemExit):
    bisect_commits.main(["--tree", f"a={ROOT}", "--tree", f"a={ROOT}"])  # names must differ


def test_bisect_smoke_over_two_trees(tmp_path):
  copy = tmp_path / "copy"
  shutil.copytree(ROOT / "kvax_plugin", copy / "kvax_plugin",
                  ignore=shutil.ignore_patterns("__pycache__"))
  out = tmp_path / "bisect.json"
  env = dict(os.environ, XLA_FLAGS=" ".join(
      f for f in os.environ.get("XLA_FLAGS", "").split()
      if "xla_force_host_platform_device_count" not in f))
  done = subprocess.run([sys.executable, "-m", "benchmarks.bisect_commits",
                         "--tree", f"copy={copy}", "--tree", f"here={ROOT}", "--backend", "jax",
                         "--smoke", "--rounds", "1", "--calls", "2", "--only", "256-docs",
                         "--out", str(out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads(out.read_text())
  keys = {f"256-docs/{p}" for p in ("mask", "fwd", "fwd_bwd")}
  assert set(result["cases"]) == keys
  for per in result["cases"].values():
    assert list(per) == ["copy", "here"] and per["copy"]["ratio"] == 1.0
    assert all(t["ms"] > 0 for t in per.values())
  assert [len(result["rounds"][n]) for n in ("copy", "here")] == [1, 1]
  assert set(result["warmup"]) == {"copy", "here"}
  cond = result["conditions"]
  assert cond["trees"] == {"copy": str(copy), "here": str(ROOT)} and cond["rounds"] == 1
  assert cond["gpu"] == "cpu" and cond["backend"] == "jax" and cond["smoke"]
  assert "| 256-docs/fwd_bwd |" in done.stdout
  bad = subprocess.run([sys.executable, "-m", "benchmarks.bisect_commits",
                        "--tree", f"copy={copy}", "--tree", f"here={ROOT}", "--smoke",
                        "--only", "nope"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert bad.returncode == 2 and "--only ['nope']: not among the cases" in bad.stderr
