"""Causal balance of context parallelism: kept (q, kv) pairs and visited blocks per device.

    .venv/bin/python benchmarks/cp_balance.py                  # 128k tokens, 12 documents
    .venv/bin/python benchmarks/cp_balance.py --seq_len 32768 --json /tmp/balance.json

For cp in 2/4/8 and inputs in natural vs load-balanced order (rank r holds chunks r and
2*cp-1-r), prints per-device work and max / min over devices. `kept pairs` are exact (q, kv)
pairs the mask keeps; `visited blocks` are the forward blocks the per-shard tables make the
kernel visit (block size from --q_block / --kv_block). Runs on CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cp_layouts import one_document, random_documents  # noqa: E402


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--seq_len", type=int, default=131072)
  ap.add_argument("--num_docs", type=int, default=12)
  ap.add_argument("--num_pad", type=int, default=1000)
  ap.add_argument("--cps", type=str, default="2,4,8")
  ap.add_argument("--q_block", type=int, default=128)
  ap.add_argument("--kv_block", type=int, default=128)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", type=str, default=None, help="also write the rows to this file")
  args = ap.parse_args(argv)

  from kvax_plugin.attention.params import FlashAttentionParamsConfig
  from kvax_plugin.attention.sharding import context_parallel_balance

  params = FlashAttentionParamsConfig(query_block_size=args.q_block, kv_block_size=args.kv_block)
  layouts = {
      f"{args.num_docs} docs + {args.num_pad} pad": random_documents(
          args.seq_len, args.num_docs, args.num_pad, seed=args.seed),
      "1 causal doc": one_document(args.seq_len),
  }
  rows = []
  print(f"seq_len {args.seq_len}, blocks {args.q_block}x{args.kv_block}; per device: kept pairs "
        "(millions) and visited blocks")
  header = (f"{'layout':<22} {'cp':>3} {'order':<9} {'kept max/min':>12} {'blocks max/min':>14}"
            "  kept pairs per device (M) | visited blocks per device")
  print(header)
  print("-" * len(header))
  for name, (pos, seg) in layouts.items():
    for cp in (int(c) for c in args.cps.split(",")):
      for permute in (False, True):
        r = context_parallel_balance(pos, seg, cp, permute=permute, fwd_params=params)
        r["layout"] = name
        rows.append(r)
        kept = " ".join(f"{k / 1e6:.0f}" for k in r["kept_pairs"])
        blocks = " ".join(str(v) for v in r["visited_blocks"])
        print(f"{name:<22} {cp:>3} {'permuted' if permute else 'natural':<9} "
              f"{r['kept_max_over_min']:>12.2f} {r['visited_max_over_min']:>14.2f}  "
              f"{kept} | {blocks}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"seq_len": args.seq_len, "q_block": args.q_block, "kv_block": args.kv_block,
                 "rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
