"""MaxText end to end: tokens/s of attention=kvax against MaxText's own GPU kernels.

    python -m benchmarks.run --preset full                  # the README's table (uses this file)
    python benchmarks/maxtext_e2e.py --out_dir outputs/e2e                # the default matrix
    python benchmarks/maxtext_e2e.py --runs 16k-short:kvax,16k-short:flash --steps 6

Each run is one `python -m kvax_plugin.launch` process (MaxText's own training loop, the packed
shipped corpus, llama3-8b shrunk to --layers layers and a --vocab-token vocabulary, bf16,
launcher defaults otherwise), so every kernel sees the same model and the same batches. Layouts:
"short" = the launcher's packing of documents of 64..4096 bytes; "long" = documents far longer
than a row, so every row is one document (plain causal attention). Attentions: kvax (with
--kvax_backend, default auto), flash (MaxText's tokamax Pallas-Triton kernel on a dense
segment mask), cudnn_flash_jax (cuDNN through jax.nn; it does not see document boundaries).

Per run it records the launcher's summary (summary.json): mean real tokens/s over the steps after
the first; setup+compile seconds (wall_seconds: the launcher's run up to MaxText's first step,
i.e. checks, MaxText import and config, model/state init, tracing and compiling the train step;
the process's imports before it and the pictures drawn after training are outside); the first
step (MaxText's clock: loading the first batch and dispatching the step) and the first step's
result (from the step's start until its loss reached the host: its execution and any one-time
work at first execution); and where setup+compile went (compile_breakdown: parts that add up to
it, JAX tracing, lowering to StableHLO incl. kernel lowering, XLA compile, the launcher's
phases, a remainder; kvax_plugin/integrations/maxtext/setup_timing.py says what each holds).
Runs before this breakdown reported setup+compile as the run's wall time minus the step clocks,
which also held about two steps of execution; that number is kept as run_less_step_clocks_s.

Cold by default: MaxText turns on JAX's persistent compilation cache (jax_cache_dir, default
~/jax_cache, which also holds XLA's GPU autotuning cache), so a later run of the same program
in one sweep would load its executables instead of compiling them. Every run gets its own fresh
jax_cache_dir (and TRITON_CACHE_DIR / CUDA_CACHE_PATH for jax-triton's and the CUDA driver's
kernel caches) under its output directory. `--warm` runs each program twice over one shared set
of caches, cold then warm, and reports both setup+compile numbers (and breakdowns).

Before the runs, one throwaway process imports the launcher's packages (jax, kvax_plugin,
MaxText) so that the first run does not pay alone for reading them from disk (its "MaxText
import + config" would otherwise include the cold read that the later runs skip).

`--profile` adds MaxText's own profiler (profiler=xplane, --profile_steps steps after
--profile_skip; trace: <run>/tensorboard/plugins/profile/<time>/<host>.xplane.pb), and
benchmarks/tools/profile_e2e.py puts GPU ms per step by kernel category (attention, matmul, collectives,
other, idle) in the row's "profile". Profiled runs' step times include the profiler's overhead.

Each row also keeps the run's losses per step. Runs of one label start from the same model and
batch, so their first-step losses should agree up to rounding; the program prints them side by
side and keeps them in e2e.json's first_loss_gaps.

Writes e2e.json (conditions included) and e2e.png.

    python benchmarks/maxtext_e2e.py --variant tiny --runs 2k-short:kvax,2k-short:dot_product \
        --kvax_backend jax --steps 3                                       # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_RUNS = ("16k-long:kvax,16k-long:cudnn_flash_jax,16k-short:kvax,16k-short:flash,"
                "16k-short:cudnn_flash_jax,64k-short:kvax,64k-short:flash")
# 1k and 0.5k: CPU runs (tests/test_benchmark_programs.py profiles a 0.5k one)
SEQ = {"16k": 16384, "64k": 65536, "8k": 8192, "2k": 2048, "1k": 1024, "0.5k": 512}


# Columns of the printed table: compile_breakdown parts, shortened ("other": the rest).
PART_COLUMNS = (("jax_trace", "trace"), ("jax_lower", "lower"), ("xla_compile", "xla"),
                ("imports_and_config", "import+cfg"), ("model_state_init", "state init"))


def fresh_caches(cache_dir: Path) -> dict[str, str]:
  """Empty compilation caches under `cache_dir`: MaxText's jax_cache_dir key and the env vars
  of the kernel caches outside JAX (jax-triton's Triton cache, the CUDA driver's PTX cache)."""
  if cache_dir.exists():
    shutil.rmtree(cache_dir)
  cache_dir.mkdir(parents=True)
  return {"jax_cache_dir": str(cache_dir / "jax"), "TRITON_CACHE_DIR": str(cache_dir / "triton"),
          "CUDA_CACHE_PATH": str(cache_dir / "cuda")}


# What a launcher process imports before MaxText's first step (kernel modules included).
WARMUP_IMPORTS = ("import jax; jax.devices(); import kvax_plugin.launch; "
                  "import kvax_plugin.integrations.maxtext; "
                  "from kvax_plugin.attention.kernels import capabilities; "
                  "from maxtext.trainers.pre_train import train; "
                  "from maxtext.configs import pyconfig")


def warm_imports() -> float | None:
  """Imports the launcher's packages once in a throwaway process, so that the first timed run
  does not pay alone for reading them from disk (on the GPU machine: the wheels unpacked into
  a fresh directory); compilation caches are not touched. Seconds taken, None on failure."""
  t0 = time.perf_counter()
  done = subprocess.run([sys.executable, "-c", WARMUP_IMPORTS], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  if done.returncode != 0:
    print(f"import warm-up failed (runs go on; the first one may read files cold):\n"
          f"{done.stderr[-2000:]}", flush=True)
    return None
  return round(time.perf_counter() - t0, 2)


def run_one(label: str, attention: str, args, out_dir: Path) -> dict:
  """One program: a cold run; with --warm, then a warm one over the same caches."""
  run_dir = out_dir / f"{label}_{attention}"
  caches = fresh_caches(out_dir / "caches" / f"{label}_{attention}")
  row = run_launcher(label, attention, args, run_dir, caches)
  if args.warm and "error" not in row:
    warm = run_launcher(label, attention, args, out_dir / f"{label}_{attention}_warm", caches)
    row["warm"] = {k: warm.get(k) for k in ("wall_s", "tokens_per_s", "setup_and_compile_s",
                                             "first_step_s", "first_step_result_s",
                                             "compile_breakdown", "error", "profile")}
  return row


def run_launcher(label: str, attention: str, args, run_dir: Path, caches: dict[str, str]) -> dict:
  length, layout = label.split("-")
  seq = SEQ[length]
  cmd = [sys.executable, "-m", "kvax_plugin.launch", f"--config=configs/llama3.py:{args.variant}",
         f"--config.seq_len={seq}", f"--config.steps={args.steps}",
         f"--config.attention={attention}", f"--config.output_dir={run_dir}",
         "--config.log_every=1"]
  if attention == "kvax":
    cmd.append(f"--config.kvax.backend={args.kvax_backend}")
  if layout == "long":
    chars = 4 * seq  # every document longer than a row: one document per row
    cmd += [f"--config.data.min_doc_chars={chars}", f"--config.data.max_doc_chars={chars}"]
  if args.variant != "tiny":
    cmd += [f"base_num_decoder_layers={args.layers}", f"vocab_size={args.vocab}"]
  cmd.append(f"jax_cache_dir={caches['jax_cache_dir']}")
  cmd += list(getattr(args, "maxtext_override", []))
  if args.profile:
    cmd += profiler_overrides(args)
  env = dict(os.environ, TRITON_CACHE_DIR=caches["TRITON_CACHE_DIR"],
             CUDA_CACHE_PATH=caches["CUDA_CACHE_PATH"])
  row = dict(label=label, seq_len=seq, layout=layout, attention=attention,
             kvax_backend=args.kvax_backend if attention == "kvax" else None, command=" ".join(cmd))
  t0 = time.time()
  try:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
  except subprocess.TimeoutExpired as e:  # one slow run is an error row, not the sweep's end
    out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                  for x in (e.stdout, e.stderr))
    row["wall_s"] = round(time.time() - t0, 1)
    row["error"] = f"timed out after {args.timeout} s (--timeout): {out[-3000:]}"
    return row
  row["wall_s"] = round(time.time() - t0, 1)
  tail = (proc.stdout + proc.stderr)[-3000:]
  summary_path = run_dir / "summary.json"
  if proc.returncode != 0 or not summary_path.exists():
    row["error"] = f"exit {proc.returncode}: {tail}"
    return row
  s = json.loads(summary_path.read_text())
  wall = s["wall_seconds"]
  breakdown = s.get("compile_breakdown") or {}
  row.update(tokens_per_s=s.get("mean_tokens_per_s"), step_s=s.get("mean_step_seconds"),
             setup_and_compile_s=wall["setup_and_compile"],
             first_step_s=wall.get("first_step"),
             first_step_result_s=wall.get("first_step_result"),
             run_less_step_clocks_s=wall.get("run_less_step_clocks"),
             before_run_s=wall.get("before_run"),
             reporting_s=wall.get("reporting"), compile_breakdown=breakdown,
             first_loss=s.get("first_loss"), last_loss=s.get("last_loss"),
             losses=s.get("losses"),
             blocks_skipped=s.get("blocks_skipped"), documents_per_row=s.get("documents_per_row"),
             attention_ran=s.get("attention"), backend_ran=s.get("kvax_backend"))
  if args.profile:
    row["profile"] = profile_of(run_dir, args.profile_steps, args.platform == "cpu")
  return row


def profiler_overrides(args) -> list[str]:
  """MaxText's own profiler keys (configs/base.yml; maxtext/common/profiler.py): an xplane trace
  of steps [skip, skip + steps) under the run's tensorboard/ folder."""
  if args.profile_skip + args.profile_steps > args.steps:
    raise SystemExit(f"--profile_skip {args.profile_skip} + --profile_steps {args.profile_steps} "
                     f"is more than --steps {args.steps}")
  return ["profiler=xplane", f"skip_first_n_steps_for_profiler={args.profile_skip}",
          f"profiler_steps={args.profile_steps}"]


