"""The benchmark programs' GPU-independent parts run on CPU, so a GPU run is never their first:
`python -m benchmarks.run --preset smoke` (the README's benchmark command, tiny shapes, backend
"jax") must write its results, tables and plot, name why the GPU peers and MaxText did not run,
and redraw a saved results folder; bench_context_parallel.py --smoke (2 simulated devices,
float32, the llama3 and balanced orders, both layouts, with and without the overlapped k / v
collective; 512 tokens) must agree with one device and write its JSON and plot; bench_attention's
round-robin timing must time every implementation in rotated order; maxtext_e2e.py --profile
and tools/profile_e2e.py's kernel categories and per-step sums (on a made-up GPU trace, and on
the tiny MaxText run's CPU trace) must hold."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a package of the repository, not installed
  sys.path.insert(0, str(ROOT))
SAVED = ROOT / "benchmarks" / "results"


def _without_device_count(flags: str) -> str:
  """XLA_FLAGS less conftest's 8 simulated devices (a program that sets its own count gets it);
  conftest's LLVM -O0 stays: these smoke runs are mostly compilation, ~1.5x faster at -O0."""
  return " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)


def test_benchmarks_run_smoke_writes_results_tables_and_plot(tmp_path):
  """The benchmark command's CPU dry run: kernel rows for ours ("auto" resolves to "jax" here),
  the cuDNN peer recorded as not runnable (with the reason), the MaxText part skipped by flag;
  results.json carries the conditions, tables.md the markdown the command prints."""
  # one CPU device, as a user
  env = dict(os.environ, XLA_FLAGS=_without_device_count(os.environ.get("XLA_FLAGS", "")))
  out = tmp_path / "smoke"
  done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--preset", "smoke",
                         "--no-e2e", "--impls", "auto,cudnn", "--out", str(out)], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads((out / "results.json").read_text())
  cond = result["conditions"]
  assert cond["preset"] == "smoke" and cond["gpu"] and cond["date"] and cond["versions"]["jax"]
  assert cond["command"].startswith("python -m benchmarks.run --preset smoke")
  assert cond["kernel_shapes"]["seqs"] == [256] and cond["kernel_shapes"]["impls"] == ["auto",
                                                                                       "cudnn"]
  rows = [r for r in result["kernels"] if r["pass"] in ("fwd", "fwd_bwd")]
  assert {(r["case"], r["pass"]) for r in rows} == {
      (c, p) for c in ("causal", "docs") for p in ("fwd", "fwd_bwd")}
  ours = [r for r in rows if r["impl"] == "auto"]
  assert len(ours) == 4 and all(r["ms"] > 0 and r["tflops"] > 0 for r in ours)
  assert all(r["auto_picked"] == "jax" for r in ours)
  assert all("needs a CUDA GPU" in r["error"] for r in rows if r["impl"] == "cudnn")
  assert result["maxtext"] == {"skipped": "--no-e2e"}
  tables = (out / "tables.md").read_text()
  assert "| 256 causal | fwd+bwd |" in tables and "ours: auto (= jax)" in tables
  assert tables.split("\n")[2] in done.stdout  # the printed table is the written one
  assert (out / "speed.png").stat().st_size > 10_000


def test_benchmarks_run_long_preset_is_kernels_only_and_not_interleaved(tmp_path, monkeypatch):
  """--preset long (128k causal rows on a GPU) at the smoke preset's shapes, in process: no
  MaxText part (said in the results), rounds timed alone (not round-robin), the conditions
  name the preset."""
  from benchmarks import run
  long_kernels = dict(run.PRESETS["long"]["kernels"])
  assert long_kernels["seqs"] == (131072,) and long_kernels["cases"] == ("causal",)
  assert long_kernels["interleaved"] is False and run.PRESETS["long"]["e2e"] is None
  small = dict(run.PRESETS["smoke"]["kernels"], cases=("causal",), interleaved=False)
  monkeypatch.setitem(run.PRESETS, "long", dict(run.PRESETS["long"], kernels=small))
  result = run.main(["--preset", "long", "--impls", "auto", "--out", str(tmp_path / "long")])
  assert result["maxtext"] == {"skipped": "preset long: kernels only"}
  cond = result["conditions"]
  assert cond["preset"] == "long" and "interleaved" not in cond["kernel_timing"]
  ours = [r for r in result["kernels"] if r["impl"] == "auto" and r["pass"] == "fwd_bwd"]
  assert len(ours) == 1 and ours[0]["ms"] > 0 and not ours[0].get("interleaved")
  assert (tmp_path / "long" / "results.json").exists()


def test_benchmarks_run_saves_each_finished_case(tmp_path, monkeypatch):
  """A run cut by a time limit keeps the cases it finished: results.json is written after each
  case (marked partial), and the complete run overwrites it."""
  import pytest
  from benchmarks import bench_attention, run
  measure = bench_attention.measure

  class Cut(Exception):
    pass

  def cut_after_first_case(*, after_case, **kw):
    def save_then_cut(rows):
      after_case(rows)
      raise Cut
    return measure(after_case=save_then_cut, **kw)

  monkeypatch.setattr(bench_attention, "measure", cut_after_first_case)
  with pytest.raises(Cut):
    run.main(["--preset", "smoke", "--no-e2e", "--impls", "auto", "--out", str(tmp_path)])
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["conditions"]["partial"].startswith("cut before the end")
  timed = [r for r in saved["kernels"] if r["impl"] == "auto"]
  assert {(r["case"], r["pass"]) for r in timed} == {("causal", "fwd"), ("causal", "fwd_bwd")}
  assert all(r["ms"] > 0 for r in timed)
  monkeypatch.setattr(bench_attention, "measure", measure)
  result = run.main(["--preset", "smoke", "--no-e2e", "--impls", "auto", "--out", str(tmp_path)])
  saved = json.loads((tmp_path / "results.json").read_text())
  assert "partial" not in saved["conditions"] and saved == json.loads(json.dumps(result))


