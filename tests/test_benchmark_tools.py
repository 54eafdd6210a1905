"""benchmarks/tools/: every helper is a documented program (a docstring with its command line)
that a test runs, here or in tests/test_benchmark_programs.py / test_fatbin_keep_arch.py; the
ones below are the Nsight Compute readers (on made-up CSVs), the collective bandwidth timer (a
dry run on the simulated CPU devices), ncu_kernels' one step (on CPU, backend "jax") and the
remat clone check (which must say it needs a Hopper GPU rather than fail elsewhere)."""

from __future__ import annotations

import ast
import gzip
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a package of the repository, not installed
  sys.path.insert(0, str(ROOT))
TOOLS = ROOT / "benchmarks" / "tools"
TESTS_OF_TOOLS = ("test_benchmark_tools.py", "test_benchmark_programs.py",
                  "test_fatbin_keep_arch.py")


def test_every_tool_is_documented_and_tested():
  tested = "".join((ROOT / "tests" / name).read_text() for name in TESTS_OF_TOOLS)
  tools = sorted(p for p in TOOLS.iterdir() if p.name != "__init__.py"
                 and (p.suffix == ".py" or p.is_dir()) and p.name != "__pycache__")
  assert len(tools) >= 14, tools
  for tool in tools:
    module = tool / "__init__.py" if tool.is_dir() else tool
    doc = ast.get_docstring(ast.parse(module.read_text())) or ""
    # a usage line: how to run it
    assert f"benchmarks.tools.{tool.stem}" in doc or f"tools/{tool.name}" in doc or (
        "bench_attention.py" in doc and "--split" in doc), f"{tool.name}: no usage in docstring"
    assert f"benchmarks.tools.{tool.stem}" in tested or f"benchmarks/tools/{tool.name}" in tested \
        or f"tools import {tool.stem}" in tested, f"{tool.name}: no test runs it"


def test_ncu_summary_tabulates_launches_by_metric(tmp_path, capsys):
  from benchmarks.tools import ncu_summary
  header = '"ID","Kernel Name","gpu__time_duration.sum","launch__grid_size","dram__bytes.sum"'
  units = '"","","ms","","byte"'
  csv = "\n".join(["==PROF== Connected", header, units,
                   '"0","void kvax_sm90::fused_backward_kernel<54>(kvax_sm90::Params)","1,234.5",'
                   '"132","9"',
                   '"1","entry_mosaic_gpu_kernel","0.5","264","n/a"'])
  path = tmp_path / "ncu_hopper_causal.csv"
  path.write_text(csv + "\n")
  out = tmp_path / "table.md"
  ncu_summary.main([str(path), "--out", str(out)])
  text = out.read_text()
  assert text == capsys.readouterr().out
  lines = text.splitlines()
  assert lines[0] == ("| metric | hopper/causal/0:kvax_sm90::fused_backward_kernel<54> | "
                      "hopper/causal/1:entry |")
  # the default metrics only (dram__bytes.sum is not one), thousands separators dropped
  assert lines[2:] == ["| gpu__time_duration.sum | 1234.5 | 0.5 |",
                       "| launch__grid_size | 132 | 264 |"]
  (tmp_path / "other.csv").write_text("not ncu\n")
  assert ncu_summary.table([tmp_path / "other.csv"], [".*"]) == "no kernel rows found\n"