def profile_of(run_dir: Path, steps: int, host_fallback: bool) -> dict:
  """benchmarks/tools/profile_e2e.py's summary of the run's trace; an "error" entry if it fails.
  host_fallback: CPU runs only (host XLA ops stand in for the missing GPU plane)."""
  try:
    from benchmarks.tools import profile_e2e
    return profile_e2e.summarize_xplane(run_dir, steps=steps, host_fallback=host_fallback)
  except Exception as e:  # noqa: BLE001 - the run's numbers stand without it
    return {"error": f"profile analysis failed: {e!r}"[:2000]}


def plot(rows, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  labels = sorted({r["label"] for r in rows}, key=lambda x: (SEQ[x.split("-")[0]], x))
  # kvax rows named with their backend ("kvax (hopper)"), the others by attention alone
  name = lambda r: (f"{r['attention']} ({r['kvax_backend']})" if r.get("kvax_backend")
                    else r["attention"])
  rows = [dict(r, attention=name(r)) for r in rows]
  atts = sorted({r["attention"] for r in rows}, key=lambda a: (not a.startswith("kvax"), a))
  fig, ax = plt.subplots(figsize=(8, 4))
  width = 0.8 / max(1, len(atts))
  for i, att in enumerate(atts):
    vals = []
    for lab in labels:
      r = next((r for r in rows if r["label"] == lab and r["attention"] == att), None)
      vals.append(r.get("tokens_per_s") or 0 if r else 0)
    xs = [j + (i - (len(atts) - 1) / 2) * width for j in range(len(labels))]
    ax.bar(xs, [v / 1e3 for v in vals], width, label=att)
    for x, v in zip(xs, vals):
      if v:
        ax.text(x, v / 1e3, f"{v / 1e3:.0f}k", ha="center", va="bottom", fontsize=7)
  ax.set_xticks(range(len(labels)), labels)
  ax.set_ylabel("real tokens/s (thousands)")
  device = next((r.get("device") for r in rows if r.get("device")), None)
  ax.set_title("MaxText llama3-8b (shrunk), one GPU: attention kernels on the same packed data"
               + (f"\n{device}" if device else ""), fontsize=10)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out_dir", default="outputs/e2e")
  ap.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated LENGTH-LAYOUT:ATTENTION")
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--kvax_backend", default="auto")
  ap.add_argument("--variant", default="8b", help="configs/llama3.py variant (tiny: CPU smoke)")
  ap.add_argument("--timeout", type=int, default=300)
  ap.add_argument("--warm", action="store_true",
                  help="run each program twice over one set of caches; report cold and warm")
  ap.add_argument("--profile", action="store_true",
                  help="MaxText's xplane profiler on --profile_steps steps after --profile_skip; "
                  "each row gets 'profile' (GPU time per step by kernel category, "
                  "benchmarks/tools/profile_e2e.py). Step times / tokens/s of profiled runs include "
                  "the profiler's overhead for the profiled steps")
  ap.add_argument("--profile_skip", type=int, default=3,
                  help="steps before the profiled ones (MaxText's skip_first_n_steps_for_profiler)")
  ap.add_argument("--profile_steps", type=int, default=2,
                  help="profiled steps (MaxText's profiler_steps)")
  ap.add_argument("--maxtext_override", action="append", default=[], metavar="KEY=VALUE",
                  help="a raw MaxText key for every run, e.g. remat_policy=minimal_with_context "
                       "(repeatable; recorded with the results)")
  ap.add_argument("--plot_from", nargs="+", metavar="E2E_JSON",
                  help="draw --out_dir/e2e.png (and write the merged e2e.json) from the rows of "
                       "saved e2e.json files (runs made one per call), then exit")
  args = ap.parse_args()
  if args.plot_from:
    merged = [json.loads(Path(f).read_text()) for f in args.plot_from]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = dict(merged[0], runs=[r for m in merged for r in m["runs"]],
                  merged_from=[str(f) for f in args.plot_from])
    (out_dir / "e2e.json").write_text(json.dumps(result, indent=1))
    plot([dict(r, device=m.get("device")) for m in merged for r in m["runs"]],
         out_dir / "e2e.png")
    return
  for item in args.maxtext_override:
    if "=" not in item or not item.split("=", 1)[0]:
      ap.error(f"--maxtext_override {item!r}: expected KEY=VALUE")
  if args.profile:
    profiler_overrides(args)  # checks the step counts before any run
  result = run_matrix(args, Path(args.out_dir))
  print_table(result["runs"])
  print_first_losses(result["first_loss_gaps"])
  if args.profile:
    print_profiles(result["runs"])


def maxtext_missing() -> str | None:
  """Why the MaxText runs cannot start here (None when maxtext imports)."""
  import importlib.util
  if importlib.util.find_spec("maxtext") is None:
    return ("maxtext is not installed (pip install 'kvax-plugin[maxtext]' -c constraints.txt, "
            "or bash scripts/bootstrap.sh)")
  return None


def run_matrix(args, out_dir: Path) -> dict:
  """Every run of args.runs ("LENGTH-LAYOUT:ATTENTION,..."), one process each; writes
  out_dir/e2e.json after each run (so a cut sweep keeps what finished) and e2e.png at the end.
  args: the namespace main() parses (runs, steps, layers, vocab, kvax_backend, variant, timeout,
  warm, profile, profile_skip, profile_steps, maxtext_override)."""
  out_dir.mkdir(parents=True, exist_ok=True)
  import jax
  args.platform = jax.devices()[0].platform
  result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                device=jax.devices()[0].device_kind, jax=jax.__version__,
                steps=args.steps, layers=args.layers, vocab=args.vocab, runs=[],
                first_loss_gaps={},
                model=f"configs/llama3.py:{args.variant}",
                maxtext_overrides=list(args.maxtext_override),
                caches="warm: each program run twice over shared caches" if args.warm
                else "cold: every run with empty compilation caches of its own")
  if args.profile:
    result["profile"] = dict(skip=args.profile_skip, steps=args.profile_steps,
                             note="step times of these runs include profiler overhead")
  result["import_warmup_s"] = warm_imports()
  for spec in args.runs.split(","):
    label, attention = spec.split(":")
    row = run_one(label, attention, args, out_dir)
    result["runs"].append(row)
    short = {k: v for k, v in row.items()
             if k not in ("command", "compile_breakdown", "warm", "profile")}
    print(json.dumps(short)[:600], flush=True)
    result["first_loss_gaps"] = first_loss_gaps(result["runs"])
    (out_dir / "e2e.json").write_text(json.dumps(result, indent=1))
  plot(result["runs"], out_dir / "e2e.png")
  return result


