"""What the benchmark command writes and prints: the kernel and MaxText tables (markdown, as the
README shows them), the plots, and the results folder (results.json, tables.md, speed.png).

    report(result, out)     writes <out>/results.json, tables.md, speed.png; returns the tables
    kernel_table(rows)      ms (effective TFLOP/s) per implementation, then ours against cuDNN,
                            tokamax and FA3 (their ms / ours: > 1 = ours faster; the rounds
                            ours won where both were timed interleaved)
    e2e_table(result)       MaxText tokens/s, kvax against MaxText's own kernels
    gpu_slug(device_kind)   the GPU's part of a results folder's name
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib
import numpy as np

from benchmarks.impls import PEER_NAMES, impl_order

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

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


def _fmt_ratio(ratio: float) -> str:
  """'1.04x'; three decimals where two would round a ratio that is not 1 to 1.00x."""
  return f"{ratio:.3f}x" if f"{ratio:.2f}" == "1.00" and ratio != 1 else f"{ratio:.2f}x"


def rounds_won(ours: dict, theirs: dict) -> tuple[int, int] | None:
  """(rounds in which ours was faster, rounds) of two interleaved rows of one case: round i of
  each was timed in the same pass of the round-robin, so the pair shares the GPU's state. None
  where either row has no per-round times or their counts differ."""
  a, b = ours.get("ms_rounds"), theirs.get("ms_rounds")
  interleaved = ours.get("interleaved") and theirs.get("interleaved")
  if not a or not b or len(a) != len(b) or not interleaved:
    return None
  return sum(x < y for x, y in zip(a, b)), len(a)


def kernel_table(rows) -> str:
  """Markdown: one line per (length, case, head dims, pass); ms (effective TFLOP/s) per
  implementation, then ours against cuDNN, tokamax and FA3 (their median ms / ours: > 1 = ours
  faster; in brackets, where both were timed interleaved, the rounds in which ours was faster),
  ours being the row's first of auto, hopper, mosaic, triton, jax that has a time."""
  timed = [r for r in rows if r.get("pass") in ("fwd", "fwd_bwd")]
  impls = impl_order(timed)
  ours = [n for n in ("auto", "hopper", "mosaic", "triton", "jax") if n in impls]
  peers = [n for n in ("cudnn", "tokamax_mosaic", "fa3") if n in impls]
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
    mine_row = next((get(n) for n in ours if get(n).get("ms")), {})
    mine = mine_row.get("ms")
    for peer in peers:
      theirs = get(peer).get("ms")
      if not (mine and theirs):
        cells.append("-")
        continue
      won = rounds_won(mine_row, get(peer))
      cells.append(_fmt_ratio(theirs / mine) + (f" ({won[0]}/{won[1]})" if won else ""))
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


def _legend_above_bars(ax, entries: int) -> None:
  """The legend in rows of up to 4 entries, in headroom above the tallest bar, so no bar hides
  behind it."""
  ncol = max(1, min(entries, 4))
  rows = -(-max(entries, 1) // ncol)
  top = max((b.get_height() for b in ax.patches), default=0.0)
  ax.set_ylim(0, (1.1 + 0.08 * rows) * top if top > 0 else 1.0)
  ax.legend(fontsize=8, loc="upper center", ncol=ncol, frameon=False)


def plot(result, path: Path) -> None:
  """speed.png: effective TFLOP/s of the kernel rows (left) and MaxText tokens/s (right)."""
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
  _legend_above_bars(ax, len(impls))
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
    _legend_above_bars(ax, len(atts))
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


def plot_kernels(results, path, title: str) -> None:
  """<out>.png of bench_attention.py: effective TFLOP/s per (length, case, head dim, pass)."""
  rows = [r for r in results if r.get("tflops") is not None]
  groups = sorted({(r["seq"], r["case"], r["head_dim"], r["pass"]) for r in rows})
  impls = impl_order(rows)
  fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups)), 5))
  width = 0.8 / max(1, len(impls))
  for i, name in enumerate(impls):
    vals = []
    for g in groups:
      match = [r for r in rows if (r["seq"], r["case"], r["head_dim"], r["pass"]) == g
               and r["impl"] == name]
      vals.append(match[0]["tflops"] if match else 0.0)
    ax.bar(np.arange(len(groups)) + i * width, vals, width, label=name)
  ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
  ax.set_xticklabels([f"{s // 1024}k {c}\nD{d} {p}" for s, c, d, p in groups], fontsize=7)
  ax.set_ylabel("effective TFLOP/s (kept pairs only)")
  ax.set_title(title)
  _legend_above_bars(ax, len(impls))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
