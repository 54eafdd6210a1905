"""The benchmark behind the README's tables: our kernels against cuDNN, tokamax and FA3, and
MaxText end to end against MaxText's own GPU kernels, on the GPU it finds.

    python -m benchmarks.run --preset quick     # 16k only, fewer rounds: 5-10 minutes on an H100
    python -m benchmarks.run --preset full      # 16k and 64k, the README's table
    python -m benchmarks.run --preset long      # 128k causal rows against the peers (kernels)
    python -m benchmarks.run --preset smoke     # CPU dry run: tiny shapes, backend "jax"
    python -m benchmarks.run --from benchmarks/results/2026-11-26-h200   # tables + plot again

1. Kernel table (benchmarks/bench_attention.py): B=1, 32 query / 8 kv heads, head dim 128,
   bf16; "causal" = one causal document, "docs" = 12 random-length documents + 1000 padding
   tokens; forward and forward+backward; ours through the public op with backend "auto" (and
   "hopper", "mosaic" by name), cuDNN (jax.nn.dot_product_attention, implementation="cudnn"; it
   takes documents as a dense S x S mask, so only at 16k), tokamax's Mosaic GPU kernel and
   FlashAttention-3 for JAX (fa3: flash-attn3-jax, sm_90 and head dim 128 only, documents as
   separate sequences through its varlen call; "unavailable: <reason>" in the results where it
   cannot run; benchmarks/fa3.py), all in one process, timed round-robin. Effective TFLOP/s
   count only the (q, kv) pairs the mask keeps (forward 4 * H * D per pair, forward+backward 3.5x that), so a kernel that skips
   masked blocks is not credited with work it did not need to do.
2. MaxText table (benchmarks/maxtext_e2e.py): llama3-8b shrunk to 4 layers and a 512-token
   vocabulary, bf16, MaxText's own training loop on the shipped packed corpus, each run a fresh
   process with empty compilation caches; attention=kvax against MaxText's `flash` (tokamax
   Pallas-Triton on a dense segment mask) and `cudnn_flash_jax` (cuDNN; it ignores document
   boundaries), remat_policy=minimal_with_context (MaxText's GPU llama3-8b policy). Skipped,
   with the reason printed, when maxtext is not installed.

Writes results.json (conditions: date, GPU, versions, shapes, rounds, the command), tables.md
and speed.png under benchmarks/results/<date>-<gpu>/ (smoke: outputs/benchmarks/), and prints
the tables in markdown, as the README shows them (benchmarks/results.py).

Modules: cases.py (layouts, kept pairs, inputs), timing.py (rounds, medians, round-robin),
impls.py (the implementations by name), fa3.py (the FA3 peer), bench_attention.py (the kernel
rows), results.py (tables, plots, the results folder), maxtext_e2e.py (the MaxText rows), this
file (the presets and the command). benchmarks/gate.py compares two trees' speed
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import types
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages without install
  sys.path.insert(0, str(ROOT))

from benchmarks import bench_attention, maxtext_e2e  # noqa: E402
from benchmarks.results import gpu_slug, report  # noqa: E402

E2E_FULL = ("16k-long:kvax,16k-long:cudnn_flash_jax,16k-short:kvax,16k-short:flash,"
            "16k-short:cudnn_flash_jax,64k-long:kvax,64k-long:cudnn_flash_jax,"
            "64k-short:kvax,64k-short:flash")
E2E_QUICK = "16k-long:kvax,16k-long:cudnn_flash_jax,16k-short:kvax,16k-short:flash"
MAXTEXT_GPU_REMAT = "remat_policy=minimal_with_context"

# kernels: bench_attention.measure's arguments; e2e: maxtext_e2e.run_matrix's (None: no e2e)
PRESETS = {
    "full": dict(
        kernels=dict(seqs=(16384, 65536), cases=("causal", "docs"), passes=("fwd", "fwd_bwd"),
                     impls=("auto", "hopper", "mosaic", "cudnn", "tokamax_mosaic", "fa3"),
                     heads=32, kv_heads=8, head_dims=((128, 128),), dtype="bfloat16",
                     rounds=15, min_round_ms=20.0, num_docs=12, pad=1000,
                     max_dense_mask_seq=32768),
        e2e=dict(runs=E2E_FULL, steps=6, variant="8b", layers=4, vocab=512,
                 kvax_backend="auto", overrides=(MAXTEXT_GPU_REMAT,), timeout=420)),
    "quick": dict(
        kernels=dict(seqs=(16384,), cases=("causal", "docs"), passes=("fwd", "fwd_bwd"),
                     impls=("auto", "hopper", "mosaic", "cudnn", "tokamax_mosaic", "fa3"),
                     heads=32, kv_heads=8, head_dims=((128, 128),), dtype="bfloat16",
                     rounds=5, min_round_ms=10.0, num_docs=12, pad=1000,
                     max_dense_mask_seq=32768),
        e2e=dict(runs=E2E_QUICK, steps=4, variant="8b", layers=4, vocab=512,
                 kvax_backend="auto", overrides=(MAXTEXT_GPU_REMAT,), timeout=300)),
    # 128k causal rows, kernels only (a 128k forward+backward takes about a second per call,
    # so a few rounds alone rather than interleaved rounds of every backend).
    "long": dict(
        kernels=dict(seqs=(131072,), cases=("causal",), passes=("fwd", "fwd_bwd"),
                     impls=("auto", "cudnn", "tokamax_mosaic", "fa3"),
                     heads=32, kv_heads=8, head_dims=((128, 128),), dtype="bfloat16",
                     rounds=3, min_round_ms=1.0, num_docs=12, pad=1000,
                     max_dense_mask_seq=32768, interleaved=False),
        e2e=None),
    # CPU dry run: every code path of the GPU presets at shapes two cores time in seconds. The
    # peers record why they cannot run; MaxText (when installed) trains its tiny variant.
    "smoke": dict(
        kernels=dict(seqs=(256,), cases=("causal", "docs"), passes=("fwd", "fwd_bwd"),
                     impls=("auto", "jax", "cudnn", "tokamax_mosaic", "fa3"),
                     heads=2, kv_heads=1, head_dims=((32, 32),), dtype="float32",
                     rounds=1, min_round_ms=0.0, num_docs=3, pad=16,
                     max_dense_mask_seq=32768),
        e2e=dict(runs="1k-long:kvax", steps=2, variant="tiny", layers=2, vocab=512,
                 kvax_backend="jax", overrides=(), timeout=300)),
}

def run_e2e(spec: dict, out: Path, keep_runs: bool) -> dict:
  missing = maxtext_e2e.maxtext_missing()
  if missing:
    return {"skipped": missing}
  args = types.SimpleNamespace(
      runs=spec["runs"], steps=spec["steps"], layers=spec["layers"], vocab=spec["vocab"],
      kvax_backend=spec["kvax_backend"], variant=spec["variant"], timeout=spec["timeout"],
      warm=False, profile=False, profile_skip=0, profile_steps=0,
      maxtext_override=list(spec["overrides"]))
  # each run's compilation caches and TensorBoard files are large: outside the results folder
  runs_dir = out / "maxtext_runs" if keep_runs else Path(tempfile.mkdtemp(prefix="kvax-e2e-"))
  try:
    result = maxtext_e2e.run_matrix(args, runs_dir)
  finally:
    if not keep_runs:
      shutil.rmtree(runs_dir, ignore_errors=True)
  return result


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", choices=tuple(PRESETS), default="quick")
  ap.add_argument("--out", help="results folder (default: benchmarks/results/<date>-<gpu>; "
                  "smoke: outputs/benchmarks/<date>-<gpu>-smoke)")
  ap.add_argument("--impls", help="comma-separated kernel implementations instead of the "
                  "preset's (benchmarks/impls.py IMPLS; fa3: benchmarks/fa3.py)")
  ap.add_argument("--no-e2e", action="store_true", help="kernel table only")
  ap.add_argument("--keep-runs", action="store_true",
                  help="keep the MaxText runs' folders (caches, logs) under <out>/maxtext_runs")
  ap.add_argument("--from", dest="saved", metavar="DIR",
                  help="print the tables and redraw the plot of a saved results folder")
  args = ap.parse_args(argv)
  if args.saved:
    result = json.loads((Path(args.saved) / "results.json").read_text())
    print(report(result, Path(args.saved)))
    return result

  bench = bench_attention
  preset = PRESETS[args.preset]
  k = dict(preset["kernels"])
  if args.impls:
    k["impls"] = tuple(args.impls.split(","))
  dtype = jnp.dtype(k.pop("dtype"))
  interleaved = k.pop("interleaved", True)
  dev = jax.devices()[0]
  if args.preset != "smoke" and dev.platform != "gpu":
    print(f"note: no GPU here ({dev.platform}); the GPU rows will record why they cannot run. "
          "--preset smoke is the CPU dry run.", flush=True)
  date = datetime.datetime.now(datetime.timezone.utc)
  slug = gpu_slug(dev.device_kind if dev.platform == "gpu" else dev.platform)
  if args.out:
    out = Path(args.out)
  elif args.preset == "smoke":
    out = ROOT / "outputs" / "benchmarks" / f"{date:%Y-%m-%d}-{slug}-smoke"
  else:  # the long preset's rows beside the full preset's, in their own folder
    out = ROOT / "benchmarks" / "results" / f"{date:%Y-%m-%d}-{slug}"
    if args.preset == "long":
      out = out / "long"
  print(f"device: {dev.device_kind}; preset {args.preset}; results -> {out}", flush=True)
  cond = bench.conditions(heads=k["heads"], kv_heads=k["kv_heads"], dtype=dtype,
                          num_docs=k["num_docs"], pad=k["pad"], rounds=k["rounds"],
                          interleaved=interleaved, argv=["python", "-m", "benchmarks.run"]
                          + list(argv if argv is not None else sys.argv[1:]))
  head_dims = ", ".join(f"{d}" if d == dv else f"{d}/{dv}" for d, dv in k["head_dims"])
  cond.update(preset=args.preset, produced_by=f"python -m benchmarks.run --preset {args.preset}",
              kernel_layout=(f"B=1, {k['heads']} q / {k['kv_heads']} kv heads, head dim "
                             f"{head_dims}, {dtype.name}; docs = {k['num_docs']} documents + "
                             f"{k['pad']} padding"),
              kernel_timing=cond.pop("timing"), kernel_shapes=dict(
                  seqs=list(k["seqs"]), cases=list(k["cases"]), passes=list(k["passes"]),
                  impls=list(k["impls"]), rounds=k["rounds"], min_round_ms=k["min_round_ms"]))

  def save_partial(rows):
    """The finished cases' rows, so that a run cut by a time limit leaves them; the complete
    run overwrites this file."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(
        conditions=dict(cond, partial="cut before the end: the rows of the cases finished"),
        kernels=rows), indent=1))

  kernels = bench.measure(dtype=dtype, interleaved=interleaved, after_case=save_partial, **k)
  result = dict(conditions=cond, kernels=kernels)
  if args.no_e2e or preset["e2e"] is None:
    result["maxtext"] = {"skipped": "--no-e2e" if args.no_e2e else
                         f"preset {args.preset}: kernels only"}
  else:
    e2e = preset["e2e"]
    print(f"MaxText runs: {e2e['runs']}", flush=True)
    result["maxtext"] = run_e2e(e2e, out, args.keep_runs)
    cond["maxtext"] = dict(e2e, note="cold: every run a fresh process with empty caches")
    if result["maxtext"].get("skipped"):
      print(f"MaxText table skipped: {result['maxtext']['skipped']}", flush=True)
  print("\n" + report(result, out), flush=True)
  print(f"wrote {out / 'results.json'}, {out / 'tables.md'}, {out / 'speed.png'}")
  return result


if __name__ == "__main__":
  main()