def print_profiles(rows) -> None:
  """profile_e2e's table per profiled run; for two runs, their difference per category."""
  from benchmarks.tools import profile_e2e
  profiled = [(r["label"] + ":" + r["attention"], r["profile"]) for r in rows if r.get("profile")]
  for name, prof in profiled:
    print(profile_e2e.format_summary(name, prof))
  if len(profiled) == 2:
    print(f"{profiled[0][0]} - {profiled[1][0]}:")
    print(profile_e2e.format_comparison([n for n, _ in profiled], profiled[0][1], profiled[1][1]))


def first_loss_gaps(rows) -> dict[str, dict]:
  """Per label run by more than one attention: each run's first-step loss and its largest
  relative gap to the others. Every run of a label trains the same model from the same
  initialization on the same first batch, so attentions that compute the same function give
  first losses equal up to rounding (bf16 kernels: about 1e-3 relative); a larger gap means
  they compute different attention (later steps may also part through training noise)."""
  by_label: dict[str, dict[str, float]] = {}
  for r in rows:
    if isinstance(r.get("first_loss"), (int, float)):
      name = r["attention"] + (f" ({r['kvax_backend']})" if r.get("kvax_backend") else "")
      by_label.setdefault(r["label"], {}).setdefault(name, r["first_loss"])
  gaps = {}
  for label, losses in by_label.items():
    if len(losses) > 1:
      vals = list(losses.values())
      gap = (max(vals) - min(vals)) / max(abs(v) for v in vals)
      gaps[label] = dict(first_losses=losses, max_relative_gap=gap)
  return gaps


