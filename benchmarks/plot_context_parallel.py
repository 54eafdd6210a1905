"""Plot bench_context_parallel.py results: forward+backward speed-up over one GPU per token order.

    python benchmarks/plot_context_parallel.py OUT.png RESULT.json [RESULT.json ...]

One group of bars per (layout, order), one bar per result file (labelled by its backend and
dk / dv reduce dtype), with the ideal (cp) and the issue's target (0.95 cp) as lines. Each bar
is annotated with its speed-up and, below the axis label, the max / min visited blocks of the
order, so balance and speed are read together.
"""

from __future__ import annotations

import json
import sys


def label(result: dict) -> str:
  name = f"{result['backend']}"
  reduce = result.get("kv_grad_reduce_dtype")
  if reduce and reduce != "auto":
    name += f", dk/dv sum {reduce}"
  if "latency_hiding_scheduler=true" in result.get("xla_flags", ""):
    name += ", XLA latency hiding scheduler"
  return name


def plot(results: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  groups = []  # (layout, order)
  for r in results:
    for layout, lay in r["layouts"].items():
      for order in lay["context_parallel"]:
        if (layout, order) not in groups:
          groups.append((layout, order))
  cp = results[0]["cp"]
  width = 0.8 / len(results)
  fig, ax = plt.subplots(figsize=(max(7, 1.5 * len(groups)), 4.5))
  for i, r in enumerate(results):
    xs, ys = [], []
    for g, (layout, order) in enumerate(groups):
      entry = r["layouts"].get(layout, {}).get("context_parallel", {}).get(order)
      if entry is None:
        continue
      xs.append(g - 0.4 + width * (i + 0.5))
      ys.append(entry["speedup"]["fwd_bwd"])
    bars = ax.bar(xs, ys, width, label=label(r))
    for bar, y in zip(bars, ys):
      ax.text(bar.get_x() + bar.get_width() / 2, y + 0.02, f"{y:.3f}", ha="center", fontsize=7)
  balance = []
  for layout, order in groups:
    entry = next(r["layouts"][layout]["context_parallel"][order] for r in results
                 if order in r["layouts"].get(layout, {}).get("context_parallel", {}))
    balance.append(entry["balance"]["visited_max_over_min"])
  ax.set_xticks(range(len(groups)))
  ax.set_xticklabels([f"{layout}\n{order}\nblocks max/min {b:.2f}"
                      for (layout, order), b in zip(groups, balance)], fontsize=8)
  ax.axhline(cp, color="gray", linestyle=":", linewidth=1, label=f"ideal ({cp}x)")
  ax.axhline(0.95 * cp, color="red", linestyle="--", linewidth=1,
             label=f"target ({0.95 * cp:.2f}x)")
  ax.set_ylim(0, cp * 1.12)
  ax.set_ylabel("forward+backward speed-up over 1 GPU")
  first = results[0]
  cfg = first["config"]
  ax.set_title(f"context parallelism, cp={cp} x {first['device_kind']}, S={cfg['seq_len']}, "
               f"{cfg['heads']}/{cfg['kv_heads']} heads of {cfg['head_dim']}, {cfg['dtype']}",
               fontsize=9)
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) < 2:
    raise SystemExit(__doc__)
  results = []
  for p in argv[1:]:
    with open(p) as f:
      results.append(json.load(f))
  plot(results, argv[0])
  print(f"wrote {argv[0]}")


if __name__ == "__main__":
  main()
