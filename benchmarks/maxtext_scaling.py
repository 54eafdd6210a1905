"""MaxText with attention=kvax over several GPUs: tokens/s against one GPU, losses, memory.

    python -m benchmarks.maxtext_scaling --out_dir outputs/scaling            # the default matrix
    python -m benchmarks.maxtext_scaling --runs 128k-short:kvax:1,128k-short:kvax:c4 --steps 5
    python -m benchmarks.maxtext_scaling --runs 8gpu --steps 8   # the matrix for 8 GPUs

A run is LENGTH-LAYOUT:ATTENTION:MESH[:ROWS][+KEY=VALUE...], one `python -m kvax_plugin.launch`
process (or several, see p<N>) of MaxText's own training loop on the packed shipped corpus
(llama3-8b with --layers layers and a --vocab-token vocabulary, bf16, launcher defaults
otherwise):
  LENGTH  tokens per row: 128k, 256k, 512k, 1m (k = 1024);
  LAYOUT  short (the launcher's documents of 64..4096 bytes, many per row) or long (one
          document per row: plain causal attention);
  ATTENTION  kvax (--kvax_backend, default auto), flash, cudnn_flash_jax, cudnn_flash_te, ...;
  MESH    "1" (one GPU) or MaxText ici axes as letters and sizes: c4 (context 4), c2f2
          (context 2 x fsdp 2), f4 (fsdp 4); p2 adds processes: c2f2p2 is the same mesh as
          2 processes x 2 GPUs on this host, joined by jax.distributed;
  ROWS    rows per step (global batch). Default: one row per GPU, so every GPU holds the same
          tokens whatever the mesh ("same work per GPU"; speed-up over one GPU = tokens/s
          ratio, efficiency = speed-up / GPUs). ROWS=1 on a context mesh is one row split over
          the GPUs: the same batches as the one-GPU run, so the losses must agree.
  +KEY=VALUE  MaxText config keys for this run only, e.g.
          256k-short:kvax:c4+kvax_kv_grad_reduce_dtype=input (a row compared with the plain
          one-GPU row of its length, layout and attention).

Runs on one GPU go first and side by side, one per GPU of the host (each its own process and
GPU; --serial_single runs them one after another), then the multi-GPU runs one after another.
A run that fails is a row with "error" (out of memory is flagged "oom"), not the sweep's end,
which is how the longest row that fits is measured.

Writes scaling.json (conditions, rows, speed-ups, loss agreement) after each run and
scaling.png at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.maxtext_e2e import (fresh_caches, profile_of, profiler_overrides,  # noqa: E402
                                    warm_imports)

DEFAULT_RUNS = ",".join([
    "128k-short:kvax:1", "256k-short:kvax:1", "128k-long:kvax:1", "512k-short:kvax:1",
    "128k-short:kvax:c4", "256k-short:kvax:c4", "128k-short:kvax:c2f2", "128k-long:kvax:c4",
])
# --runs NAME: the matrix for a host of that many GPUs (the 4-GPU one is the default).
RUN_SETS = {
    "4gpu": DEFAULT_RUNS,
    "8gpu": ",".join([
        "128k-short:kvax:1", "256k-short:kvax:1", "128k-long:kvax:1",
        "128k-short:kvax:c8", "256k-short:kvax:c8", "128k-short:kvax:c4f2",
        "128k-short:kvax:c4f2p2", "128k-long:kvax:c8", "1m-short:kvax:c8:1",
    ]),
}
AXES = {"c": "ici_context", "f": "ici_fsdp", "d": "ici_data", "t": "ici_tensor"}


def parse_spec(spec: str) -> dict:
  """"256k-short:kvax:c2f2p2[:ROWS][+KEY=VALUE...]" -> the run's fields; errors name the spec."""
  base, *extra = spec.split("+")
  overrides = {}
  for item in extra:
    key, eq, value = item.partition("=")
    if not eq or not re.fullmatch(r"[a-z_][a-z0-9_]*", key):
      raise SystemExit(f"--runs {spec!r}: after '+' expected a MaxText KEY=VALUE, got {item!r}")
    overrides[key] = value
  parts = base.split(":")
  if len(parts) not in (3, 4) or "-" not in parts[0]:
    raise SystemExit(f"--runs {spec!r}: expected LENGTH-LAYOUT:ATTENTION:MESH[:ROWS]")
  length, layout = parts[0].split("-", 1)
  m = re.fullmatch(r"(\d+)([km])", length)
  if not m or layout not in ("short", "long"):
    raise SystemExit(f"--runs {spec!r}: LENGTH like 128k or 1m, LAYOUT short or long")
  seq = int(m.group(1)) * (1024 if m.group(2) == "k" else 1024 * 1024)
  mesh = {}
  processes = 1
  if parts[2] != "1":
    for axis, size in re.findall(r"([cfdtp])(\d+)", parts[2]):
      if axis == "p":
        processes = int(size)
      else:
        mesh[AXES[axis]] = int(size)
    if "".join(f"{a}{s}" for a, s in re.findall(r"([cfdtp])(\d+)", parts[2])) != parts[2]:
      raise SystemExit(f"--runs {spec!r}: MESH is 1 or letters c/f/d/t/p with sizes, e.g. c2f2")
  gpus = 1
  for size in mesh.values():
    gpus *= size
  rows = int(parts[3]) if len(parts) == 4 else gpus
  return dict(spec=spec, label=parts[0], seq_len=seq, layout=layout, attention=parts[1],
              mesh=mesh, gpus=gpus, processes=processes, rows=rows, overrides=overrides)