def print_first_losses(gaps: dict[str, dict]) -> None:
  """first_loss_gaps' result, a line per label."""
  for label, g in gaps.items():
    shown = ", ".join(f"{k} {v:.5f}" for k, v in g["first_losses"].items())
    print(f"first-step losses, {label}: {shown} (largest relative gap {g['max_relative_gap']:.1e})")


def print_table(rows) -> None:
  """tokens/s, setup+compile, first step and the setup+compile parts (seconds) per run."""
  def num(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else format(float("nan"), fmt)

  heads = "".join(f" {h:>10s}" for _, h in PART_COLUMNS)
  print(f"{'run':28s} {'tok/s':>8s} {'1st step':>8s} {'1st result':>10s} {'setup+comp':>10s}"
        f"{heads} {'other':>8s}")
  for r in rows:
    for name, data in ((r["label"] + ":" + r["attention"], r),
                       ("  (warm)", r.get("warm"))):
      if not data:
        continue
      parts = (data.get("compile_breakdown") or {}).get("parts", {})
      shown = [parts.get(k) for k, _ in PART_COLUMNS]
      other = (sum(parts.values()) - sum(v for v in shown if v is not None)) if parts else None
      print(f"{name:28s} {num(data.get('tokens_per_s'), '8.0f')} "
            f"{num(data.get('first_step_s'), '8.2f')} {num(data.get('first_step_result_s'), '10.2f')} "
            f"{num(data.get('setup_and_compile_s'), '10.1f')}"
            + "".join(f" {num(v, '10.1f')}" for v in shown) + f" {num(other, '8.1f')}")


if __name__ == "__main__":
  main()
