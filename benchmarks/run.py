"""The benchmark behind the README's tables: our kernels against cuDNN and tokamax, and MaxText
end to end against MaxText's own GPU kernels, on the GPU it finds.

    python -m benchmarks.run --preset quick     # 16k only, fewer rounds: 5-10 minutes on an H100
    python -m benchmarks.run --preset full      # 16k and 64k, the README's table
    python -m benchmarks.run --preset long      # 128k causal rows against the peers (kernels)
    python -m benchmarks.run --preset smoke     # CPU dry run: tiny shapes, backend "jax"
    python -m benchmarks.run --from benchmarks/results/2026-11-26-h200   # tables + plot again

1. Kernel table (benchmarks/bench_attention.py): B=1, 32 query / 8 kv heads, head dim 128,
   bf16; "causal" = one causal document, "docs" = 12 random-length documents + 1000 padding
   tokens; forward and forward+backward; ours through the public op with backend "auto" (and
   "hopper", "mosaic" by name), cuDNN (jax.nn.dot_product_attention, implementation="cudnn"; it
   takes documents as a dense S x S mask, so only at 16k) and tokamax's Mosaic GPU kernel, all
   in one process, timed round-robin. Effective TFLOP/s count only the (q, kv) pairs the mask
   keeps (forward 4 * H * D per pair, forward+backward 3.5x that), so a kernel that skips
   masked blocks is not credited with work it did not need to do.
2. MaxText table (benchmarks/maxtext_e2e.py): llama3-8b shrunk to 4 layers and a 512-token
   vocabulary, bf16, MaxText's own training loop on the shipped packed corpus, each run a fresh
   process with empty compilation caches; attention=kvax against MaxText's `flash` (tokamax
   Pallas-Triton on a dense segment mask) and `cudnn_flash_jax` (cuDNN; it ignores document
   boundaries), remat_policy=minimal_with_context (MaxText's GPU llama3-8b policy). Skipped,
   with the reason printed, when maxtext is not installed.

Writes results.json (conditions: date, GPU, versions, shapes, rounds, the command), tables.md
and speed.png under benchmarks/results/<date>-<gpu>/ (smoke: outputs/benchmarks/), and prints
the tables in markdown, as the README shows them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

E2E_FULL = ("16k-long:kvax,16k-long:cudnn_flash_jax,16k-short:kvax,16k-short:flash,"
            "16k-short:cudnn_flash_jax,64k-long:kvax,64k-long:cudnn_flash_jax,"
            "64k-short:kvax,64k-short:flash")
E2E_QUICK = "16k-long:kvax,16k-long:cudnn_flash_jax,16k-short:kvax,16k-short:flash"
MAXTEXT_GPU_REMAT = "remat_policy=minimal_with_context"

# kernels: bench_attention.measure's arguments; e2e: maxtext_e2e.run_matrix's (None: no e2e)
PRESETS = {
    "full": dict(
        kernels=dict(seqs=(16384, 65536), cases=("causal", "docs"), passes=("fwd", "fwd_bwd"),
                     impls=("auto", "hopper", "mosaic", "cudnn", "tokamax_mosaic"),
                     heads=32, kv_heads=8, head_dims=((128, 128),), dtype="bfloat16",
                     rounds=15, min_round_ms=20.0, num_docs=12, pad=1000,
                     max_dense_mask_seq=32768),
        e2e=dict(runs=E2E_FULL, steps=6, variant="8b", layers=4, vocab=512,
                 kvax_backend="auto", overrides=(MAXTEXT_GPU_REMAT,), timeout=420)),
    "quick": dict(
        kernels=dict(seqs=(16384,), cases=("causal", "docs"), passes=("fwd", "fwd_bwd"),
                     impls=("auto", "hopper", "mosaic", "cudnn", "tokamax_mosaic"),
                     heads=32, kv_heads=8, head_dims=((128, 128),), dtype="bfloat16",
                     rounds=5, min_round_ms=10.0, num_docs=12, pad=1000,
                     max_dense_mask_seq=32768),
        e2e=dict(runs=E2E_QUICK, steps=4, variant="8b", layers=4, vocab=512,
                 kvax_backend="auto", overrides=(MAXTEXT_GPU_REMAT,), timeout=300)),
    # 128k causal rows, kernels only (a 128k forward+backward takes about a second per call,
    # so a few rounds alone rather than interleaved rounds of every backend).
    "long": dict(
        kernels=dict(seqs=(131072,), cases=("causal",), passes=("fwd", "fwd_bwd"),
                     impls=("auto", "cudnn", "tokamax_mosaic"),
                     heads=32, kv_heads=8, head_dims=((128, 128),), dtype="bfloat16",
                     rounds=3, min_round_ms=1.0, num_docs=12, pad=1000,
                     max_dense_mask_seq=32768, interleaved=False),
        e2e=None),
    # CPU dry run: every code path of the GPU presets at shapes two cores time in seconds. The
    # peers record why they cannot run; MaxText (when installed) trains its tiny variant.
    "smoke": dict(
        kernels=dict(seqs=(256,), cases=("causal", "docs"), passes=("fwd", "fwd_bwd"),
                     impls=("auto", "jax", "cudnn", "tokamax_mosaic"),
                     heads=2, kv_heads=1, head_dims=((32, 32),), dtype="float32",
                     rounds=1, min_round_ms=0.0, num_docs=3, pad=16,
                     max_dense_mask_seq=32768),
        e2e=dict(runs="1k-long:kvax", steps=2, variant="tiny", layers=2, vocab=512,
                 kvax_backend="jax", overrides=(), timeout=300)),
}

PEER_NAMES = {"cudnn": "cuDNN", "tokamax_mosaic": "tokamax Mosaic",
              "tokamax_triton": "tokamax Pallas-Triton"}
E2E_NAMES = {"flash": "MaxText flash", "cudnn_flash_jax": "cudnn_flash_jax",
             "dot_product": "dot_product"}


def gpu_slug(device_kind: str) -> str:
  """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200', 'cpu' -> 'cpu'."""
  m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", device_kind)
  return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", device_kind).strip("-")).lower()


