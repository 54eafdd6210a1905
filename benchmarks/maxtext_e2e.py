"""MaxText end to end: tokens/s of attention=kvax against MaxText's own GPU kernels.

    python benchmarks/maxtext_e2e.py --out_dir $OUT/e2e                 # the default matrix
    python benchmarks/maxtext_e2e.py --runs 16k-short:kvax,16k-short:flash --steps 6

Each run is one `python -m kvax_plugin.launch` process (MaxText's own training loop, the packed
shipped corpus, llama3-8b shrunk to --layers layers and a --vocab-token vocabulary, bf16,
launcher defaults otherwise), so every kernel sees the same model and the same batches. Layouts:
"short" = the launcher's packing of documents of 64..4096 bytes; "long" = documents far longer
than a row, so every row is one document (plain causal attention). Attentions: kvax (with
--kvax_backend, default mosaic), flash (MaxText's tokamax Pallas-Triton kernel on a dense
segment mask), cudnn_flash_jax (cuDNN through jax.nn; it does not see document boundaries).

Per run it records the launcher's summary: mean real tokens/s over the steps after the first,
setup+compile seconds (process start to the end of the first step, minus the first step) and
the first step's seconds (cold start: run with an empty compilation cache). Writes
e2e.json (conditions included) and e2e.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUNS = ("16k-long:kvax,16k-long:cudnn_flash_jax,16k-short:kvax,16k-short:flash,"
                "16k-short:cudnn_flash_jax,64k-short:kvax,64k-short:flash")
SEQ = {"16k": 16384, "64k": 65536, "8k": 8192, "2k": 2048}


def run_one(label: str, attention: str, args, out_dir: Path) -> dict:
  length, layout = label.split("-")
  seq = SEQ[length]
  run_dir = out_dir / f"{label}_{attention}"
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
  row = dict(label=label, seq_len=seq, layout=layout, attention=attention,
             kvax_backend=args.kvax_backend if attention == "kvax" else None, command=" ".join(cmd))
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
  row["wall_s"] = round(time.time() - t0, 1)
  tail = (proc.stdout + proc.stderr)[-3000:]
  summary_path = run_dir / "summary.json"
  if proc.returncode != 0 or not summary_path.exists():
    row["error"] = f"exit {proc.returncode}: {tail}"
    return row
  s = json.loads(summary_path.read_text())
  metrics = run_dir / "metrics.jsonl"
  if metrics.exists():
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if steps:
      s["first_step_seconds"] = steps[0].get("perf/step_time_seconds")
  row.update(tokens_per_s=s.get("mean_tokens_per_s"), step_s=s.get("mean_step_seconds"),
             setup_and_compile_s=s["wall_seconds"]["setup_and_compile"],
             first_step_s=s.get("first_step_seconds"), last_loss=s.get("last_loss"),
             blocks_skipped=s.get("blocks_skipped"), documents_per_row=s.get("documents_per_row"),
             attention_ran=s.get("attention"), backend_ran=s.get("kvax_backend"))
  return row


def plot(rows, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  labels = sorted({r["label"] for r in rows}, key=lambda x: (SEQ[x.split("-")[0]], x))
  atts = sorted({r["attention"] for r in rows}, key=lambda a: (a != "kvax", a))
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
  ax.set_title("MaxText llama3-8b (shrunk), one GPU: attention kernels on the same packed data")
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
  ap.add_argument("--kvax_backend", default="mosaic")
  ap.add_argument("--variant", default="8b", help="configs/llama3.py variant (tiny: CPU smoke)")
  ap.add_argument("--timeout", type=int, default=300)
  args = ap.parse_args()
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  import jax
  result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                device=jax.devices()[0].device_kind, jax=jax.__version__,
                steps=args.steps, layers=args.layers, vocab=args.vocab, runs=[])
  for spec in args.runs.split(","):
    label, attention = spec.split(":")
    row = run_one(label, attention, args, out_dir)
    result["runs"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("command",)})[:600], flush=True)
    (out_dir / "e2e.json").write_text(json.dumps(result, indent=1))
  plot(result["runs"], out_dir / "e2e.png")
  print(f"{'run':28s} {'tok/s':>10s} {'setup+compile s':>16s} {'first step s':>13s}")
  for r in result["runs"]:
    print(f"{r['label'] + ':' + r['attention']:28s} {r.get('tokens_per_s') or float('nan'):10.0f} "
          f"{r.get('setup_and_compile_s') or float('nan'):16.1f} "
          f"{r.get('first_step_s') or float('nan'):13.2f}")


if __name__ == "__main__":
  main()
