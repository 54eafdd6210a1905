"""The benchmark programs' GPU-independent parts run on CPU, so a GPU session is never their
first run: bench_context_parallel.py --smoke (2 simulated devices, float32, the llama3 and
balanced orders, both layouts, with and without the overlapped k / v collective) must agree with
one device and write its JSON and plot; bench_attention.py's round-robin timing (--interleave) must time every implementation in rotated order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_context_parallel_smoke(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the program sets its own
  done = subprocess.run([sys.executable, "benchmarks/bench_context_parallel.py", "--smoke",
                         "--variant_env", "KVAX_BENCH_SMOKE_HOOK=1", "--overlap", "both",
                         # two orders keep the 4 rows per order (variant x overlap) cheap
                         "--orders", "llama3,balanced",
                         "--out_dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads((tmp_path / "context_parallel_cp2_1024.json").read_text())
  assert result["complete"] and result["agree"], result
  assert set(result["layouts"]) == {"one_doc", "packed"}
  for layout in result["layouts"].values():
    orders = {"llama3", "balanced"}
    # --variant_env and --overlap rows, same run
    rows = orders | {f"{o}+overlap" for o in orders}
    assert set(layout["context_parallel"]) == rows | {f"{r}+KVAX_BENCH_SMOKE_HOOK=1" for r in rows}
    balanced = layout["context_parallel"]["balanced"]["balance"]
    assert balanced["kept_max_over_min"] <= 1.05, balanced
    assert layout["arrangement_alone_ms"] > 0
    gap = layout["context_parallel"]["balanced"]["gap_to_ideal"]
    assert gap["fixed_costs_alone_ms"] > layout["arrangement_alone_ms"]
    single = layout["single_device"]["timing"]["fwd_bwd_ms"]
    cp_ms = layout["context_parallel"]["balanced"]["timing"]["fwd_bwd_ms"]
    assert gap["ideal_ms"] == pytest.approx(single / 2)  # cp = 2 simulated devices
    assert gap["gap_ms"] == pytest.approx(cp_ms - single / 2)
  comm = result["communication_alone"]
  assert comm["all_gather_kv_ms"] > 0 and comm["reduce_scatter_dkv_ms"] > 0
  assert comm["reduce_dtype"] == "float32"  # float32 inputs in the smoke run
  assert (tmp_path / "context_parallel_cp2_1024.png").stat().st_size > 10_000


def test_bench_attention_interleave_times_every_implementation_round_robin():
  import jax.numpy as jnp
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_attention

  calls = []

  def make(name, work):
    def fn(x):
      calls.append(name)
      return jnp.sin(x) * work
    return fn
  x = jnp.ones((64,), jnp.float32)
  rows = {n: dict(ms=1.0) for n in ("a", "b", "c")}
  timed = {"fwd": [(n, make(n, i + 1), 2, rows[n]) for i, n in enumerate(rows)]}
  bench_attention.interleave(timed, (x,), rounds=3, flops_fwd=1e6)
  # round r starts at entry r: a b c | b c a | c a b, each `inner` = 2 calls in a row
  assert calls == [n for n in "aabbcc" "bbccaa" "ccaabb"]
  for n, row in rows.items():
    assert row["interleaved"] and row["ms_sequential"] == 1.0 and len(row["ms_rounds"]) == 3
    assert row["ms"] == sorted(row["ms_rounds"])[1] and row["tflops"] > 0


def test_bench_attention_split_parts_run_in_the_interpreter():
  """bench_attention --split's Mosaic parts (every kernel alone, with the register / tile
  variants the next GPU call times) build and run through Pallas' interpreter, so a GPU call
  never finds a Python error there; the values are interpreter milliseconds, not GPU times."""
  import jax.numpy as jnp
  import numpy as np
  sys.path.insert(0, str(ROOT / "benchmarks"))
  sys.path.insert(0, str(ROOT / "tests"))
  import bench_attention
  import layouts
  from kvax_plugin.attention.api import create_attention_mask

  s = 256
  pos, seg = layouts.packed_documents(np.random.default_rng(0), 1, s, num_docs=3, pad_tail=9)
  mask = create_attention_mask(*(jnp.asarray(x) for x in (pos, seg, pos, seg)),
                               calc_bwd_mask=True)
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, s, 2, 64)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((1, s, 1, 64)), jnp.bfloat16)
  parts = bench_attention.time_parts_mosaic(mask, pos, seg, q, k, k, q, 0.125, 1,
                                            interpret=True)
  expected = {"fwd", "dkv", "dq", "fused_dkv_dq", "dkv_prewait", "dq_prewait",
              "dkv_4stages", "fused_dkv_dq_unpaired_regs240"}
  assert set(parts) == expected
  assert all(isinstance(v, float) and v > 0 for v in parts.values()), parts
