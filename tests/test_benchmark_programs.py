"""The benchmark programs run end to end on CPU in their smoke modes, so a GPU session is never
their first run: bench_context_parallel.py --smoke (2 simulated devices, float32, every token
order and both layouts) must agree with one device and write its JSON and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_context_parallel_smoke(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the program sets its own
  done = subprocess.run([sys.executable, "benchmarks/bench_context_parallel.py", "--smoke",
                         "--out_dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads((tmp_path / "context_parallel_cp2_1024.json").read_text())
  assert result["complete"] and result["agree"], result
  assert set(result["layouts"]) == {"one_doc", "packed"}
  for layout in result["layouts"].values():
    assert set(layout["context_parallel"]) == {"natural", "llama3", "balanced"}
    balanced = layout["context_parallel"]["balanced"]["balance"]
    assert balanced["kept_max_over_min"] <= 1.05, balanced
  assert (tmp_path / "context_parallel_cp2_1024.png").stat().st_size > 10_000