def test_benchmarks_run_skips_maxtext_with_a_reason(tmp_path, monkeypatch):
  """Without maxtext the MaxText table is skipped, and the reason (how to install it) is what
  the results and the printed table say."""
  import importlib.util
  from benchmarks import maxtext_e2e, results, run
  installed = importlib.util.find_spec("maxtext") is not None
  assert (maxtext_e2e.maxtext_missing() is None) == installed
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  reason = maxtext_e2e.maxtext_missing()
  assert reason.startswith("maxtext is not installed (pip install 'kvax-plugin[maxtext]'")
  result = run.run_e2e(run.PRESETS["smoke"]["e2e"], tmp_path, keep_runs=False)
  assert result == {"skipped": reason} and not list(tmp_path.iterdir())
  assert results.e2e_table(result) == f"MaxText table not run: {reason}"


def test_benchmarks_run_redraws_the_saved_h200_results(tmp_path):
  """--from: the README's H200 numbers printed again from their results folder, and the plot
  redrawn (into a copy, so the repository stays untouched). The saved tables.md has no
  rounds-won counts in the ratio cells: without them the tables are the same."""
  import re
  import shutil
  from benchmarks import run
  saved = SAVED / "2026-11-26-h200"
  shutil.copy(saved / "results.json", tmp_path / "results.json")
  result = run.main(["--from", str(tmp_path)])
  assert result["conditions"]["gpu"] == "NVIDIA H200"
  tables = (tmp_path / "tables.md").read_text()
  counts = re.findall(r"x \((\d+)/(\d+)\)", tables)
  assert counts and all(int(won) <= int(n) and int(n) in (2, 3) for won, n in counts)
  assert re.sub(r"x \(\d+/\d+\)", "x", tables) == (saved / "tables.md").read_text()
  assert "| 0.97x (0/3) | 1.09x (3/3) |" in tables
  assert "| 16k causal | fwd+bwd | 15.30 (503) |" in tables
  assert "| 64k, one document per row | 56.7k | - | 46.9k | 1.21x |" in tables
  assert (tmp_path / "speed.png").stat().st_size > 10_000


def test_readme_speed_table_is_its_results_file():
  """The README's speed table is benchmarks.readme_table's rendering of the results file its
  section links (a run of `benchmarks.run --preset full`), so it cannot drift from the run it
  cites; the plot it shows is that run's."""
  from benchmarks import readme_table
  text = readme_table.README.read_text()
  results = readme_table.cited_results(text)
  assert results.is_file(), results
  assert readme_table.render(text, results) == text, (
      f"python -m benchmarks.readme_table {results.relative_to(ROOT)}")
  start, end = readme_table.speed_section(text)
  plot = results.parent.relative_to(ROOT).as_posix() + "/speed.png"
  assert plot in text[start:end] and (ROOT / plot).is_file()
  assert readme_table.main(["--check"]) == 0


def test_readme_table_rewrites_a_stale_table_and_its_links(tmp_path, capsys):
  """Given another run's results file, the table, the results link and the plot's path change to
  that run's; a stale cell is rewritten; the prose around them is kept. A results file outside
  the repository, which the README could not link, is refused by name."""
  from benchmarks import readme_table
  text = readme_table.README.read_text()
  results = readme_table.cited_results(text)
  start, end = readme_table.speed_section(text)
  first_row = next(line for line in text[start:end].split("\n")
                   if line.startswith("| 16k causal | fwd |"))
  stale = text.replace(first_row, "| 16k causal | fwd | 99.99 (1) | - | - | - | - | - | - |")
  assert stale != text
  assert readme_table.render(stale, results) == text
  readme = tmp_path / "README.md"
  readme.write_text(stale)
  assert readme_table.main(["--check", "--readme", str(readme)]) == 1
  other = SAVED / "2026-11-29-h200" / "quick_fa3" / "results.json"
  assert readme_table.main([str(other), "--readme", str(readme)]) == 0
  new = readme.read_text()
  s, e = readme_table.speed_section(new)
  assert "2026-11-29-h200/quick_fa3/results.json" in new[s:e]
  assert "2026-11-29-h200/quick_fa3/speed.png" in new[s:e]
  assert "full_a70747e" not in new[s:e]
  assert new[:s] == text[:start] and new[e:] == text[end:]
  not_a_run = tmp_path / "results.json"
  not_a_run.write_text('{"rows": []}')
  with pytest.raises(ValueError, match="has no 'kernels' rows"):
    readme_table.render(text, not_a_run)
  outside = tmp_path / "run" / "results.json"  # a run left where the device wrote it
  outside.parent.mkdir()
  outside.write_text(other.read_text())
  readme.write_text(stale)
  with pytest.raises(SystemExit):
    readme_table.main([str(outside), "--readme", str(readme)])
  assert "is outside" in capsys.readouterr().err and readme.read_text() == stale