def test_ncu_sass_summary_counts_opcodes_and_stalls(tmp_path, capsys):
  from benchmarks.tools import ncu_sass_summary as sass
  rows = ['"Kernel: fused_backward_kernel"',
          '"Address","Source","Instructions Executed","Warp Stall Sampling (All Samples)",'
          '"stall_wait","stall_barrier","stall_Not Issued"',
          '"0x10","@!P0 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24","3000000","30","20","1","9"',
          '"0x20","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24","1000000","10","5","0","9"',
          '"0x30","@UP1 BAR.SYNC.DEFER_BLOCKING 0x1, 0x100","500000","60","0","50","9"']
  path = tmp_path / "hopper.sass.csv.gz"
  with gzip.open(path, "wt") as f:
    f.write("\n".join(rows) + "\n")
  s = sass.summarise(path)
  assert s["executed"] == {"HGMMA": 4_000_000, "BAR": 500_000}
  assert s["sampled"] == {"HGMMA": 40, "BAR": 60}
  assert s["stalls"] == {"wait": 25, "barrier": 51}  # "Not Issued" is not a stall reason
  assert sass.main([str(path), "--top", "1"]) == 0
  out = capsys.readouterr().out
  assert "4.5 M warp instructions executed, 100 samples" in out
  assert "executed (M): HGMMA 4.0" in out and "BAR 0.5" not in out.split("samples at")[0]


def test_collective_bandwidth_dry_run_on_simulated_devices(tmp_path):
  """The timer's every collective on conftest's simulated CPU devices, at one small length:
  the bytes moved as NCCL's tests count them and a bandwidth from a positive time."""
  import jax
  from benchmarks.tools import collective_bandwidth as cb
  n = len(jax.devices())
  assert n > 1  # conftest's simulated devices
  out = tmp_path / "c.json"
  result = cb.main(["--out", str(out), "--lengths", "256", "--repeats", "2"])
  assert json.loads(out.read_text()) == result
  rows = result["rows"]
  assert [(r["op"], r["dtype"]) for r in rows] == [("all_gather", "bfloat16"),
                                                   ("psum_scatter", "float32"),
                                                   ("psum_scatter", "bfloat16")]
  assert [r["bytes"] for r in rows] == [256 * 8 * 128 * 2, 256 * 8 * 128 * 4, 256 * 8 * 128 * 2]
  assert all(r["ms"] >= 0 and r["tokens"] == 256 for r in rows)
  assert result["device"] == f"{n} x {jax.devices()[0].device_kind}"


