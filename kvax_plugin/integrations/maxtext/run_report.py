"""What a launcher run leaves behind: loss.png, mask.png, summary.json and the printed summary."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvax_plugin.data.feeding import PackedCorpus
from kvax_plugin.integrations.maxtext.setup_timing import format_breakdown
from kvax_plugin.integrations.maxtext.training_hooks import Progress, StepRecord


def plot_losses(records: Sequence[StepRecord], path: str, title: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot([r.step + 1 for r in records], [r.loss for r in records], marker="o", markersize=3)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats / token)")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def draw_first_mask(corpus: PackedCorpus, out: str) -> list[str]:
  """mask.png: the first batch's global causal block mask of its row with the most documents
  (mask_local.png: with the window)."""
  import kvax_plugin
  row = max(range(corpus.first.num_seqs), key=lambda r: len(corpus.first.pieces[r]))
  docs = len(corpus.first.pieces[row])
  paths = []
  for name, mask in corpus.masks(corpus.first).items():
    path = os.path.join(out, "mask.png" if name == "global" else f"mask_{name}.png")
    share = kvax_plugin.mask_sparsity(mask)["skipped"]
    kvax_plugin.draw_mask(mask, path, batch_index=row, title=(
        f"{name} mask, batch 1 row {row + 1} ({docs} document pieces): "
        f"batch skips {share:.0%} of blocks"))
    paths.append(path)
  return paths


def tensorboard_files(config) -> list[str]:
  found = []
  for root, _, files in os.walk(config.tensorboard_dir or ""):
    found += [os.path.join(root, f) for f in files if f.startswith("events.out.tfevents")]
  return sorted(found)


def write_report(cfg, config, progress: Progress, corpus: PackedCorpus | None, attention: str,
                 backend: str | None, *, out: str, log_path: str, can_draw: bool, timer,
                 t0: float, t_end: float, stream=None) -> dict[str, Any]:
  """The end of a launcher run: pictures, summary.json and the printed summary (to `stream`);
  t0 / t_end: time.time() at launch.run's start and after MaxText's train loop."""
  step_seconds = sum(r.step_seconds for r in progress.records)
  files = {
      "loss_png": plot_losses(progress.records, os.path.join(out, "loss.png"),
                              f"{cfg.family}:{cfg.variant} ({cfg.model}), attention="
                              f"{attention}, packed corpus") if can_draw else None,
      "mask_png": draw_first_mask(corpus, out) if corpus is not None and can_draw else [],
      "tensorboard_dir": config.tensorboard_dir,
      "tensorboard_files": tensorboard_files(config),
      "maxtext_log": log_path,
      "summary_json": os.path.join(out, "summary.json"),
  }
  t_reported = time.time()
  breakdown = timer.breakdown(t0, t_end)
  # Outside setup_and_compile: the process before run(), the steps, and "reporting".
  first = progress.records[0]
  wall = {"total": t_end - t0, "training": step_seconds,
          "setup_and_compile": breakdown["setup_and_compile"],
          "first_step": first.step_seconds,
          "first_step_result": (first.received - timer.first_step_start
                                if timer.first_step_start else None),
          "run_less_step_clocks": max(0.0, (t_end - t0) - step_seconds),
          "before_run": process_age(t0), "reporting": t_reported - t_end}
  summary = summarize(cfg, config, progress, corpus, attention, backend, wall, files,
                      compile_breakdown=breakdown)
  with open(files["summary_json"], "w") as f:
    json.dump(summary, f, indent=2)
  print_summary(summary, stream)
  return summary


def process_age(at: float) -> float | None:
  """Seconds from this process's start to time.time() `at` (Linux /proc; None elsewhere)."""
  try:
    with open("/proc/self/stat") as f:
      start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None
  age_now = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
  return max(0.0, age_now - (time.time() - at))


# When a GPU run uses kvax under MaxText's default remat policy (docs/performance.md).
REMAT_FULL_NOTE = (
    "remat_policy=full reruns every layer's attention forward inside the backward (for any "
    "attention kernel); remat_policy=minimal_with_context (MaxText's own GPU llama3-8b policy) "
    "keeps kvax's output and log-sum-exp instead. Measured on one H100, 64k rows of one "
    "document each: kvax 1.08-1.09x cudnn_flash_jax with minimal_with_context, 0.93x with full "
    "(docs/performance.md)")


# When a GPU run uses MaxText's flash past its int32 mask addressing (docs/integrations.md).
INT32_MAX = 2**31 - 1


def flash_mask_note(rows_per_device: int, seq_len: int) -> str:
  return (f"attention=flash: MaxText's GPU flash kernel addresses its dense [B, 1, S, S] segment "
          f"mask with int32 offsets, and here B x S x S = {rows_per_device} x {seq_len} x "
          f"{seq_len} > 2^31: queries past that offset read their mask from outside the buffer, "
          "so this run's attention is not MaxText's (benchmarks/tools/flash_mask_offsets.py, "
          "docs/integrations.md). attention=kvax or cudnn_flash_te take packed rows of any "
          "length; flash holds B x S x S <= 2^31 (one 46k row)")


def run_notes(attention: str, hardware: str | None, remat_policy: str | None,
              seq_len: int | None = None, rows_per_device: int = 1) -> list[str]:
  notes = []
  if attention == "kvax" and hardware == "gpu" and remat_policy == "full":
    notes.append(REMAT_FULL_NOTE)
  if (attention == "flash" and hardware == "gpu" and seq_len
      and rows_per_device * seq_len * seq_len - 1 > INT32_MAX):
    notes.append(flash_mask_note(rows_per_device, seq_len))
  return notes