def test_plot_legends_sit_above_the_bars():
  """The speed plots' legend goes in rows of up to 4 entries above the tallest bar: the axis
  leaves headroom for every row, so the legend covers no bar."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from benchmarks import results
  for entries, rows in ((4, 1), (6, 2)):
    fig, ax = plt.subplots()
    for i in range(entries):
      ax.bar([i], [600.0], label=f"impl {i}")
    results._legend_above_bars(ax, entries)
    assert ax.get_legend() is not None
    assert ax.get_ylim() == (0.0, pytest.approx(600.0 * (1.1 + 0.08 * rows)))
    plt.close(fig)


def test_kernel_table_counts_the_rounds_ours_won_and_keeps_small_gaps_visible():
  """A ratio that two decimals would round to 1.00x shows three; where both rows were timed
  interleaved, the cell adds the rounds in which ours was faster, round i of one row against
  round i of the other."""
  from benchmarks import results
  base = dict(seq=65536, case="causal", head_dim=128, head_dim_v=128, pairs=1.0, tflops=500.0)
  ours = dict(base, impl="auto", ms=209.3, interleaved=True, **{"pass": "fwd_bwd"},
              ms_rounds=[209.0, 210.0, 208.0, 209.3])
  fa3 = dict(base, impl="fa3", ms=208.6, interleaved=True, **{"pass": "fwd_bwd"},
             ms_rounds=[208.0, 211.0, 207.0, 208.6])
  cudnn = dict(base, impl="cudnn", ms=226.9, **{"pass": "fwd_bwd"})  # timed alone: no count
  row = results.kernel_table([ours, fa3, cudnn]).split("\n")[2]
  assert row.endswith("| 1.08x | 0.997x (1/4) |"), row
  assert results.rounds_won(ours, fa3) == (1, 4)
  assert results.rounds_won(ours, dict(fa3, ms_rounds=[1.0])) is None  # counts differ
  assert results.rounds_won(ours, dict(fa3, interleaved=False)) is None
  assert [results._fmt_ratio(r) for r in (1.0, 0.9966, 1.004, 1.006, 20.93)] == [
      "1.00x", "0.997x", "1.004x", "1.01x", "20.93x"]


def test_gpu_names_become_folder_names():
  from benchmarks import results
  assert results.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
  assert results.gpu_slug("NVIDIA H200") == "h200"
  assert results.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"
  assert results.gpu_slug("cpu") == "cpu"


def test_bench_context_parallel_smoke(tmp_path):
  env = dict(os.environ, XLA_FLAGS=_without_device_count(os.environ.get("XLA_FLAGS", "")))
  done = subprocess.run([sys.executable, "benchmarks/bench_context_parallel.py", "--smoke",
                         "--variant_options", "dq_after_dkv=true", "--overlap", "both",
                         # two orders keep the 4 rows per order (variant x overlap) cheap
                         "--orders", "llama3,balanced",
                         "--out_dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads((tmp_path / "context_parallel_cp2_512.json").read_text())
  assert result["complete"] and result["agree"], result
  assert set(result["layouts"]) == {"one_doc", "packed"}
  for layout in result["layouts"].values():
    orders = {"llama3", "balanced"}
    # --variant_options and --overlap rows, same run
    rows = orders | {f"{o}+overlap" for o in orders}
    assert set(layout["context_parallel"]) == rows | {f"{r}+dq_after_dkv=true" for r in rows}
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
  assert (tmp_path / "context_parallel_cp2_512.png").stat().st_size > 10_000


def test_bench_attention_interleave_times_every_implementation_round_robin():
  import jax.numpy as jnp
  from benchmarks import timing

  calls = []

  def make(name, work):
    def fn(x):
      calls.append(name)
      return jnp.sin(x) * work
    return fn
  x = jnp.ones((64,), jnp.float32)
  rows = {n: dict(ms=1.0) for n in ("a", "b", "c")}
  timed = {"fwd": [(n, make(n, i + 1), 2, rows[n]) for i, n in enumerate(rows)]}
  timing.interleave(timed, (x,), rounds=3, flops_fwd=1e6)
  # the first rounds of timing.round_orders(3): a b c | b c a | c a b, `inner` = 2 calls each
  assert calls == [n for n in "aabbcc" "bbccaa" "ccaabb"]
  for n, row in rows.items():
    assert row["interleaved"] and row["ms_sequential"] == 1.0 and len(row["ms_rounds"]) == 3
    assert row["ms"] == sorted(row["ms_rounds"])[1] and row["tflops"] > 0


def test_bench_attention_num_docs_reaches_the_layout_and_the_conditions(tmp_path, monkeypatch,
                                                                        capsys):
  """--num-docs N: the 'docs' rows are measured with N documents, and the saved conditions say
  so; N < 1 is refused by name."""
  from benchmarks import bench_attention
  seen = {}

  def fake_measure(**kw):
    seen.update(kw)
    return []
  monkeypatch.setattr(bench_attention, "measure", fake_measure)
  monkeypatch.setattr(bench_attention, "plot_kernels", lambda *a, **k: None)
  out = tmp_path / "run"
  monkeypatch.setattr(sys, "argv", ["bench_attention", "--seq", "2048", "--cases", "docs",
                                    "--impls", "jax", "--num-docs", "48", "--out", str(out)])
  bench_attention.main()
  assert seen["num_docs"] == 48
  saved = json.loads(out.with_suffix(".json").read_text())
  assert "48 random-length documents" in saved["conditions"]["layout"]
  monkeypatch.setattr(sys, "argv", ["bench_attention", "--num-docs", "0", "--out", str(out)])
  with pytest.raises(SystemExit):
    bench_attention.main()
  assert "--num-docs: expected a positive number of documents, got 0" in capsys.readouterr().err


def test_round_orders_balance_first_place_and_neighbours():
  """Under a power cap a kernel runs faster after one that drew less power, so the round-robin
  must not keep one implementation's predecessor fixed (a rotation does): over a full cycle of
  timing.round_orders every implementation runs first, and right after each other one, equally
  often."""
  import collections

  from benchmarks import timing

  assert timing.round_orders(1, 2) == [[0], [0]]
  assert timing.round_orders(2, 3) == [[0, 1], [1, 0], [0, 1]]
  for n in range(2, 9):
    cycle = n if n % 2 == 0 else 2 * n
    orders = timing.round_orders(n, 3 * cycle)
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert orders[cycle:2 * cycle] == orders[:cycle]
    firsts = collections.Counter(o[0] for o in orders[:cycle])
    assert set(firsts) == set(range(n)) and len(set(firsts.values())) == 1
    after = collections.Counter((a, b) for o in orders[:cycle] for a, b in zip(o, o[1:]))
    assert len(after) == n * (n - 1) and set(after.values()) == {cycle // n}
  # the plain rotation it replaces: 4 implementations, each with one fixed predecessor
  rotation = [[(i + r) % 4 for i in range(4)] for r in range(4)]
  assert len({(a, b) for o in rotation for a, b in zip(o, o[1:])}) == 4
  with pytest.raises(ValueError, match="n >= 1"):
    timing.round_orders(0, 3)


def test_alternate_warms_up_then_runs_the_balanced_orders():
  """timing.alternate (launch_orders, gqa_as_mha, backward_choice): `warmup` untimed calls of
  each, one calibration call of each, then per round one round of each, in the orders of
  timing.round_orders."""
  import jax.numpy as jnp
  from benchmarks import timing

  calls = []

  def make(name):
    def fn(x):
      calls.append(name)
      return jnp.sin(x)
    return fn
  x = jnp.ones((64,), jnp.float32)
  # min_round_ms=0: every round is one call
  times = timing.alternate({n: make(n) for n in "abc"}, (x,), rounds=3, warmup=2,
                           min_round_ms=0.0)
  assert calls == list("aaa" "bbb" "ccc" "abc" "bca" "cab")
  calls.clear()
  timing.alternate({n: make(n) for n in "abcd"}, (x,), rounds=4, warmup=0, min_round_ms=0.0)
  assert calls == list("abcd" "abdc" "bcad" "cdba" "dacb")
  assert set(times) == set("abc") and all(len(t) == 3 and min(t) > 0 for t in times.values())


def test_bench_attention_split_parts_run_in_the_interpreter():
  """bench_attention --split's Mosaic parts (every kernel alone, tools/kernel_parts.py) build
  and run through Pallas' interpreter, so a GPU run never finds a Python error there; the
  values are interpreter milliseconds, not GPU times."""
  import jax.numpy as jnp
  import numpy as np
  sys.path.insert(0, str(ROOT / "tests"))
  import layouts
  from benchmarks.tools import kernel_parts
  from kvax_plugin.attention.api import create_attention_mask

  # One 128-token block: each interpreted kernel call costs ~0.5 s a block, and the kernels'
  # multi-block paths are tests/test_mosaic_interpret.py's; what runs here is this harness.
  s = 128
  pos, seg = layouts.packed_documents(np.random.default_rng(0), 1, s, num_docs=3, pad_tail=9)
  mask = create_attention_mask(*(jnp.asarray(x) for x in (pos, seg, pos, seg)),
                               calc_bwd_mask=True)
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, s, 2, 64)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((1, s, 1, 64)), jnp.bfloat16)
  parts = kernel_parts.time_parts_mosaic(mask, pos, seg, q, k, k, q, 0.125, 1, interpret=True)
  expected = {"fwd", "dkv", "dq", "fused_dkv_dq"}
  assert set(parts) == expected
  assert all(isinstance(v, float) and v > 0 for v in parts.values()), parts


def _profile_e2e():
  from benchmarks.tools import profile_e2e
  return profile_e2e


def test_profile_e2e_categorizes_kernel_names():
  """Made-up kernel names in the forms the GPU gives them, one or more per category."""
  p = _profile_e2e()
  expected = {
      p.ATTN_KVAX: ["entry_mosaic_gpu_kernel", "entry_no_dq_mosaic_gpu_kernel", "attn_fwd_kernel",
                    "attn_bwd_dkv_kernel", "attn_bwd_delta_kernel",
                    "void kvax_sm90::fused_backward_kernel<54>(kvax_sm90::Params)"],
      p.ATTN_CUDNN: ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128",
                     "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)",
                     "fmha_reduce_head", "my_flash_fwd_kernel"],
      p.ATTN_PALLAS: ["pallas_flash_attention_vjp", "pallas_flash_attention_fwd"],
      p.MATMUL: ["nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN", "gemm_fusion_dot_42",
                 "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas",
                 "cutlass3x_sm90_tensorop_s64x128x16gemm_bf16", "dot.3", "dot_fusion.1",
                 "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn"],
      p.COLLECTIVES: ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                      "all-gather-start.1", "reduce-scatter.2"],
      p.MEMCPY: ["MemcpyD2D", "MemcpyH2D", "Memset 3"],
      p.OTHER: ["loop_multiply_fusion", "input_reduce_fusion", "loop_broadcast_fusion_2",
                "wrapped_cosine", "copy_bitcast_fusion.10", "dotted_transpose_fusion"],
  }
  assert set(expected) == set(p.CATEGORIES)
  for category, names in expected.items():
    for name in names:
      assert p.categorize(name) == category, (name, p.categorize(name))


def _gpu_trace(path: Path) -> None:
  """A two-step trace in the layout the CUPTI collector writes: kernels on 'Stream #N(...)'
  lines of /device:GPU:0 (plus a derived 'XLA Ops' line that must not count), MaxText's
  'train' step annotations on the host."""
  from jax.profiler import ProfileData
  names = {1: "entry_mosaic_gpu_kernel", 2: "nvjet_hsh_256x128", 3: "ncclDevKernel_AllGather",
           4: "loop_add_fusion", 5: "fusion.1", 6: "train"}
  ms = 10**9  # ps
  def event(mid, start_ms, dur_ms, stats=""):
    return (f"events {{ metadata_id: {mid} offset_ps: {int(start_ms * ms)} "
            f"duration_ps: {int(dur_ms * ms)} {stats} }}")
  meta = "".join(f'event_metadata {{ key: {k} value {{ id: {k} name: "{n}" }} }} '
                 for k, n in names.items())
  text = (
      'planes { id: 1 name: "/device:GPU:0" '
      f'lines {{ id: 7 name: "Stream #7(Kernel)" timestamp_ns: 5000 '
      f'{event(1, 0, 2)} {event(2, 2, 1)} {event(4, 5, 1)} }} '
      f'lines {{ id: 9 name: "Stream #9(Kernel,Memset)" timestamp_ns: 5000 {event(3, 2.5, 1.5)} }} '
      f'lines {{ id: 100 name: "XLA Ops" timestamp_ns: 5000 {event(5, 0, 6)} }} {meta} }} '
      'planes { id: 2 name: "/host:CPU" '
      f'lines {{ id: 1 name: "python" timestamp_ns: 0 '
      f'{event(6, 0, 3, "stats { metadata_id: 9 int64_value: 3 }")} '
      f'{event(6, 3, 3, "stats { metadata_id: 9 int64_value: 4 }")} }} {meta} '
      'stat_metadata { key: 9 value { id: 9 name: "step_num" } } }')
  path.write_bytes(ProfileData.text_proto_to_serialized_xspace(text))


def test_profile_e2e_sums_gpu_stream_lines_per_step(tmp_path):
  p = _profile_e2e()
  trace = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00" / "host.xplane.pb"
  trace.parent.mkdir(parents=True)
  _gpu_trace(trace)
  s = p.summarize_xplane(tmp_path)  # the directory: finds the newest trace under it
  assert "error" not in s, s
  assert s["xplane"] == str(trace) and s["steps"] == 2 and s["trace_step_nums"] == [3, 4]
  assert list(s["devices"]) == ["/device:GPU:0"]
  assert s["devices"]["/device:GPU:0"]["kernel_lines"] == ["Stream #7(Kernel)",
                                                            "Stream #9(Kernel,Memset)"]
  per = s["per_step_ms"]  # ms per step: the 'XLA Ops' line's 6 ms are not counted
  assert set(per) == set(p.CATEGORIES)
  assert per[p.ATTN_KVAX] == pytest.approx(1.0) and per[p.MATMUL] == pytest.approx(0.5)
  assert per[p.COLLECTIVES] == pytest.approx(0.75) and per[p.OTHER] == pytest.approx(0.5)
  assert per[p.ATTN_CUDNN] == 0 and s["kernel_sum_ms_per_step"] == pytest.approx(2.75)
  # busy: [0, 4] and [5, 6] ms (the all-gather overlaps the matmul); span 6 ms; over 2 steps
  assert s["busy_ms_per_step"] == pytest.approx(2.5) and s["span_ms_per_step"] == pytest.approx(3)
  assert s["idle_ms_per_step"] == pytest.approx(0.5)
  # the all-gather [2.5, 4] ms overlaps the matmul [2, 3]: [3, 4] is exposed, 0.5 ms per step
  assert s["collectives_exposed_ms_per_step"] == pytest.approx(0.5)
  assert [k["name"] for k in s["top_kernels"]][:2] == ["entry_mosaic_gpu_kernel",
                                                       "ncclDevKernel_AllGather"]
  assert p.summarize_xplane(trace, steps=1)["per_step_ms"][p.ATTN_KVAX] == pytest.approx(2.0)
  # Nothing there: an error entry, no exception.
  assert "no .xplane.pb" in p.summarize_xplane(tmp_path / "nothing")["error"]
  # Two runs: the side-by-side table prints the difference per category.
  table = p.format_comparison(["a", "b"], s, p.summarize_xplane(trace, steps=1))
  assert "attention (kvax custom calls)" in table and "-1.000" in table


def test_maxtext_e2e_profile_on_cpu(tmp_path):
  """--profile: MaxText's xplane profiler on one step of the tiny variant; the row keeps its
  usual numbers and gets the profile summary (host XLA ops: no GPU plane on CPU). The fewest
  steps that profile one: step 0 compiles and is skipped, step 1 is profiled; 512 tokens."""
  p = _profile_e2e()
  # conftest's XLA_FLAGS (8 simulated devices, LLVM -O0) would make MaxText's steps ~4x slower
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, "benchmarks/maxtext_e2e.py", "--variant", "tiny",
                         "--runs", "0.5k-long:kvax", "--kvax_backend", "jax", "--steps", "2",
                         "--profile", "--profile_skip", "1", "--profile_steps", "1",
                         "--out_dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads((tmp_path / "e2e.json").read_text())
  assert result["profile"]["steps"] == 1
  row = result["runs"][0]
  assert "error" not in row, row.get("error")
  assert row["tokens_per_s"] > 0 and row["setup_and_compile_s"] > 0
  assert len(row["losses"]) == 2 and row["first_loss"] == row["losses"][0]
  assert result["first_loss_gaps"] == {}  # one run: nothing to compare
  assert all(math.isfinite(x) for x in row["losses"])
  assert "profiler=xplane" in row["command"] and "profiler_steps=1" in row["command"]
  prof = row["profile"]
  assert "error" not in prof, prof
  # MaxText writes <run dir>/tensorboard/plugins/profile/<timestamp>/<host>.xplane.pb
  rel = Path(prof["xplane"]).relative_to(tmp_path / "0.5k-long_kvax")
  assert rel.parts[:3] == ("tensorboard", "plugins", "profile") and rel.name.endswith(".xplane.pb")
  assert prof["steps"] == 1 and prof["trace_step_nums"] == [1]
  assert list(prof["devices"]) == ["/host:CPU"] and "no GPU device plane" in prof["source"]
  assert set(prof["per_step_ms"]) == set(p.CATEGORIES)
  assert prof["events"] > 0 and prof["busy_ms_per_step"] > 0 and prof["span_ms_per_step"] > 0
  assert prof["idle_ms_per_step"] >= 0 and prof["kernel_sum_ms_per_step"] > 0
  assert len(prof["top_kernels"]) == 15 and all(k["ms_per_step"] > 0 for k in prof["top_kernels"])
  assert "jit_train_step" in prof["modules_ms_per_step"]
  assert "busy" in done.stdout and "top kernels" in done.stdout


def test_maxtext_e2e_first_loss_gaps():
  """Runs of one label are compared on their first-step loss: the largest relative gap per
  label, error rows and single runs left out, kvax named with its backend."""
  from benchmarks import maxtext_e2e
  rows = [dict(label="16k-short", attention="kvax", kvax_backend="hopper", first_loss=8.0),
          dict(label="16k-short", attention="flash", kvax_backend=None, first_loss=8.4),
          dict(label="16k-short", attention="dot_product", kvax_backend=None, first_loss=8.0),
          dict(label="64k-short", attention="kvax", kvax_backend="hopper", first_loss=7.0),
          dict(label="64k-short", attention="flash", error="exit 1")]
  gaps = maxtext_e2e.first_loss_gaps(rows)
  assert list(gaps) == ["16k-short"]
  assert gaps["16k-short"]["first_losses"] == {"kvax (hopper)": 8.0, "flash": 8.4,
                                                "dot_product": 8.0}
  assert gaps["16k-short"]["max_relative_gap"] == pytest.approx(0.4 / 8.4)


def test_maxtext_e2e_timeout_is_an_error_row(tmp_path):
  """A run past --timeout becomes a row with an error that names the limit; the sweep goes on
  (before: subprocess.TimeoutExpired ended the whole program and its other runs' results)."""
  import types
  from benchmarks import maxtext_e2e
  args = types.SimpleNamespace(variant="tiny", steps=3, kvax_backend="jax", layers=2, vocab=512,
                               timeout=1, profile=False, warm=False)
  row = maxtext_e2e.run_launcher("1k-long", "kvax", args, tmp_path / "run",
                                 {"jax_cache_dir": str(tmp_path / "jax"),
                                  "TRITON_CACHE_DIR": str(tmp_path / "triton"),
                                  "CUDA_CACHE_PATH": str(tmp_path / "cuda")})
  assert row["error"].startswith("timed out after 1 s (--timeout)"), row
  assert row["wall_s"] >= 1
  # raw MaxText keys given with --maxtext_override reach every run's command line
  args.maxtext_override = ["remat_policy=minimal_with_context"]
  row = maxtext_e2e.run_launcher("1k-long", "kvax", args, tmp_path / "run2",
                                 {"jax_cache_dir": str(tmp_path / "jax"),
                                  "TRITON_CACHE_DIR": str(tmp_path / "triton"),
                                  "CUDA_CACHE_PATH": str(tmp_path / "cuda")})
  assert row["command"].endswith("remat_policy=minimal_with_context"), row["command"]


def test_bench_attention_head_dims_take_a_value_head_dim():
  """--head-dims 192:128 (MLA) times query / key head dim 192 with value head dim 128; a plain
  D means both; anything else is refused by name."""
  from benchmarks import cases
  assert cases.parse_head_dims("128") == (128, 128)
  assert cases.parse_head_dims("192:128") == (192, 128)
  for bad in ("192:", "a", "1:2:3"):
    with pytest.raises(ValueError, match="--head-dims entry"):
      cases.parse_head_dims(bad)


def test_bench_attention_variants_set_kernel_options():
  """--variant 'LABEL=BACKEND:FIELD=VALUE,...' runs one of our backends with
  kvax_plugin.KernelOptions fields (typed from their text); a malformed one is refused by name."""
  from benchmarks import cases, impls
  label, backend, fields = impls.parse_variant(
      "pertile=mosaic:mosaic_forward_grid=per_tile,mosaic_backward_registers=240,dq_after_dkv=true")
  assert (label, backend) == ("pertile", "mosaic")
  assert fields == {"mosaic_forward_grid": "per_tile", "mosaic_backward_registers": 240,
                    "dq_after_dkv": True}
  for bad in ("pertile", "x=cudnn:a=1", "x=mosaic:grid"):
    with pytest.raises(ValueError, match="--variant"):
      impls.parse_variant(bad)
  pos, seg, _ = cases.layout("docs", 256, seed=0, num_docs=3, pad=16)
  fns, _ = impls.make_impls("docs", pos, seg, 0.125, ("jax",), [(label, backend, fields)])
  assert set(fns) == {"jax", "pertile"} and fns["pertile"].kernel_options == fields
  rows = [dict(impl=n, **{"pass": "fwd"}) for n in ("pertile", "cudnn", "jax")]
  assert impls.impl_order(rows) == ["jax", "cudnn", "pertile"]


def test_profile_kernels_summarize_counts_overlaps_once():
  """tools/profile_kernels.summarize on made-up GPU events (us): busy is the union of the
  intervals (two overlapping kernels count once), idle the rest of the span, per-step ms."""
  from benchmarks.tools import profile_kernels
  events = [dict(name="a", ts=0.0, dur=100.0), dict(name="b", ts=50.0, dur=100.0),
            dict(name="a", ts=300.0, dur=100.0)]
  s = profile_kernels.summarize(events, steps=2)
  by = {r["name"]: r for r in s["per_step_ms"]}
  assert by["a"]["ms"] == pytest.approx(0.1) and by["a"]["calls"] == 1
  assert by["b"]["ms"] == pytest.approx(0.05)
  # busy: [0, 150] and [300, 400] us = 250 us over 2 steps; span 400 us
  assert s["busy_ms_per_step"] == pytest.approx(0.125)
  assert s["span_ms_per_step"] == pytest.approx(0.2) and s["events"] == 3


def test_l2_reuse_model_ranks_the_backward_walks():
  """benchmarks/tools/l2_reuse_model.py: an exact replay on one SM, then the 16k rankings behind
  docs/performance.md's L2 paragraph: the snake walk keeps more of the kernel's blocks in L2 at
  no launch tail, the heads-slowest grid keeps nearly all of a causal row's but leaves a 16k
  documents tail, the documents layout keeps a causal row's blocks as it does without the tail,
  and one CTA per query head (FlashAttention-3's order) is the reference."""
  from benchmarks.tools import l2_reuse_model as l2
  two = [(0, 4, [0, 1]), (2, 4, [0, 1])]
  big, one_step = 100 * l2.STEP_BYTES, l2.STEP_BYTES
  # the second CTA finds its four blocks (heads 0, 1 x blocks 2, 3) left by the first
  assert l2.replay(two, 1, big) == dict(hit_rate=4 / 12, steps=12, makespan=12, ideal=12.0,
                                        tail=0.0)
  assert l2.replay(two, 1, one_step)["hit_rate"] == 0.0
  # on two SMs they run side by side: (0, 2) and (0, 3) are read again 2 time units later
  assert l2.replay(two, 2, big)["makespan"] == 8
  # snake: head 1 walks down from block 3, which the cache of two blocks still holds
  walked = list(l2._steps((0, 4, [0, -2])))
  assert walked == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (1, 2), (1, 1), (1, 0)]
  causal, docs = l2.model("causal", 16384, 132, 50.0), l2.model("docs", 16384, 132, 50.0)
  together = "documents_heads_together"
  assert causal[f"{together}/snake"]["hit_rate"] > causal[f"{together}/up"]["hit_rate"] + 0.05
  assert causal["heads_slowest/up"]["hit_rate"] > 0.95
  assert causal["documents/snake"]["hit_rate"] > 0.95  # one document: each head's tiles in turn
  assert causal["per_query_head"]["hit_rate"] > 0.95
  assert docs[f"{together}/snake"]["hit_rate"] >= docs[f"{together}/up"]["hit_rate"]
  assert docs["heads_slowest/up"]["tail"] > 0.15 > 0.05 > docs[f"{together}/up"]["tail"]
  # the documents layout: documents of more pairs than a wave head by head, no more tail
  assert docs["documents/snake"]["hit_rate"] >= docs[f"{together}/snake"]["hit_rate"]
  assert docs["documents/snake"]["tail"] <= docs[f"{together}/snake"]["tail"] + 1e-9
  assert causal[f"{together}/snake"]["tail"] == causal[f"{together}/up"]["tail"]


