"""The kernels' launch tail under their CTA orders, from the block tables alone (CPU).

    python -m benchmarks.tools.launch_order_model --seq 16384 65536 --out outputs/launch_order.json

Model (greedy list scheduling, what the CTA scheduler does): one CTA per SM at a time (the dk/dv
and dq kernels' shared memory allows one), `--sms` SMs, CTAs taken in launch order by the first
free SM; a CTA's time is its visited blocks (upper - lower of its table row, the unit every step
of that kernel costs) plus `--overhead` blocks of prologue and epilogue. The makespan against
the perfect split (total / SMs) is the tail. It models no cache: an order that keeps the CTAs
in flight on the same documents can win in L2 what it loses here (docs/tuning-history.md).
Orders, over the grid's (head, tile) positions:

    head_major     the grid's own order (head slowest; the dq kernel's causal tiles reversed)
    per_head_lpt   each head's tiles longest first, heads one after another (heads slowest:
                   the CUDA backward with a sliding window, and at head dims 256 and 192 / 128)
    over_heads     longest tile first over all (head, tile) pairs, heads of a tile together
                   (block_mask.longest_first_over_heads: the Mosaic backward kernels' order)
    sequence       (dkv only) the tiles in sequence, heads of a tile together
    documents      (dkv only) block_mask.documents_longest_first, heads of a tile together
                   (the CUDA backward's head dim 128 order for documents of at most a wave of
                   pairs; larger ones run head by head: fused_backward.launch_order's
                   "documents" layout, modelled with L2 in benchmarks/tools/l2_reuse_model.py)

The `dkv` rows model the CUDA C++ backward ("hopper") too: one CTA per 128 kv rows and kv head,
its whole query group inside, on the same table (fused_backward.launch_order).

The persistent forward (one CTA per SM) deals its (tile, head) items statically instead:
round_robin, round_robin_lpt (longest-first tiles), snake (odd rounds mirrored) and snake_lpt
(the persistent forward's deal, mosaic/forward.FwdConfig.num_ctas).

The layouts are bench_attention.py's (causal; 12 random documents + 1000 padding tokens, the
same seed), 32 query / 8 kv heads. The Triton backend's grids (heads fastest, `triton_*` rows)
leave at most ~1% of tail in these layouts, so they need no reordering.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cases import layout  # noqa: E402  (the benchmark's own layouts)


def makespan(works, sms: int, overhead: float) -> float:
  """Greedy list scheduling of `works` in order on `sms` machines: the last finish time."""
  free = [0.0] * sms
  for w in works:
    heapq.heappush(free, heapq.heappop(free) + float(w) + overhead)
  return max(free)


def orders(table, tiles_per_row: int, n_tiles: int, n_heads: int, reverse_grid: bool,
           cuda_backward: bool = False):
  """Per-CTA works in each launch order, the orders taken from the kernels' own functions
  (block_mask.longest_first, longest_first_over_heads, documents_longest_first) on the block
  table; with cuda_backward also the CUDA backward's heads-fastest orders (sequence,
  documents)."""
  from kvax_plugin.attention import block_mask as bm
  counts = tile_counts(table, tiles_per_row, n_tiles)
  grid = counts[::-1] if reverse_grid else counts
  per_head = np.asarray(bm.longest_first(table.lower, table.upper, tiles_per_row, n_tiles))[0]
  codes = np.asarray(bm.longest_first_over_heads(table.lower, table.upper, tiles_per_row,
                                                 n_tiles, n_heads))[0]
  works = {
      "head_major": np.tile(grid, n_heads),
      "per_head_lpt": np.tile(counts[per_head], n_heads),
      "over_heads": counts[codes // n_heads],  # code = tile * n_heads + head
  }
  if cuda_backward:
    documents = np.asarray(bm.documents_longest_first(table.lower, table.upper, tiles_per_row,
                                                      n_tiles))[0]
    works.update(sequence=np.repeat(counts, n_heads),
                 documents=np.repeat(counts[documents], n_heads))
  return works


def dealt(works, ctas: int, overhead: float, snake: bool) -> float:
  """The persistent forward's static deal: item i goes to CTA i % G in even rounds and (snake)
  to G - 1 - i % G in odd ones; the busiest CTA's sum."""
  load = np.zeros(ctas)
  for i, w in enumerate(works):
    r, c = divmod(i, ctas)
    load[ctas - 1 - c if snake and r % 2 else c] += float(w) + overhead
  return float(load.max())


def tile_counts(table, tiles_per_row: int, n_tiles: int):
  return np.repeat(np.asarray(table.upper - table.lower)[0], tiles_per_row)[:n_tiles]