def launcher_cmd(run: dict, args, run_dir: Path, caches: dict) -> list[str]:
  cmd = [sys.executable, "-m", "kvax_plugin.launch", f"--config=configs/llama3.py:{args.variant}",
         f"--config.seq_len={run['seq_len']}", f"--config.steps={args.steps}",
         f"--config.attention={run['attention']}", f"--config.output_dir={run_dir}",
         "--config.log_every=1", "--config.mesh.ici_fsdp=1"]
  cmd += [f"--config.mesh.{axis}={size}" for axis, size in run["mesh"].items()]
  if run["attention"] == "kvax":
    cmd.append(f"--config.kvax.backend={args.kvax_backend}")
  if run["layout"] == "long":
    chars = 4 * run["seq_len"]  # every document longer than a row: one document per row
    cmd += [f"--config.data.min_doc_chars={chars}", f"--config.data.max_doc_chars={chars}"]
  if args.variant != "tiny":
    cmd += [f"base_num_decoder_layers={args.layers}", f"vocab_size={args.vocab}"]
  cmd += [f"{k}={v}" for k, v in run.get("overrides", {}).items()]
  cmd += [f"per_device_batch_size={run['rows'] / run['gpus']:g}",
          f"jax_cache_dir={caches['jax_cache_dir']}"]
  if args.profile:
    cmd += profiler_overrides(args)
  return cmd


def start(run: dict, args, out_dir: Path, gpu_ids: list[int]) -> list[tuple]:
  """Starts the run's process(es) on `gpu_ids`; returns [(Popen, log file, run_dir)]."""
  name = re.sub(r"[^A-Za-z0-9_.-]", "_", run["spec"])
  caches = fresh_caches(out_dir / "caches" / name)
  procs = []
  n = run["processes"]
  port = _free_port()
  per = len(gpu_ids) // n
  for i in range(n):
    run_dir = out_dir / name
    cmd = launcher_cmd(run, args, run_dir, caches)
    env = dict(os.environ, TRITON_CACHE_DIR=caches["TRITON_CACHE_DIR"],
               CUDA_CACHE_PATH=caches["CUDA_CACHE_PATH"])
    # Each process sees its own share of the GPUs, as on separate hosts.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids[i * per:(i + 1) * per]))
    if n > 1:
      cmd += [f"--coordinator_address=localhost:{port}", f"--num_processes={n}",
              f"--process_id={i}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / f"{name}.p{i}.log", "w")
    procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                  log, run_dir))
  return procs


