"""benchmarks/bisect_commits.py (several trees alternated in one call) on CPU: the summary's
arithmetic on made-up rounds, its argument checks, and a dry run end to end (--smoke, backend
"jax") over this tree and a copy of its kvax_plugin, keeping one case."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a package of the repository, not installed
  sys.path.insert(0, str(ROOT))

from benchmarks import bisect_commits as bisect  # noqa: E402


def test_summary_is_each_trees_median_over_rounds_against_the_first():
  rounds = {"old": [{"c/fwd": 10.0}, {"c/fwd": 12.0}, {"c/fwd": 11.0}],
            "mid": [{"c/fwd": 11.0}, {"c/fwd": 30.0}, {"c/fwd": 11.0}],
            "new": [{"c/fwd": 9.0}, {"c/fwd": 8.0}, {"c/fwd": 8.5}]}
  cases = bisect.summarize(rounds)
  assert list(cases["c/fwd"]) == ["old", "mid", "new"]
  assert cases["c/fwd"]["old"] == dict(ms=11.0, ratio=1.0)
  assert cases["c/fwd"]["mid"]["ms"] == 11.0  # one slow round does not move the median
  assert cases["c/fwd"]["new"]["ratio"] == pytest.approx(8.5 / 11.0)
  assert "| c/fwd | 11.000 (1.000) | 11.000 (1.000) | 8.500 (0.773) |" in bisect.table(cases)


def test_tree_arguments_are_checked(tmp_path):
  with pytest.raises(Exception, match="expected NAME=PATH"):
    bisect.parse_tree(str(tmp_path))
  with pytest.raises(Exception, match="has no kvax_plugin"):
    bisect.parse_tree(f"x={tmp_path}")
  with pytest.raises(SystemExit):
    bisect.main(["--tree", f"a={ROOT}"])  # one tree: nothing to compare
  with pytest.raises(SystemExit):
    bisect.main(["--tree", f"a={ROOT}", "--tree", f"a={ROOT}"])  # names must differ


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
                         "--smoke", "--rounds", "2", "--calls", "2", "--only", "256-docs",
                         "--out", str(out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads(out.read_text())
  keys = {f"256-docs/{p}" for p in ("mask", "fwd", "fwd_bwd")}
  assert set(result["cases"]) == keys
  for per in result["cases"].values():
    assert list(per) == ["copy", "here"] and per["copy"]["ratio"] == 1.0
    assert all(t["ms"] > 0 for t in per.values())
  assert [len(result["rounds"][n]) for n in ("copy", "here")] == [2, 2]
  assert set(result["warmup"]) == {"copy", "here"}
  cond = result["conditions"]
  assert cond["trees"] == {"copy": str(copy), "here": str(ROOT)} and cond["rounds"] == 2
  assert cond["gpu"] == "cpu" and cond["backend"] == "jax" and cond["smoke"]
  assert "| 256-docs/fwd_bwd |" in done.stdout
  bad = subprocess.run([sys.executable, "-m", "benchmarks.bisect_commits",
                        "--tree", f"copy={copy}", "--tree", f"here={ROOT}", "--smoke",
                        "--only", "nope"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert bad.returncode == 2 and "--only ['nope']: not among the cases" in bad.stderr