def model(seq: int, case: str, sms: int, overhead: float, h: int = 32, kh: int = 8):
  from kvax_plugin.attention import block_mask as bm
  from kvax_plugin.attention.block_mask import create_attention_mask
  pos, seg, _ = layout(case, seq, seed=seq)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  bq = mask.spec.bwd_params.query_block_size
  bkv = mask.spec.bwd_params.kv_block_size
  rows = {}
  # dk/dv kernel: 128 kv rows per CTA, one kv head (its whole query group); dq kernel: 128
  # query rows per CTA, one query head (the grid reverses causal tiles).
  for kernel, table, tile, n_heads, block, reverse in (
      ("dkv", mask.dkv, 128, kh, bkv, False), ("dq", mask.dq, 128, h, bq, case == "causal")):
    counts = tile_counts(table, block // tile, seq // tile)
    total = counts.sum() * n_heads + overhead * len(counts) * n_heads
    for name, works in orders(table, block // tile, seq // tile, n_heads, reverse,
                              cuda_backward=kernel == "dkv").items():
      span = makespan(works, sms, overhead)
      rows[f"{kernel}/{name}"] = dict(makespan=span, ideal=total / sms,
                                      tail=span / (total / sms) - 1.0)
  # persistent forward: one CTA per SM deals (tile, head) items, heads fastest; the grid's tile
  # order is reversed under a causal mask (longest first), natural otherwise
  counts = tile_counts(mask.fwd, mask.spec.fwd_params.query_block_size // 128, seq // 128)
  grid = np.repeat(counts[::-1] if case == "causal" else counts, h)
  lpt = np.repeat(counts[np.asarray(bm.longest_first(mask.fwd.lower, mask.fwd.upper,
                                                     mask.spec.fwd_params.query_block_size // 128,
                                                     seq // 128))[0]], h)
  total = grid.sum() + overhead * len(grid)
  for name, span in (("round_robin", dealt(grid, sms, overhead, False)),
                     ("round_robin_lpt", dealt(lpt, sms, overhead, False)),
                     ("snake", dealt(grid, sms, overhead, True)),
                     ("snake_lpt", dealt(lpt, sms, overhead, True))):
    rows[f"fwd/{name}"] = dict(makespan=span, ideal=total / sms, tail=span / (total / sms) - 1.0)
  # The Triton backend's grids are (batch x heads, tiles) with the heads fastest: forward and dq
  # tiles reversed, dk/dv tiles natural (kernels/triton/forward.py, backward.py); one dk/dv CTA
  # per query head unless the GQA group is accumulated in place (one per kv head). Its CTAs may
  # share an SM, so the model runs 1 and 2 per SM.
  fwd_q = mask.spec.fwd_params.query_block_size
  for kernel, table, block, n_heads, reverse in (
      ("triton_fwd", mask.fwd, fwd_q, h, True), ("triton_dq", mask.dq, bq, h, True),
      ("triton_dkv", mask.dkv, bkv, h, False)):
    counts = tile_counts(table, 1, seq // block)
    works = np.repeat(counts[::-1] if reverse else counts, n_heads)  # heads fastest
    total = works.sum() + overhead * len(works)
    for per_sm in (1, 2):
      span = makespan(works, sms * per_sm, overhead)
      rows[f"{kernel}/grid_{per_sm}_per_sm"] = dict(makespan=span, ideal=total / (sms * per_sm),
                                                   tail=span / (total / (sms * per_sm)) - 1.0)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
  ap.add_argument("--cases", default="causal,docs")
  ap.add_argument("--sms", type=int, default=132)
  ap.add_argument("--overhead", type=float, default=2.0,
                  help="per-CTA prologue + epilogue, in visited blocks")
  ap.add_argument("--out", type=Path, default=None)
  args = ap.parse_args()
  if args.sms < 1 or args.overhead < 0:
    ap.error(f"--sms {args.sms} / --overhead {args.overhead}: expected >= 1 / >= 0")
  results = []
  for seq in args.seq:
    for case in args.cases.split(","):
      rows = model(seq, case, args.sms, args.overhead)
      for key, row in rows.items():
        kernel, order = key.split("/")
        results.append(dict(seq=seq, case=case, kernel=kernel, order=order, **row))
        print(f"{seq:6d} {case:6s} {kernel:10s} {order:15s} makespan {row['makespan']:9.1f} "
              f"ideal {row['ideal']:9.1f}  tail {100 * row['tail']:5.1f}%")
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(conditions=vars(args) | {"out": str(args.out)},
                                        results=results), indent=1))


if __name__ == "__main__":
  main()