def finish(run: dict, procs: list[tuple], t0: float, timeout: float, args) -> dict:
  """Waits for the run's processes; the row from process 0's summary.json."""
  row = dict(run, wall_s=None)
  codes = []
  for proc, log, _ in procs:
    try:
      codes.append(proc.wait(timeout=max(1.0, timeout - (time.time() - t0))))
    except subprocess.TimeoutExpired:
      proc.kill()
      codes.append("timeout")
    log.close()
  row["wall_s"] = round(time.time() - t0, 1)
  tail = Path(procs[0][1].name).read_text(errors="replace")[-4000:]
  summary = procs[0][2] / "summary.json"
  if any(c != 0 for c in codes) or not summary.exists():
    row["error"] = f"exit {codes}: {tail[-2500:]}"
    row["oom"] = "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower()
    return row
  s = json.loads(summary.read_text())
  row.update(tokens_per_s=s["mean_tokens_per_s"], step_s=s["mean_step_seconds"],
             losses=s["losses"], step_seconds=s.get("step_seconds"),
             peak_memory_gib=s.get("peak_device_memory_gib"),
             devices=s["devices"], global_batch=s["global_batch"],
             documents_per_row=s.get("documents_per_row"),
             blocks_skipped=s.get("blocks_skipped"), backend_ran=s.get("kvax_backend"),
             setup_and_compile_s=s["wall_seconds"]["setup_and_compile"])
  if args.profile:
    row["profile"] = profile_of(procs[0][2], args.profile_steps, host_fallback=False)
  return row


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def same_batches(a: dict, b: dict) -> bool:
  """Whether two rows trained on the same batches (same length, layout and number of rows), so
  that their losses must agree step by step."""
  return a["label"] == b["label"] and a["rows"] == b["rows"]


def max_loss_gap(a: dict, b: dict) -> float:
  return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def compare(rows: list[dict]) -> list[dict]:
  """Each multi-GPU row against the one-GPU row of the same length, layout and attention:
  speed-up (tokens/s ratio), efficiency per GPU, and for equal batches the largest loss gap."""
  out = []
  for r in rows:
    if r["gpus"] == 1 or "error" in r:
      continue
    base = next((b for b in rows if b["gpus"] == 1 and "error" not in b and not b.get("overrides")
                 and b["label"] == r["label"]
                 and b["attention"] == r["attention"]), None)
    if base is None:
      continue
    c = dict(run=r["spec"], against=base["spec"], gpus=r["gpus"],
             speedup=round(r["tokens_per_s"] / base["tokens_per_s"], 3))
    c["efficiency"] = round(c["speedup"] / r["gpus"], 3)
    if same_batches(r, base):
      c["max_loss_gap"] = max_loss_gap(r, base)
    out.append(c)
  return out


def versus(rows: list[dict]) -> list[dict]:
  """Each kvax row against every other attention's row of the same length, layout, mesh and
  rows (no overrides on either): kvax's tokens/s over theirs, and the largest loss gap."""
  out = []
  plain = [r for r in rows if "error" not in r and not r.get("overrides")]
  for r in plain:
    if r["attention"] != "kvax":
      continue
    for o in plain:
      if (o["attention"] != "kvax" and same_batches(o, r) and o["mesh"] == r["mesh"]
          and o["processes"] == r["processes"]):
        out.append(dict(run=r["spec"], against=o["spec"],
                        kvax_speedup=round(r["tokens_per_s"] / o["tokens_per_s"], 3),
                        max_loss_gap=max_loss_gap(r, o)))
  return out


def preallocation_note(preallocate: str, runs: list[dict]) -> str | None:
  """A warning when TransformerEngine runs without XLA's preallocation: at 256k on 4 x H200 its
  one large temporary buffer is then not found (docs/context-parallelism.md)."""
  if preallocate.lower() in ("false", "0") and any(r["attention"] == "cudnn_flash_te"
                                                   for r in runs):
    return ("XLA_PYTHON_CLIENT_PREALLOCATE=false: cudnn_flash_te may run out of memory where "
            "it fits with XLA's default preallocation")
  return None