def impl_label(name: str, rows=()) -> str:
  if name == "auto":
    picked = next((r.get("auto_picked") for r in rows if r.get("auto_picked")), None)
    return f"ours: auto (= {picked})" if picked else "ours: auto"
  options = next((r.get("kernel_options") for r in rows if r["impl"] == name
                  and r.get("kernel_options")), None)
  if options:
    return f"ours: {name} (" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")"
  return PEER_NAMES.get(name, f"ours: {name}")


def _fmt_ms(ms):
  return "-" if ms is None else (f"{ms:.1f}" if ms >= 100 else f"{ms:.2f}")


def _fmt_tflops(tf):
  return f"{tf:.0f}" if tf >= 10 else f"{tf:.2g}"


def _fmt_seq(seq):
  return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def kernel_table(rows) -> str:
  """Markdown: one line per (length, case, head dims, pass); ms (effective TFLOP/s) per
  implementation, then ours against cuDNN and tokamax (their ms / ours: > 1 = ours faster), ours
  being the row's first of auto, hopper, mosaic, triton, jax that has a time."""
  from benchmarks.bench_attention import impl_order
  timed = [r for r in rows if r.get("pass") in ("fwd", "fwd_bwd")]
  impls = impl_order(timed)
  ours = [n for n in ("auto", "hopper", "mosaic", "triton", "jax") if n in impls]
  peers = [n for n in ("cudnn", "tokamax_mosaic") if n in impls]
  head = ["case", "pass"] + [impl_label(n, timed) for n in impls]
  head += [f"ours vs {PEER_NAMES[p]}" for p in peers] if ours else []
  lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
  keys = sorted({(r["seq"], r["case"], r["head_dim"], r["head_dim_v"], r["pass"])
                 for r in timed}, key=lambda k: (k[2], k[0], k[1] != "causal", k[4]))
  dims = {(k[2], k[3]) for k in keys}
  for seq, case, d, dv, p in keys:
    get = lambda n: next((r for r in timed if r["impl"] == n and (
        r["seq"], r["case"], r["head_dim"], r["head_dim_v"], r["pass"]) == (seq, case, d, dv, p)),
        {})
    cells = []
    for n in impls:
      r = get(n)
      cells.append(f"{_fmt_ms(r['ms'])} ({_fmt_tflops(r['tflops'])})" if r.get("ms") else "-")
    mine = next((get(n)["ms"] for n in ours if get(n).get("ms")), None)
    for peer in peers:
      theirs = get(peer).get("ms")
      cells.append(f"{theirs / mine:.2f}x" if mine and theirs else "-")
    name = {"causal": "causal", "docs": "documents"}.get(case, case)
    label = f"{_fmt_seq(seq)} {name}" + (f", D {d}/{dv}" if len(dims) > 1 else "")
    lines.append("| " + " | ".join([label, {"fwd": "fwd", "fwd_bwd": "fwd+bwd"}[p]] + cells)
                 + " |")
  return "\n".join(lines)