def test_launch_order_model_shows_the_documents_tail(tmp_path):
  """benchmarks/tools/launch_order_model.py (the model behind the backward's head-interleaved
  launch order): list scheduling reproduces the 16k documents tail of the head-major grid (the
  dk/dv kernel's SMs idle ~25%; Nsight Compute saw 31%) that per-head LPT keeps and the order
  over heads removes, while causal masks have no tail in any order; the program writes its rows."""
  from benchmarks.tools import launch_order_model as lom
  # a long job last leaves the other machine idle; first, the short ones fill around it
  assert lom.makespan([1, 1, 1, 1, 4], 2, 0.0) == 6.0
  assert lom.makespan([4, 1, 1, 1, 1], 2, 0.0) == 4.0
  docs = lom.model(16384, "docs", sms=132, overhead=2.0)
  assert docs["dkv/head_major"]["tail"] > 0.15 and docs["dkv/per_head_lpt"]["tail"] > 0.15
  assert docs["dkv/over_heads"]["tail"] < 0.05 and docs["dq/over_heads"]["tail"] < 0.02
  # documents longest first leaves less tail than plain sequence order (the CUDA backward's two
  # heads-fastest orders; sequence order's L2 locality is outside the model)
  assert docs["dkv/documents"]["tail"] < docs["dkv/sequence"]["tail"]
  causal = lom.model(16384, "causal", sms=132, overhead=2.0)
  assert all(row["tail"] < 0.01 for key, row in causal.items() if not key.startswith("fwd/"))
  # the Triton grids interleave the heads already: no tail worth an order of their own
  assert all(row["tail"] < 0.02 for key, row in docs.items() if key.startswith("triton_"))
  out = tmp_path / "lom.json"
  done = subprocess.run([sys.executable, "-m", "benchmarks.tools.launch_order_model", "--seq", "4096",
                         "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = json.loads(out.read_text())["results"]
  assert {(r["case"], r["kernel"], r["order"]) for r in rows} == {
      (c, k, o) for c in ("causal", "docs") for k in ("dkv", "dq")
      for o in ("head_major", "per_head_lpt", "over_heads")} | {
      (c, "dkv", o) for c in ("causal", "docs") for o in ("sequence", "documents")} | {
      (c, "fwd", o) for c in ("causal", "docs")
      for o in ("round_robin", "round_robin_lpt", "snake", "snake_lpt")} | {
      (c, k, f"grid_{n}_per_sm") for c in ("causal", "docs")
      for k in ("triton_fwd", "triton_dq", "triton_dkv") for n in (1, 2)}
  # the persistent forward's deal: a snake draft in longest-first order has the smallest tail
  assert lom.dealt([4, 3, 2, 1], 2, 0.0, snake=True) == 5.0  # 4+1 | 3+2
  assert lom.dealt([4, 3, 2, 1], 2, 0.0, snake=False) == 6.0  # 4+2 | 3+1
  assert docs["fwd/snake_lpt"]["tail"] < docs["fwd/round_robin"]["tail"]


def test_ptxas_splits_rewrites_setmaxnreg_and_reads_reports():
  """benchmarks/tools/ptxas_splits.py's GPU-free parts: the setmaxnreg values of a PTX are
  found and replaced in order (a wrong count or value is refused), and a ptxas report is read
  the way the offline register search needs (C7507 ignored, C7512 serialized, spills)."""
  from benchmarks.tools import ptxas_splits
  ptx = ("\tsetmaxnreg.inc.sync.aligned.u32 216;\n  mov.u32 %r1, 0;\n"
         "\tsetmaxnreg.dec.sync.aligned.u32 56;\n\tsetmaxnreg.dec.sync.aligned.u32 24;\n")
  assert ptxas_splits.setmaxnreg_values(ptx) == [("inc", 216), ("dec", 56), ("dec", 24)]
  out = ptxas_splits.with_split(ptx, [208, 72, 24])
  assert ptxas_splits.setmaxnreg_values(out) == [("inc", 208), ("dec", 72), ("dec", 24)]
  assert "mov.u32 %r1, 0;" in out
  with pytest.raises(ValueError, match="has 3 setmaxnreg instructions"):
    ptxas_splits.with_split(ptx, [208, 72])
  with pytest.raises(ValueError, match="60 is not a multiple of 8"):
    ptxas_splits.with_split(ptx, [208, 60, 24])
  # The GPU image's ptxas report of the dq-warpgroup kernel at 216 / 56 / 24 (H100).
  report = (SAVED / "2026-11-25-h100" / "ptxas_dq_warpgroup.txt").read_text()
  kernel = report.split("-- entry_1")[1]
  assert ptxas_splits.parse_report(kernel) == {
      "setmaxnreg_ignored": True, "wgmma_serialized": True, "spill_stores": 2342,
      "spill_loads": 2596, "registers": 128}
  clean = ("ptxas info    : Function properties for k\n    0 bytes stack frame, 0 bytes spill "
           "stores, 0 bytes spill loads\nptxas info    : Used 168 registers, used 16 barriers")
  assert ptxas_splits.parse_report(clean) == {
      "setmaxnreg_ignored": False, "wgmma_serialized": False, "spill_stores": 0,
      "spill_loads": 0, "registers": 168}


def test_maxtext_e2e_plots_saved_runs_together(tmp_path):
  """--plot_from: four saved MaxText rows (H100, one device call per run) merged into one
  e2e.json and one plot, kvax named with its backend."""
  saved = SAVED / "2026-11-25-h100" / "maxtext"
  files = sorted(str(p) for p in saved.glob("*/e2e.json"))
  assert len(files) == 4
  done = subprocess.run([sys.executable, "benchmarks/maxtext_e2e.py", "--out_dir", str(tmp_path),
                         "--plot_from", *files], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  merged = json.loads((tmp_path / "e2e.json").read_text())
  rows = {(r["label"], r["attention"], r["kvax_backend"]): r["tokens_per_s"]
          for r in merged["runs"]}
  assert set(rows) == {("16k-long", "kvax", "hopper"), ("16k-long", "cudnn_flash_jax", None),
                       ("64k-long", "kvax", "hopper"), ("64k-long", "cudnn_flash_jax", None)}
  assert rows[("64k-long", "kvax", "hopper")] > rows[("64k-long", "cudnn_flash_jax", None)]
  assert (tmp_path / "e2e.png").stat().st_size > 10_000


def test_bench_with_library_loads_the_given_build_then_runs_the_benchmark(monkeypatch):
  """benchmarks/tools/bench_with_library.py: the library named first is loaded before the
  benchmark (whose own hopper setup then finds it loaded); the other arguments reach
  bench_attention."""
  from benchmarks import bench_attention
  from benchmarks.tools import bench_with_library
  from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward
  calls = []
  monkeypatch.setattr(fused_backward, "load", lambda path: calls.append(("load", path)))
  monkeypatch.setattr(bench_attention, "main", lambda: calls.append(("bench", sys.argv[1:])))
  monkeypatch.setattr(sys, "argv", ["bench_with_library", "x.so", "--seq", "1024"])
  bench_with_library.main()
  assert calls == [("load", "x.so"), ("bench", ["--seq", "1024"])]


def test_ncu_step_finds_the_step_among_set_up_kernels(tmp_path):
  """benchmarks/tools/ncu_step.py on a made-up ncu CSV: with --steps 2 the step is the kernel
  sequence repeated at the end, whatever ran before it (inputs after the last autotuning delay
  included); with --steps 1 everything after the last delay; units read, short kernels dropped."""
  from benchmarks.tools import ncu_step
  header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
            '"Metric Value"')
  def row(i, name, value, unit="ns"):
    return (f'"{i}","1","python3","h","{name}","1","14","(1, 1, 1)","(1, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"')
  kernels = [("RedzoneAllocatorKernelImpl", "24,544", "ns"), ("DelayKernel", "101.2", "ms"),
             ("random_input", "1,406,000", "ns")]
  step = [("fwd", "52,874,000", "ns"), ("tiny_fusion", "2,000", "ns"),
          ("bwd", "168.569", "ms"), ("epilogue", "630.0", "us"),
          ("reduce_head", "155.0", "us"), ("reduce_head", "157.0", "us")]  # a repeat within it
  lines = ["==PROF== Connected to process 1", header]
  lines += [row(i, *k) for i, k in enumerate(kernels + step + step)]
  path = tmp_path / "step.csv"
  path.write_text("\n".join(lines) + "\n")
  two = ncu_step.step_kernels(path, steps=2)
  assert [n for n, _ in two] == ["fwd", "bwd", "epilogue", "reduce_head", "reduce_head"]
  assert [round(ms, 3) for _, ms in two] == [52.874, 168.569, 0.63, 0.155, 0.157]
  one = ncu_step.step_kernels(path, steps=1)  # everything after the delay: inputs and both steps
  assert [n for n, _ in one] == ["random_input"] + 2 * ["fwd", "bwd", "epilogue",
                                                         "reduce_head", "reduce_head"]
  path.write_text("\n".join(lines[:2] + [row(0, "fwd", "1", "s")]) + "\n")
  with pytest.raises(ValueError, match="duration in 's'"):
    ncu_step.step_kernels(path)
  path.write_text("no csv here\n")
  with pytest.raises(ValueError, match="no ncu CSV header"):
    ncu_step.step_kernels(path)


def test_flash_mask_offsets_reads_the_lowered_kernel():
  """benchmarks/tools/flash_mask_offsets.py on the pinned tokamax / jax: MaxText's flash call
  lowers to a Triton kernel whose mask offsets are int32, built from the row stride S (and, with
  more than one row per device, the batch stride S * S) in int32; so offsets up to B * S * S - 1
  wrap past 2^31 - 1 (64k with one row). What docs/integrations.md and the launcher's note cite."""
  from benchmarks.tools import flash_mask_offsets as fmo  # tokamax: the maxtext extra, pinned
  for seq, batch in ((16384, 1), (65536, 1), (32768, 2)):
    found = fmo.mask_offsets(fmo.lower_flash(seq, batch), seq)
    assert found["offset_type"] == "i32" and found["row_stride_seq"], found
    if batch > 1:  # the batch stride, 2^30 here, is an int32 constant too
      assert found["batch_stride_seq_squared"], found


def test_backward_choice_smoke_measures_and_fits(tmp_path):
  """benchmarks/backward_choice.py --smoke (CPU: "jax" and "reference" stand in for the two
  backwards) times every layout round-robin, records each layout's partial share and writes
  its rows; --fit-from refits saved rows without measuring."""
  from benchmarks import backward_choice as bc
  rows, _ = bc.main(["--smoke", "--rounds", "2", "--out", str(tmp_path)])
  saved = json.loads((tmp_path / "backward_choice.json").read_text())
  assert {r["layout"] for r in saved["rows"]} == {"causal", "docs3", "docs12"}
  assert {r["impl"] for r in saved["rows"]} == {"cuda", "mosaic"}
  assert all(r["ms"] > 0 and len(r["ms_rounds"]) == 2 and 0 < r["partial_share"] <= 1
             for r in saved["rows"])
  refit, _ = bc.main(["--fit-from", str(tmp_path / "backward_choice.json"),
                      "--out", str(tmp_path / "again")])
  assert refit == saved["rows"]


def _choice_rows(times, overhead=None):
  """Rows of backward_choice for layouts (share, cuda ms, mosaic ms), and "auto" rows that ran
  the Mosaic backward at (1 + overhead) its time."""
  rows = []
  for i, (share, cuda, mosaic) in enumerate(times):
    for impl, ms in (("cuda", cuda), ("mosaic", mosaic)):
      rows.append(dict(impl=impl, seq=1024, layout=f"l{i}", head_dims=[128, 128],
                       partial_share=share, ms=ms))
    if overhead is not None:
      rows.append(dict(impl="auto", seq=1024, layout=f"l{i}", head_dims=[128, 128],
                       partial_share=share, ms=mosaic * (1 + overhead), auto_backward="mosaic"))
  return rows


def test_backward_choice_fit_takes_the_share_where_mosaic_wins_after_the_choice_cost():
  from benchmarks import backward_choice as bc
  layouts = [(0.01, 10.0, 11.0), (0.2, 5.0, 5.2), (0.5, 3.0, 2.7), (0.9, 1.0, 0.8)]
  assert bc.fit(_choice_rows(layouts)) == [dict(dtype="bfloat16", head_dims=[128, 128],
                                               features=[], mosaic_from_partial_share=0.35)]
  # a 12% cost of choosing on the device leaves the Mosaic backward ahead only at 0.9
  assert bc.by_mask_overhead(_choice_rows(layouts, 0.12)) == pytest.approx(0.12)
  assert bc.fit(_choice_rows(layouts, 0.12))[0]["mosaic_from_partial_share"] == 0.7
  # never ahead: no rule (the CUDA backward always)
  assert bc.fit(_choice_rows([(0.1, 1.0, 1.1), (0.6, 1.0, 1.01)])) == []