def summarize(cfg, config, progress: Progress, corpus: PackedCorpus | None, attention: str,
              backend: str | None, wall: dict[str, float], files: dict[str, Any],
              compile_breakdown: dict[str, Any] | None = None) -> dict[str, Any]:
  """The run's summary; `attention` / `backend` as read back from MaxText's final config."""
  recs = progress.records
  # The first steps carry warm-up: from 4 steps on, timing starts at step 3.
  timed = recs[2:] if len(recs) >= 4 else recs[1:] if len(recs) > 1 else recs
  mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
  remat_policy = getattr(config, "remat_policy", None)
  skipped = {}
  if corpus is not None and corpus.stats and attention == "kvax":
    for name in corpus.stats[0].skipped:
      skipped[name] = mean([s.skipped[name] for s in corpus.stats])
  return {
      "family": cfg.family, "variant": cfg.variant, "model": cfg.model,
      "attention": attention,
      "kvax_backend": backend if attention == "kvax" else None,
      "hardware": config.hardware, "devices": _device_count(),
      "peak_device_memory_gib": _peak_device_memory_gib(),
      "seq_len": config.max_target_length, "global_batch": config.global_batch_size_to_train_on,
      "steps": len(recs),
      "first_loss": recs[0].loss if recs else None, "last_loss": recs[-1].loss if recs else None,
      "min_loss": min(r.loss for r in recs) if recs else None,
      "losses": [r.loss for r in recs],
      "step_seconds": [r.step_seconds for r in recs],
      "maxtext_step_seconds": [r.maxtext_step_seconds for r in recs],
      "mean_step_seconds": mean([r.step_seconds for r in timed]),
      # A ratio of sums (the mean of per-step ratios is pulled up by short-clocked steps).
      "mean_tokens_per_s": _tokens_per_second(timed),
      "real_token_share": (mean([s.real_tokens / max(1, s.rows * s.seq_len) for s in corpus.stats])
                           if corpus is not None and corpus.stats else None),
      "documents_per_row": (mean([s.documents / s.rows for s in corpus.stats])
                            if corpus is not None and corpus.stats else None),
      "blocks_skipped": skipped,
      "kvax_fwd_blocks": ([int(config.kvax_fwd_query_block_size),
                           int(config.kvax_fwd_kv_block_size)] if attention == "kvax" else None),
      "remat_policy": remat_policy,
      "notes": run_notes(attention, config.hardware, remat_policy, int(config.max_target_length),
                         max(1, math.ceil(float(getattr(config, "per_device_batch_size", 1))))),
      "wall_seconds": wall,
      "compile_breakdown": compile_breakdown,
      **files,
  }


def _tokens_per_second(records) -> float:
  pairs = [(r.real_tokens, r.step_seconds) for r in records
           if r.step_seconds > 0 and r.real_tokens == r.real_tokens]
  seconds = sum(sec for _, sec in pairs)
  return sum(tok for tok, _ in pairs) / seconds if seconds > 0 else float("nan")


def _peak_device_memory_gib() -> float | None:
  """The largest peak of device bytes in use (GiB); None where not reported (CPU)."""
  import jax
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p]
  return round(max(peaks) / 2**30, 2) if peaks else None


def _device_count() -> int:
  import jax
  return jax.device_count()


def print_summary(s: dict[str, Any], stream=None) -> None:
  stream = stream or sys.stdout
  w = s["wall_seconds"]
  lines = [
      "",
      f"== {s['family']}:{s['variant']} ({s['model']}), attention={s['attention']}"
      + (f" (kvax backend {s['kvax_backend']})" if s["kvax_backend"] else "")
      + f", {s['hardware']} x{s['devices']}",
      f"   {s['steps']} steps of {s['global_batch']} x {s['seq_len']} tokens"
      + (f"; {s['real_token_share']:.1%} real tokens, {s['documents_per_row']:.1f} document "
         "pieces per row" if s["real_token_share"] is not None else ""),
      f"   loss {s['first_loss']:.4f} -> {s['last_loss']:.4f} (min {s['min_loss']:.4f})",
      f"   {s['mean_tokens_per_s']:,.0f} real tok/s, {s['mean_step_seconds']:.2f} s/step "
      f"(after step 1); blocks skipped: "
      + (", ".join(f"{k} {v:.1%}" for k, v in s["blocks_skipped"].items()) or "n/a"),
      f"   wall: setup+compile {w['setup_and_compile']:.1f} s, training {w['training']:.1f} s, "
      f"total {w['total']:.1f} s"
      + (f"; first step {w['first_step']:.2f} s" if "first_step" in w else "")
      + (f" (result after {w['first_step_result']:.2f} s)" if w.get("first_step_result")
         else ""),
      *([f"   {format_breakdown(s['compile_breakdown'])}"] if s.get("compile_breakdown") else []),
      f"   mask:        {', '.join(s['mask_png']) or 'n/a'}",
      f"   loss plot:   {s['loss_png'] or 'n/a'}",
      f"   tensorboard: tensorboard --logdir {s['tensorboard_dir']}",
      f"   summary:     {s['summary_json']}   MaxText log: {s['maxtext_log']}",
      *(f"   note: {n}" for n in s.get("notes") or ()),
  ]
  print("\n".join(lines), file=stream, flush=True)
