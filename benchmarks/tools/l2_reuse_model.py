"""How much of the hopper backward's Q / dO / dq traffic an L2 of a given size can serve, per
launch order and walk, from the block tables alone (CPU).

    python -m benchmarks.tools.l2_reuse_model [--seq 16384 65536] [--cases causal,docs]
        [--l2-mb 50] [--sms 132] [--out F]

Each step of a backward CTA reads the Q and dO rows of one 64-row query block of one query head
and reduce-adds that block's dq (float32): 64 x 128 x (2 + 2 + 4) bytes at head dim 128, the
model's unit. The model plays the steps of every CTA in launch order on `--sms` SMs (one CTA per
SM, the next CTA in order to the first free SM, every step one time unit, the SMs' steps of a
time unit one after another) through a least-recently-used cache of `--l2-mb` MB, and reports
the share of steps whose block was in it (the hit rate) and the makespan against the perfect
split (the launch tail, as benchmarks/tools/launch_order_model.py computes it).

Layouts: benchmarks.cases (causal; 12 documents + 1000 padding tokens, seed 0), 32 query / 8 kv
heads; each 128-row kv tile visits the query blocks of fused_backward.tile_bounds (the kernel's
own input). Rows:

    documents/up            fused_backward.launch_order's "documents" layout (head dim 128
                            without a window, the wave `--sms`): the (kv head, tile) pairs by
                            documents, a document of more pairs than a wave head by head; each
                            CTA walks its group's query heads in turn, each head's blocks upwards
    documents/snake         the same, the odd heads of the group walked downwards, so that each
                            head starts where the one before ended (the DK_LAST kernels' walk:
                            head dim 128 without soft cap or window)
    documents_heads_together/up,snake  the tiles in documents order, each tile's kv heads
                            together (the head dim 128 layout before ABI 16)
    heads_slowest/up,snake  each kv head's tiles longest first (block_mask.longest_first), the
                            heads one after another: what the window's kernels launch
    per_query_head          one CTA per (tile, query head), the heads in sections as many as fit
                            40 MB of Q / dO / dq together, a section's heads fastest and its
                            tiles in sequence: FlashAttention-3's backward scheduler on a
                            causal row (its dK / dV of a GQA group then summed in float32)

It counts what the real L2 also serves (K / V once per CTA, ids, lse / delta) as nothing, and a
reduce-add as one access: it ranks orders, it does not predict ncu's percentages. Against ncu on
an H200 (benchmarks/results/2026-11-29-h200/ncu_backward_l2/hopper_fa3_16k_64k.json; 50 MB, 132
SMs): 16k causal, the upward walk 0.81 (ncu 0.82), FlashAttention-3 0.98 (ncu 0.97); 64k
causal 0.82 (ncu 0.89) and 1.00 (ncu 0.99). It overstates the snake walk's gain: 0.93 / 0.94
against ncu's 0.85 / 0.91 (ncu_backward_l2/hopper_snake_5708961.json), as its replay keeps the
CTAs in step where real ones drift apart over a walk.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cases import layout  # noqa: E402

HEAD_DIM = 128
BLOCK_ROWS = 64
STEP_BYTES = BLOCK_ROWS * HEAD_DIM * (2 + 2 + 4)  # Q, dO (16-bit) and dq (float32) of a block
SECTION_BYTES = 40 * 2**20  # the per-query-head order's sections: Q, dO, dq of this many bytes


def cta_walks(lower, upper, pairs, group: int, *, snake: bool):
  """[(first block, end block, query heads)] per CTA in launch order, for the (kv head, tile)
  `pairs` in launch order; query heads walked in turn (snake: the odd ones downwards, listed as
  -(h + 1))."""
  ctas = []
  for k, t in pairs:
    if upper[t] <= lower[t]:
      continue
    heads = [k * group + j if not (snake and j % 2) else -(k * group + j + 1)
             for j in range(group)]
    ctas.append((int(lower[t]), int(upper[t]), heads))
  return ctas


def per_query_head_walks(lower, upper, n_heads: int, seq: int):
  """FlashAttention-3's backward order (one CTA per tile and query head): sections of
  2^floor(log2(SECTION_BYTES / one head's Q, dO, dq)) heads, at least one, a section's tiles in
  sequence and its heads fastest."""
  per_head = seq * HEAD_DIM * (2 + 2 + 4)
  section = 1 << max(0, int(np.floor(np.log2(max(1, SECTION_BYTES // per_head)))))
  ctas = []
  for h0 in range(0, n_heads, section):
    for t in range(len(lower)):
      for h in range(h0, min(h0 + section, n_heads)):
        if upper[t] > lower[t]:
          ctas.append((int(lower[t]), int(upper[t]), [h]))
  return ctas


def _steps(cta):
  lo, hi, heads = cta
  for h in heads:
    if h >= 0:
      for blk in range(lo, hi):
        yield (h, blk)
    else:
      for blk in range(hi - 1, lo - 1, -1):
        yield (-h - 1, blk)


def replay(ctas, sms: int, l2_bytes: int) -> dict:
  """Plays the CTAs' steps (see the module docstring): hit rate, steps, makespan, ideal."""
  capacity = max(1, l2_bytes // STEP_BYTES)
  queue = iter(ctas)
  running = [None] * sms
  cache: collections.OrderedDict = collections.OrderedDict()
  hits = steps = time = 0
  total = sum((hi - lo) * len(heads) for lo, hi, heads in ctas)
  for s in range(sms):
    nxt = next(queue, None)
    running[s] = None if nxt is None else _steps(nxt)
  while any(r is not None for r in running):
    busy = False
    for s in range(sms):
      walk = running[s]
      step = None
      while walk is not None:
        step = next(walk, None)
        if step is not None:
          break
        nxt = next(queue, None)
        walk = running[s] = None if nxt is None else _steps(nxt)
      if step is None:
        continue
      busy = True
      steps += 1
      if step in cache:
        hits += 1
        cache.move_to_end(step)
      else:
        cache[step] = None
        if len(cache) > capacity:
          cache.popitem(last=False)
    time += busy
  return dict(hit_rate=hits / max(steps, 1), steps=steps, makespan=time,
              ideal=total / sms, tail=time / max(total / sms, 1e-9) - 1.0)


def tables(case: str, seq: int, kv_heads: int, sms: int):
  """(lower, upper) int [n_tiles]: each 128-row kv tile's visited 64-row query blocks, and
  {layout: [(kv head, tile)] in launch order} for the layouts the model compares."""
  import jax.numpy as jnp

  from kvax_plugin.attention import block_mask as bm
  from kvax_plugin.attention.block_mask import create_attention_mask
  from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as fb
  pos, seg, _ = layout(case, seq, seed=0)
  mask = create_attention_mask(jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos),
                               jnp.asarray(seg), calc_bwd_mask=True)
  bounds = fb.tile_bounds(mask)
  n_tiles = seq // fb.KV_TILE
  lower, upper = (np.asarray(x)[0] for x in bounds[:2])

  def pairs(order):
    order = np.asarray(order)[0]
    return list(zip((order >> fb.ORDER_TILE_BITS).tolist(),
                    (order & (fb.MAX_ORDER_TILES - 1)).tolist()))

  by_documents = np.asarray(bm.documents_longest_first(bounds[0], bounds[1], 1, n_tiles))[0]
  layouts = {
      "documents": pairs(fb.launch_order(bounds, n_tiles, kv_heads, "documents", wave=sms)),
      "documents_heads_together": [(k, int(t)) for t in by_documents for k in range(kv_heads)],
      "heads_slowest": pairs(fb.launch_order(bounds, n_tiles, kv_heads, "heads_slowest")),
  }
  return lower, upper, layouts


def model(case: str, seq: int, sms: int, l2_mb: float, heads: int = 32, kv_heads: int = 8):
  lower, upper, layouts = tables(case, seq, kv_heads, sms)
  group = heads // kv_heads
  l2 = int(l2_mb * 2**20)
  rows = {}
  for name, order in layouts.items():
    for walk in ("up", "snake"):
      rows[f"{name}/{walk}"] = replay(cta_walks(lower, upper, order, group, snake=walk == "snake"),
                                      sms, l2)
  rows["per_query_head"] = replay(per_query_head_walks(lower, upper, heads, seq), sms, l2)
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
  ap.add_argument("--cases", default="causal,docs")
  ap.add_argument("--l2-mb", type=float, default=50.0)
  ap.add_argument("--sms", type=int, default=132)
  ap.add_argument("--out", type=Path, default=None)
  args = ap.parse_args(argv)
  if args.sms < 1 or not args.l2_mb > 0:
    ap.error(f"--sms {args.sms} / --l2-mb {args.l2_mb}: expected >= 1 / > 0")
  bad = [s for s in args.seq if s % 128 or s < 2048]
  if bad:
    ap.error(f"--seq {bad}: expected multiples of 128 of at least 2048 (the documents layout "
             "has 1000 padding tokens)")
  results = []
  for seq in args.seq:
    for case in args.cases.split(","):
      for key, row in model(case, seq, args.sms, args.l2_mb).items():
        results.append(dict(seq=seq, case=case, order=key, **row))
        print(f"{seq:6d} {case:6s} {key:20s} hit {row['hit_rate']:.3f}  "
              f"tail {100 * row['tail']:5.1f}%", flush=True)
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    conditions = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps(dict(conditions=conditions, step_bytes=STEP_BYTES,
                                        results=results), indent=1) + "\n")
  return results


if __name__ == "__main__":
  main()
