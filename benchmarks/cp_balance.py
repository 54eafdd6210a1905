"""Balance of context parallelism per token order: kept (q, kv) pairs and visited blocks per rank.

    .venv/bin/python benchmarks/cp_balance.py                         # 32k tokens, cp 2/4/8
    .venv/bin/python benchmarks/cp_balance.py --seq_len 131072 --out_dir benchmarks/results

For cp in 2/4/8, every layout of cp_layouts.balance_layouts (one document, two documents of 3/4
and 1/4, power-law lengths with 5% padding, tiny documents, one long plus many short, 12 random
documents with padding) and every token order (natural, llama3, balanced; see
kvax_plugin.attention.token_order), prints max / min over ranks of the exact kept pairs and of
the forward blocks the per-rank tables make the kernel visit (kvax_plugin.attention.
context_parallel.context_parallel_balance: the sharded op's tables, key/value arranged as the
op arranges them). Targets for "balanced"
(issue 16): <= 1.05 kept, <= 1.10 visited. With --out_dir, writes cp_balance_<seq_len>.json
and a plot cp_balance_<seq_len>.png there. CPU, about a minute at 32k.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cp_layouts import balance_layouts  # noqa: E402

ORDERS = ("natural", "llama3", "balanced")
COLORS = {"natural": "#7f7f7f", "llama3": "#1f77b4", "balanced": "#d62728"}


def plot(rows: list[dict], path: str, title: str) -> str:
  """Two panels (kept pairs, visited blocks): max / min per (layout, cp), one bar per order."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  groups = sorted({(r["layout"], r["cp"]) for r in rows},
                  key=lambda g: ([r["layout"] for r in rows].index(g[0]), g[1]))
  by_key = {(r["layout"], r["cp"], r["order"]): r for r in rows}
  x = np.arange(len(groups))
  width = 0.8 / len(ORDERS)
  fig, axes = plt.subplots(2, 1, figsize=(max(10, 0.55 * len(groups)), 8), sharex=True)
  for ax, key, label, target in ((axes[0], "kept_max_over_min", "kept pairs", 1.05),
                                 (axes[1], "visited_max_over_min", "visited blocks", 1.10)):
    for i, order in enumerate(ORDERS):
      vals = [by_key[(lay, cp, order)][key] for lay, cp in groups]
      ax.bar(x + (i - 1) * width, vals, width, label=order, color=COLORS[order])
    ax.axhline(target, color="k", lw=0.8, ls="--", label=f"target {target}")
    ax.set_yscale("log")
    ax.set_ylabel(f"{label}: max / min over ranks")
    ax.grid(axis="y", which="both", alpha=0.3)
  axes[0].legend(ncol=4, fontsize=8)
  axes[1].set_xticks(x)
  axes[1].set_xticklabels([f"{lay}\ncp={cp}" for lay, cp in groups], rotation=90, fontsize=7)
  axes[0].set_title(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--seq_len", type=int, default=32768)
  ap.add_argument("--cps", type=str, default="2,4,8")
  ap.add_argument("--q_block", type=int, default=128,
                  help="forward query block size (also the unit the balanced order moves)")
  ap.add_argument("--kv_block", type=int, default=128)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out_dir", type=str, default=None, help="write the JSON and the plot here")
  args = ap.parse_args(argv)

  import jax

  from kvax_plugin.attention import token_order
  from kvax_plugin.attention.context_parallel import context_parallel_balance
  from kvax_plugin.attention.params import FlashAttentionParamsConfig

  params = FlashAttentionParamsConfig(query_block_size=args.q_block, kv_block_size=args.kv_block)
  cps = [int(c) for c in args.cps.split(",")]
  rows = []
  print(f"seq_len {args.seq_len}, blocks {args.q_block}x{args.kv_block}: max / min over ranks "
        "of kept pairs | visited blocks")
  header = f"{'layout':<20} {'cp':>3} " + " ".join(f"{o:>17}" for o in ORDERS)
  print(header)
  print("-" * len(header))
  for name, (pos, seg) in balance_layouts(args.seq_len, seed=args.seed).items():
    for cp in cps:
      cells = []
      for order in ORDERS:
        r = context_parallel_balance(pos, seg, cp, order=order, fwd_params=params)
        r["layout"] = name
        rows.append(r)
        cells.append(f"{r['kept_max_over_min']:>8.3f}|{r['visited_max_over_min']:<8.3f}")
      print(f"{name:<20} {cp:>3} " + " ".join(cells))
  bal = [r for r in rows if r["order"] == "balanced"]
  worst_k = max(r["kept_max_over_min"] for r in bal)
  worst_v = max(r["visited_max_over_min"] for r in bal)
  print(f"balanced, worst over layouts and cp: kept {worst_k:.3f} (target 1.05), visited "
        f"{worst_v:.3f} (target 1.10)")
  # Time to compute the balanced order of one row (compiled; median of 5), per cp.
  pos, seg = next(iter(balance_layouts(args.seq_len, seed=args.seed).values()))
  order_ms = {}
  for cp in cps:
    times = []
    for _ in range(6):
      t0 = time.perf_counter()
      jax.block_until_ready(token_order.balanced_order(pos, seg, cp, block=args.q_block,
                                                       kv_block=args.kv_block))
      times.append((time.perf_counter() - t0) * 1e3)
    order_ms[cp] = statistics.median(times[1:])
  print("balanced order, ms per row on " + jax.devices()[0].device_kind + ": " +
        ", ".join(f"cp={cp} {ms:.1f}" for cp, ms in order_ms.items()))
  if args.out_dir:
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"cp_balance_{args.seq_len}")
    with open(stem + ".json", "w") as f:
      json.dump({"seq_len": args.seq_len, "q_block": args.q_block, "kv_block": args.kv_block,
                 "seed": args.seed, "balanced_order_ms_per_row": order_ms,
                 "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    plot(rows, stem + ".png", f"context-parallel balance per token order, S={args.seq_len}, "
         f"blocks {args.q_block}x{args.kv_block} (lower is better, 1 = perfect)")
    print(f"wrote {stem}.json and {stem}.png")
  return rows


if __name__ == "__main__":
  main()