def test_ncu_kernels_runs_one_step_and_refuses_what_cannot_run(monkeypatch, capsys):
  """ncu_kernels compiles and runs one forward+backward (here backend "jax" at a tiny length);
  an implementation that cannot run here is refused with its reason. Importing it turns XLA's
  command buffers off in XLA_FLAGS; monkeypatch puts the variable back afterwards."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  from benchmarks.tools import ncu_kernels
  assert "--xla_gpu_enable_command_buffer=" in os.environ["XLA_FLAGS"]
  ncu_kernels.main(["--impl", "jax", "--case", "causal", "--seq", "128", "--head-dim", "32"])
  assert "ran jax causal 128 x1" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="cuDNN needs a CUDA GPU"):
    ncu_kernels.main(["--impl", "cudnn", "--seq", "128", "--head-dim", "32"])
  with pytest.raises(SystemExit, match="not an implementation"):
    ncu_kernels.main(["--impl", "nope", "--seq", "128", "--head-dim", "32"])


def test_remat_clone_check_says_it_needs_a_hopper_gpu(capsys):
  import jax
  from benchmarks.tools import remat_clone_check
  with pytest.raises(SystemExit) as help_exit:
    remat_clone_check.main(["--help"])
  assert help_exit.value.code == 0 and "--no-barrier" in capsys.readouterr().out
  if any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("a GPU is here: the check itself is tests/gpu/test_remat_gpu.py's")
  with pytest.raises(SystemExit, match="needs the Mosaic GPU backend"):
    remat_clone_check.main([])


def test_launch_orders_patches_what_the_kernels_call():
  """tools/launch_orders.py replaces each kernel wrapper's order function by name: every name
  exists where it is replaced, the replacement is in place only while tracing, and every order
  it compares is a permutation of the launch positions per batch row."""
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.tools import launch_orders as lo
  lower = jnp.asarray([[0, 2, 2, 7], [1, 1, 3, 3]], jnp.int32)
  upper = jnp.asarray([[2, 5, 5, 8], [4, 4, 4, 4]], jnp.int32)
  for kernel, (module, name, orders, backend, _) in lo.KERNELS.items():
    default = getattr(module, name)
    assert backend in ("hopper", "mosaic"), kernel
    for label, order in orders.items():
      with lo.launch_order(module, name, order):
        assert getattr(module, name) is order
      assert getattr(module, name) is default
      if kernel == "hopper_backward":  # 8 tiles (two per table row) x 3 kv heads, coded
        got = np.asarray(order((lower, upper, lower, upper), 8, 3, "documents"))
        got, n = (got >> 20) * 8 + (got & (2**20 - 1)), 24
      elif kernel == "mosaic_backward":
        got, n = order(lower, upper, 1, 4, 3), 12
      else:
        got, n = order(lower, upper, 2, 8), 8
      got = np.asarray(got)
      assert got.shape == (2, n), (kernel, label)
      assert all(sorted(row) == list(range(n)) for row in got.tolist()), (kernel, label)


def test_launch_orders_compiles_each_order_not_the_first_trace_again():
  """Each variant is traced anew with its order in place (JAX's trace cache would otherwise hand
  every variant the first one's program), and variants that lower to the same program are
  refused rather than timed."""
  import types

  import jax
  import jax.numpy as jnp
  import numpy as np
  import pytest

  from benchmarks.tools import launch_orders as lo
  toy = types.ModuleType("toy")
  toy.order = lambda n: jnp.arange(n)
  fn = jax.jit(lambda x: x[toy.order(x.shape[0])])  # one function object for every variant
  x = jnp.arange(5.0)
  fns = lo.compile_variants(lambda: fn, (x,), toy, "order",
                            {"up": lambda n: jnp.arange(n), "down": lambda n: jnp.arange(n)[::-1]})
  np.testing.assert_array_equal(fns["up"](x), [0, 1, 2, 3, 4])
  np.testing.assert_array_equal(fns["down"](x), [4, 3, 2, 1, 0])
  with pytest.raises(RuntimeError, match="identical programs"):
    lo.compile_variants(lambda: fn, (x,), toy, "order",
                        {"a": lambda n: jnp.arange(n), "b": lambda n: jnp.arange(n)})
  with pytest.raises(SystemExit):  # an unknown name is refused before anything is compiled
    lo.main(["--orders", "ascending,sideways"])
  with pytest.raises(SystemExit):
    lo.main(["--orders", "ascending"])
  with pytest.raises(SystemExit):  # --dtype: the kernels' 16-bit types only
    lo.main(["--dtype", "float32"])


def test_launch_orders_times_libraries_through_targets_of_their_own(monkeypatch, tmp_path):
  """--libraries: each build is traced with fused_backward.TARGET set to its own target name,
  which the wrapper reads when it is traced (so two traces call two libraries); specs that name
  no library, or the wrong kernel, are refused before anything is loaded."""
  import jax
  import jax.numpy as jnp
  import pytest

  from benchmarks.tools import launch_orders as lo
  from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as fb
  monkeypatch.setattr(fb, "load", lambda *a, **k: None)
  targets = []

  def fake_ffi_call(target, results):
    targets.append(target)
    return lambda *args, **attrs: tuple(jnp.zeros(r.shape, r.dtype) for r in results)
  monkeypatch.setattr(jax.ffi, "ffi_call", fake_ffi_call)
  b, s, h, kh, d = 1, 256, 4, 2, 128
  x = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  ids, lse = jnp.zeros((b, s), jnp.int32), jnp.zeros((b, h, s), jnp.float32)
  bounds = (jnp.zeros((b, 2), jnp.int32),) * 4
  for name in ("kvax_sm90_fused_backward_base", "kvax_sm90_fused_backward_cand"):
    with lo.launch_order(fb, "TARGET", name):
      fb.fused_backward(x(b, s, h, d), x(b, s, kh, d), x(b, s, kh, d), x(b, s, h, d), lse, lse,
                        ids, ids, ids, ids, bounds, scale=0.1, causal=True)
  # dq's conversion runs the running tree's own library's kernel for every variant.
  assert targets == ["kvax_sm90_fused_backward_base", fb.DQ_TARGET,
                     "kvax_sm90_fused_backward_cand", fb.DQ_TARGET]
  assert fb.TARGET == "kvax_sm90_fused_backward"
  with pytest.raises(ValueError, match="NAME=PATH"):
    lo.library_targets("base")
  with pytest.raises(FileNotFoundError, match="no such file"):
    lo.library_targets(f"base={tmp_path / 'missing.so'}")
  not_a_library = tmp_path / "x.so"
  not_a_library.write_bytes(b"not an ELF file")
  with pytest.raises(OSError):
    lo.library_targets(f"base={not_a_library}")
  with pytest.raises(SystemExit):
    lo.main(["--libraries", f"base={tmp_path / 'missing.so'},cand={tmp_path / 'missing.so'}"])
  with pytest.raises(SystemExit):
    lo.main(["--kernel", "mosaic_forward", "--libraries", "a=x.so,b=y.so"])


def test_launch_orders_passes_window_soft_cap_and_value_head_dim(monkeypatch):
  """launch_orders --window / --soft-cap / --value-head-dim reach the mask and every call (the
  kernel families beyond the plain one), and bad values are refused before any GPU work."""
  import jax
  import kvax_plugin
  from benchmarks.tools import launch_orders as lo
  seen = {}

  def fake_mask(*args, **kwargs):
    seen["mask"] = kwargs
    return None

  def fake_attention(q, k, v, *args, **kwargs):
    seen["call"] = dict(kwargs, q=q.shape, k=k.shape, v=v.shape)
    return q[..., :v.shape[-1]]

  def fake_compile(make, call, module, name, orders):
    jax.eval_shape(make(), *call)
    return dict.fromkeys(orders)

  monkeypatch.setattr(kvax_plugin, "create_attention_mask", fake_mask)
  monkeypatch.setattr(kvax_plugin, "flash_attention", fake_attention)
  monkeypatch.setattr(lo, "compile_variants", fake_compile)
  monkeypatch.setattr(lo, "alternate", lambda fns, call, rounds: {n: [1.0] for n in fns})
  result = lo.main(["--seqs", "1024", "--cases", "causal", "--head-dims", "192",
                    "--value-head-dim", "128", "--window", "256", "--soft-cap", "30",
                    "--orders", "ascending,descending", "--rounds", "1"])
  assert seen["mask"]["sliding_window"] == 256
  assert seen["call"]["logits_soft_cap"] == 30.0
  assert seen["call"]["scale"] == 192 ** -0.5
  assert seen["call"]["q"] == (1, 1024, 32, 192) and seen["call"]["k"] == (1, 1024, 8, 192)
  assert seen["call"]["v"] == (1, 1024, 8, 128)
  assert result["conditions"]["features"] == dict(window=256, soft_cap=30.0)
  assert result["rows"][0]["value_head_dim"] == 128
  lo.main(["--seqs", "1024", "--cases", "causal", "--scale", "-0.1",
           "--orders", "ascending,descending", "--rounds", "1"])
  assert seen["call"]["scale"] == -0.1 and seen["call"]["logits_soft_cap"] is None
  for bad in (["--window", "0"], ["--soft-cap", "-1"], ["--value-head-dim", "0"]):
    with pytest.raises(SystemExit):
      lo.main(bad + ["--orders", "ascending,descending"])


def test_library_targets_load_the_trees_own_library_first(monkeypatch, tmp_path):
  """launch_orders --libraries: fused_backward.load (which registers the running tree's library
  under the module's TARGET) runs before any variant's target is registered, so it is never
  first called while compile_variants has TARGET patched to a variant's name."""
  import ctypes
  import jax
  from benchmarks.tools import launch_orders as lo
  from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as fb
  calls = []
  monkeypatch.setattr(fb, "load", lambda: calls.append(("load", fb.TARGET)))

  class FakeLibrary:
    KvaxSm90FusedBackward = object()
    def __init__(self, path):
      self.path = path
    def KvaxSm90AbiVersion(self):
      return fb.ABI_VERSION
  monkeypatch.setattr(ctypes, "CDLL", FakeLibrary)
  monkeypatch.setattr(jax.ffi, "pycapsule", lambda fn: fn)
  monkeypatch.setattr(jax.ffi, "register_ffi_target",
                      lambda name, fn, platform: calls.append(("register", name)))
  paths = []
  for name in ("a", "b"):
    paths.append(tmp_path / f"{name}.so")
    paths[-1].write_bytes(b"")
  targets = lo.library_targets(f"base={paths[0]},cand={paths[1]}")
  assert targets == {"base": "kvax_sm90_fused_backward_base",
                     "cand": "kvax_sm90_fused_backward_cand"}
  assert calls == [("load", "kvax_sm90_fused_backward"),
                   ("register", "kvax_sm90_fused_backward_base"),
                   ("register", "kvax_sm90_fused_backward_cand")]


def test_gqa_as_mha_computes_the_gqa_gradients():
  """tools/gqa_as_mha.py: the repeated-K / V call and the two half-group calls give the GQA call's
  output, and jax.grad sums the group's dK / dV through the repeat or over the two calls (float32,
  the dense "jax" backend, a small packed row)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import pytest

  import kvax_plugin
  from benchmarks.tools import gqa_as_mha as tool
  b, s, d = 1, 256, 32
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  q = jax.random.normal(keys[0], (b, s, tool.HEADS, d), jnp.float32)
  k, v = (jax.random.normal(x, (b, s, tool.KV_HEADS, d), jnp.float32) for x in keys[1:3])
  cot = jax.random.normal(keys[3], (b, s, tool.HEADS, d), jnp.float32)
  seg = jnp.asarray(np.repeat([0, 1, 2, -1], [100, 1, 120, 35])[None], jnp.int32)
  pos = jnp.asarray(np.concatenate([np.arange(n) for n in (100, 1, 120, 35)])[None], jnp.int32)
  mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  call = (q, k, v, pos, seg, mask)
  variants = tool.variants("jax", cot)
  fwd_gqa, loss_gqa = variants.pop("gqa")
  assert sorted(variants) == ["as_mha", "halves"]
  want = jax.grad(loss_gqa, argnums=(0, 1, 2))(*call)
  for fwd, loss in variants.values():
    np.testing.assert_allclose(fwd(*call), fwd_gqa(*call), rtol=1e-5, atol=1e-5)
    for a, g in zip(want, jax.grad(loss, argnums=(0, 1, 2))(*call)):
      assert a.shape == g.shape and bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0
      np.testing.assert_allclose(g, a, rtol=1e-4, atol=1e-4)
  with pytest.raises(SystemExit):  # a pass it does not time is refused before anything runs
    tool.main(["--passes", "bwd"])
  with pytest.raises(SystemExit):
    tool.main(["--variants", "thirds"])


def test_clocks_power_summarizes_each_implementations_windows():
  """tools/clocks_power.py: nvidia-smi's lines parsed with their own timestamps (lines arrive late
  through the pipe), a line that does not parse dropped; each implementation's samples taken from
  1 s into its own windows only, medians and cycles per call; the GPU sampled is the one
  CUDA_VISIBLE_DEVICES names first (nvidia-smi ignores it)."""
  import datetime
  from benchmarks.tools import clocks_power as cp
  got = cp.parse_sample("2026/11/30 03:58:20.250, 1980, 650.5, 60, 0x0000000000000004")
  assert got == dict(t=datetime.datetime(2026, 11, 30, 3, 58, 20, 250000).timestamp(),
                     sm_clock_mhz=1980.0, power_w=650.5, temperature_c=60.0,
                     throttle="0x0000000000000004")
  assert cp.parse_sample("2026/11/30 03:58:20.250, [N/A], 650.5, 60, 0x0") is None
  assert cp.parse_sample("1980, 650.5, 60, 0x0") is None
  windows = [dict(impl="auto", t0=0.0, t1=4.0, ms=200.0),
             dict(impl="fa3", t0=5.0, t1=9.0, ms=198.0),
             dict(impl="fa3", t0=10.0, t1=14.0, ms=202.0),
             dict(impl="auto", t0=15.0, t1=19.0, ms=210.0)]
  at = lambda t, clock, power: dict(t=t, sm_clock_mhz=clock, power_w=power, temperature_c=50.0,
                                    throttle="0x4")
  samples = ([at(0.5, 1000, 100)]  # settling: dropped
             + [at(t, 1800, 650) for t in (1.5, 2.0, 3.0, 16.5, 18.0)]
             + [at(t, 1700, 550) for t in (6.5, 7.0, 11.5)]
             + [at(4.5, 500, 80)])  # between windows
  got = cp.summarize(windows, samples)
  assert got["auto"] == dict(ms=205.0, sm_clock_mhz=1800.0, power_w=650.0, throttle=["0x4"],
                             sm_clock_mhz_mean=1800.0,
                             samples=5, mcycles_per_call=205.0 * 1800.0 / 1e3,
                             joules_per_call=205.0 * 650.0 / 1e3)
  assert got["fa3"]["ms"] == 200.0 and got["fa3"]["samples"] == 3
  assert got["fa3"]["sm_clock_mhz"] == 1700.0 and got["fa3"]["mcycles_per_call"] == 340.0
  assert got["fa3"]["sm_clock_mhz_mean"] == 1700.0
  # --gap-s: one call per window, every sample inside it kept (the settling one too).
  idle_gaps = cp.summarize(windows, samples, settle_s=0.0)["auto"]
  assert idle_gaps["samples"] == 6 and idle_gaps["sm_clock_mhz_mean"] == (1000 + 5 * 1800) / 6
  assert cp.gpu_index("1") == 1 and cp.gpu_index("1,0") == 1 and cp.gpu_index(None) == 0
  with pytest.raises(ValueError, match="gpu-index"):
    cp.gpu_index("GPU-3f2a")
  with pytest.raises(SystemExit):
    cp.main(["--window-s", "0.5"])
  with pytest.raises(SystemExit):
    cp.main(["--pass", "dq"])
  with pytest.raises(SystemExit):
    cp.main(["--gap-s", "0"])


def test_one_pass_runs_the_forward_or_the_backward_alone():
  """benchmarks.timing.one_pass: "fwd" is fn itself; "bwd" is the gradient that fwd_bwd computes
  (grad of sum(fn * cot)), from residuals taken once, and "fwd_bwd" is fwd_bwd; anything else is
  refused."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from benchmarks.timing import fwd_bwd, one_pass
  fn = lambda q, k, v: jnp.tanh(q @ k.T) @ v
  q, k, v, cot = (jax.random.normal(jax.random.key(i), (5, 3)) for i in range(4))
  np.testing.assert_allclose(one_pass(fn, cot, "fwd", q, k, v)(q, k, v), fn(q, k, v), rtol=1e-6)
  want = fwd_bwd(fn, cot)(q, k, v)
  for which in ("bwd", "fwd_bwd"):
    for got, w in zip(one_pass(fn, cot, which, q, k, v)(q, k, v), want):
      assert bool(jnp.all(jnp.isfinite(got))) and float(jnp.abs(got).max()) > 0
      np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="which"):
    one_pass(fn, cot, "dq", q, k, v)