def plot(result: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ran = [r for r in result["rows"] if "error" not in r]
  rows = [r for r in ran if r.get("tokens_per_s")]
  fig, (ax, lx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw=dict(width_ratios=[3, 2]))
  names = [f"{r['label']}\n{r['attention']} {r['spec'].split('+')[0].split(':')[2]}"
           + "".join(f"\n{k.removeprefix('kvax_')}={v}" for k, v in r.get("overrides", {}).items())
           + (f" rows {r['rows']}" if r["rows"] != r["gpus"] else "") for r in rows]
  values = [r["tokens_per_s"] / 1e3 for r in rows]
  bars = ax.bar(range(len(rows)), values, color=["tab:gray" if r["gpus"] == 1 else "tab:blue"
                                                  for r in rows])
  for b, v in zip(bars, values):
    ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}k", ha="center", va="bottom", fontsize=7)
  ax.set_xticks(range(len(rows)), names, fontsize=6, rotation=45, ha="right")
  ax.set_ylabel("real tokens/s (thousands)")
  ax.set_title(f"MaxText llama3-8b ({result['layers']} layers)\n"
               f"{result['device']}; gray: one GPU, blue: several", fontsize=9)
  for r in ran:
    if any(o is not r and same_batches(o, r) for o in ran):
      lx.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", ms=3,
              label=f"{r['label']} {r['attention']} {r['spec'].split(':')[2]}, {r['rows']} row(s)")
  lx.set_xlabel("step")
  lx.set_ylabel("loss")
  lx.set_title("loss per step (same batches where rows agree)", fontsize=9)
  if lx.get_lines():
    lx.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out_dir", default="outputs/scaling")
  ap.add_argument("--runs", default=DEFAULT_RUNS,
                  help="comma-separated run specs, or a matrix: " + ", ".join(RUN_SETS))
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--kvax_backend", default="auto")
  ap.add_argument("--variant", default="8b", help="configs/llama3.py variant (tiny: CPU smoke)")
  ap.add_argument("--timeout", type=int, default=400, help="seconds per run")
  ap.add_argument("--profile", action="store_true",
                  help="MaxText's profiler on --profile_steps steps after --profile_skip; each row "
                  "gets benchmarks/tools/profile_e2e.py's GPU time per step by kernel category")
  ap.add_argument("--profile_skip", type=int, default=3)
  ap.add_argument("--profile_steps", type=int, default=2)
  ap.add_argument("--serial_single", action="store_true",
                  help="one-GPU runs one after another instead of side by side")
  ap.add_argument("--replot", metavar="DIR",
                  help="only redraw DIR/scaling.png from DIR/scaling.json")
  args = ap.parse_args(argv)
  if args.replot:
    plot(json.loads((Path(args.replot) / "scaling.json").read_text()),
         Path(args.replot) / "scaling.png")
    return
  runs = [parse_spec(s) for s in RUN_SETS.get(args.runs, args.runs).split(",")]
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  import jax
  gpus = jax.device_count()
  for r in runs:
    if r["gpus"] > gpus or r["gpus"] % r["processes"]:
      raise SystemExit(f"--runs {r['spec']}: needs {r['gpus']} GPUs in {r['processes']} "
                       f"process(es); this host has {gpus}")
  result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                device=f"{gpus} x {jax.devices()[0].device_kind}", jax=jax.__version__,
                model=f"configs/llama3.py:{args.variant}", layers=args.layers, vocab=args.vocab,
                steps=args.steps, kvax_backend=args.kvax_backend,
                single_gpu_runs="one after another" if args.serial_single
                else "side by side, one per GPU of the host",
                # Conditions that change the runs: XLA's flags, its allocator, and the launcher's
                # mask statistics.
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                xla_python_client_preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE",
                                                             "true"),
                kvax_feed_mask_stats=os.environ.get("KVAX_FEED_MASK_STATS", "1"), rows=[])
  note = preallocation_note(result["xla_python_client_preallocate"], runs)
  if note:
    print(f"maxtext_scaling: {note}", file=sys.stderr, flush=True)
  del jax
  result["import_warmup_s"] = warm_imports()

  def save(row):
    result["rows"].append(row)
    result["comparisons"] = compare(result["rows"])
    result["versus"] = versus(result["rows"])
    print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "error", "profile")}),
          flush=True)
    if "profile" in row:
      p = row["profile"]
      print("  profile (ms per step, mean over GPUs): " + json.dumps(
          {k: p.get(k) for k in ("per_step_ms", "busy_ms_per_step", "idle_ms_per_step",
                                 "collectives_exposed_ms_per_step", "span_ms_per_step", "error")}),
            flush=True)
    if "error" in row:
      print(f"  error: {row['error'][-600:]}", flush=True)
    (out_dir / "scaling.json").write_text(json.dumps(result, indent=1))

  singles = [r for r in runs if r["gpus"] == 1]
  width = 1 if args.serial_single else gpus
  for i in range(0, len(singles), width):
    batch = singles[i:i + width]
    t0 = time.time()
    started = [(r, start(r, args, out_dir, [j])) for j, r in enumerate(batch)]
    for r, procs in started:
      save(finish(r, procs, t0, args.timeout, args))
  for r in runs:
    if r["gpus"] > 1:
      t0 = time.time()
      save(finish(r, start(r, args, out_dir, list(range(r["gpus"]))), t0, args.timeout,
                  args))
  for c in result.get("comparisons", []) + result.get("versus", []):
    print(json.dumps(c), flush=True)
  plot(result, out_dir / "scaling.png")


if __name__ == "__main__":
  main()