def e2e_table(result) -> str:
  """Markdown: tokens/s per row layout, kvax against MaxText's kernels (> 1 = kvax faster)."""
  if not result or result.get("skipped"):
    return f"MaxText table not run: {result.get('skipped') if result else 'no result'}"
  runs = result["runs"]
  labels = sorted({r["label"] for r in runs}, key=lambda x: (int(x.split("k")[0]), x))
  others = [a for a in ("flash", "cudnn_flash_jax", "dot_product")
            if any(r["attention"] == a for r in runs)]
  backend = next((r.get("backend_ran") or r.get("kvax_backend") for r in runs
                  if r["attention"] == "kvax"), None)
  head = ["rows", f"kvax ({backend})" if backend else "kvax"] + [E2E_NAMES[a] for a in others]
  head.append("kvax vs the best of them")
  lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
  for label in labels:
    get = lambda a: next((r for r in runs if r["label"] == label and r["attention"] == a), {})
    kvax = get("kvax")
    tps = lambda r: r.get("tokens_per_s")
    cell = lambda r: (f"{tps(r) / 1e3:.1f}k" if tps(r) else
                      ("failed" if r.get("error") else "-"))
    cells = [cell(kvax)] + [cell(get(a)) for a in others]
    best = max((tps(get(a)) for a in others if tps(get(a))), default=None)
    cells.append(f"{tps(kvax) / best:.2f}x" if tps(kvax) and best else "-")
    length, layout = label.split("-")
    docs = kvax.get("documents_per_row")
    what = ("one document per row" if layout == "long" else
            f"short documents (~{docs:.0f} per row)" if isinstance(docs, (int, float))
            else "short documents")
    lines.append(f"| {length}, {what} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(result, path: Path) -> None:
  """speed.png: effective TFLOP/s of the kernel rows (left) and MaxText tokens/s (right)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  from benchmarks.bench_attention import impl_order
  cond = result["conditions"]
  rows = [r for r in result["kernels"] if r.get("tflops")]
  e2e = result.get("maxtext") or {}
  e2e_runs = [r for r in e2e.get("runs", []) if r.get("tokens_per_s")]
  fig, axes = plt.subplots(1, 2 if e2e_runs else 1, figsize=(13 if e2e_runs else 8, 4.6),
                           gridspec_kw={"width_ratios": [3, 2]} if e2e_runs else None,
                           squeeze=False)
  ax = axes[0][0]
  groups = sorted({(r["seq"], r["case"], r["pass"]) for r in rows},
                  key=lambda g: (g[2] != "fwd_bwd", g[0], g[1] != "causal"))
  impls = impl_order(rows)
  width = 0.8 / max(1, len(impls))
  for i, name in enumerate(impls):
    vals = [next((r["tflops"] for r in rows if (r["seq"], r["case"], r["pass"]) == g
                  and r["impl"] == name), 0.0) for g in groups]
    ax.bar(np.arange(len(groups)) + (i - (len(impls) - 1) / 2) * width, vals, width,
           label=impl_label(name, rows))
  ax.set_xticks(np.arange(len(groups)),
                [f"{_fmt_seq(s)} {'docs' if c == 'docs' else c}\n"
                 f"{'fwd+bwd' if p == 'fwd_bwd' else 'fwd'}" for s, c, p in groups], fontsize=8)
  ax.set_ylabel("effective TFLOP/s (kept (q, kv) pairs only)")
  ax.set_title("attention kernels: " + cond.get("kernel_layout", ""), fontsize=9)
  ax.legend(fontsize=8)
  if e2e_runs:
    ax = axes[0][1]
    labels = sorted({r["label"] for r in e2e_runs}, key=lambda x: (int(x.split("k")[0]), x))
    atts = [a for a in ("kvax", "flash", "cudnn_flash_jax", "dot_product")
            if any(r["attention"] == a for r in e2e_runs)]
    width = 0.8 / len(atts)
    for i, att in enumerate(atts):
      vals = [next((r["tokens_per_s"] / 1e3 for r in e2e_runs
                    if r["label"] == lab and r["attention"] == att), 0.0) for lab in labels]
      backend = next((r.get("backend_ran") or r.get("kvax_backend") for r in e2e_runs
                      if r["attention"] == att), None) if att == "kvax" else None
      ax.bar(np.arange(len(labels)) + (i - (len(atts) - 1) / 2) * width, vals, width,
             label=f"kvax ({backend})" if backend else E2E_NAMES.get(att, att))
    ax.set_xticks(np.arange(len(labels)),
                  [lab.replace("-long", "\none doc / row").replace("-short", "\nshort docs")
                   for lab in labels], fontsize=8)
    ax.set_ylabel("MaxText training, real tokens/s (thousands)")
    ax.set_title("MaxText llama3-8b (4 layers), one GPU", fontsize=9)
    ax.legend(fontsize=8)
  fig.suptitle(f"kvax-plugin on {cond.get('gpu')}, {cond.get('date', '')[:10]} "
               f"({cond.get('produced_by', 'python -m benchmarks.run')})", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def report(result, out: Path) -> str:
  """Writes results.json, tables.md and speed.png under `out`; returns the tables."""
  out.mkdir(parents=True, exist_ok=True)
  cond = result["conditions"]
  text = (f"Kernels, {cond.get('gpu')}, {cond.get('date', '')[:10]}: ms (effective TFLOP/s); "
          f"{cond.get('kernel_layout', '')}; {cond.get('kernel_timing', '')}\n\n"
          + kernel_table(result["kernels"]) + "\n\nMaxText end to end, tokens/s:\n\n"
          + e2e_table(result.get("maxtext")) + "\n")
  (out / "results.json").write_text(json.dumps(result, indent=1))
  (out / "tables.md").write_text(text)
  plot(result, out / "speed.png")
  return text


def run_e2e(spec: dict, out: Path, keep_runs: bool) -> dict:
  from benchmarks import maxtext_e2e
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
                  "preset's (bench_attention.IMPLS)")
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

  import jax
  import jax.numpy as jnp
  from benchmarks import bench_attention as bench
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
  kernels = bench.measure(dtype=dtype, interleaved=interleaved, **k)
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
