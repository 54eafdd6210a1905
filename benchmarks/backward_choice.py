"""The table behind "auto"'s backward on Hopper: the CUDA C++ backward against the Mosaic one over
layouts from one causal document to many short ones, and the share of partly kept blocks from
which the Mosaic backward is faster.

    python -m benchmarks.backward_choice --out DIR                # measure, fit, print
    python -m benchmarks.backward_choice --out DIR --write-table  # and write the package's table
    python -m benchmarks.backward_choice --smoke --out DIR        # CPU dry run (backend "jax")

Layouts (benchmarks/cases.py): "causal" and "docs" with --num-docs documents + 1000 padding
tokens, at each --seq; B=1, 32 query / 8 kv heads, bf16. Per head dims and length, each
implementation is compiled once with the mask, positions and segment ids as jit arguments, then
timed forward+backward on every layout, round-robin (benchmarks/timing.py):
  cuda    backend="hopper", HopperOptions(backward="cuda")
  mosaic  backend="mosaic" (the same forward, the Mosaic backward)
  auto    backend="auto" (hopper with backward="by_mask": the table in force when it runs)
The fit: the threshold on block_mask.partial_share(mask.dkv) that minimises the summed ratio
(chosen / faster) over the layouts; no rule when the CUDA backward should always run.
--write-table writes it to kvax_plugin/attention/kernels/backward_choice.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks.cases import kept_pairs, layout, parse_head_dims, random_inputs  # noqa: E402
from benchmarks.timing import alternate  # noqa: E402
import kvax_plugin  # noqa: E402
from kvax_plugin.attention import block_mask  # noqa: E402
from kvax_plugin.attention.kernels import hopper  # noqa: E402

IMPLS = {"cuda": ("hopper", kvax_plugin.HopperOptions(backward="cuda")),
         "mosaic": ("mosaic", None),
         "auto": ("auto", None)}
SMOKE_IMPLS = {"cuda": ("jax", None), "mosaic": ("reference", None)}


def layouts(seq: int, num_docs: list[int]):
  """(label, positions, segment ids, kept pairs) of "causal" and each documents count."""
  out = []
  pos, seg, lengths = layout("causal", seq, seed=seq)
  out.append(("causal", pos, seg, kept_pairs(lengths)))
  for n in num_docs:
    pos, seg, lengths = layout("docs", seq, seed=seq, num_docs=n, pad=min(1000, seq // 8))
    out.append((f"docs{n}", pos, seg, kept_pairs(lengths)))
  return out


def grad_fn(backend: str, options, scale: float, cot):
  def loss(q, k, v, pos, seg, mask):
    out = kvax_plugin.flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=scale,
                                      backend=backend, kernel_options=options)
    return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(seqs, num_docs, head_dims, impls, rounds: int, heads=32, kv_heads=8,
            min_round_ms: float = 20.0):
  """Rows (impl, seq, layout, head dims, partial_share, ms, ms_rounds) timed round-robin."""
  rows = []
  for d, dv in head_dims:
    for seq in seqs:
      q, k, v, cot = random_inputs(seq + d, seq, heads, kv_heads, d, dv, jnp.bfloat16)
      fns = {name: grad_fn(backend, options, d ** -0.5, cot)
             for name, (backend, options) in impls.items()}
      for label, pos, seg, pairs in layouts(seq, num_docs):
        jpos, jseg = jnp.asarray(pos), jnp.asarray(seg)
        mask = kvax_plugin.create_attention_mask(jpos, jseg, jpos, jseg, calc_bwd_mask=True)
        share = float(block_mask.partial_share(mask.dkv))
        args = (q, k, v, jpos, jseg, mask)
        # one warm-up call each (the first layout's compiles them)
        times = alternate(fns, args, rounds, warmup=1, min_round_ms=min_round_ms)
        names = list(fns)
        start = hopper.mosaic_backward_from(jnp.bfloat16, d, dv)
        picked = "mosaic" if start is not None and share >= start else "cuda"
        for name in names:
          ms = statistics.median(times[name])
          rows.append(dict(impl=name, seq=seq, layout=label, head_dims=[d, dv], pairs=pairs,
                           partial_share=share, ms=ms, ms_rounds=times[name],
                           **({"auto_backward": picked} if name == "auto" else {})))
        print(f"S={seq} D={d}/{dv} {label:8s} partial share {share:.3f}: " + "  ".join(
            f"{n} {statistics.median(times[n]):.3f}" for n in names) + " ms", flush=True)
  return rows


def by_mask_overhead(rows) -> float:
  """The relative cost of the device-side choice when it runs the Mosaic backward: the median of
  auto / mosaic - 1 over the layouts where the table in force picked it (0 when none did)."""
  by_key = {(r["seq"], r["layout"], tuple(r["head_dims"]), r["impl"]): r for r in rows}
  ratios = [r["ms"] / by_key[k[:3] + ("mosaic",)]["ms"] - 1 for k, r in by_key.items()
            if k[3] == "auto" and r.get("auto_backward") == "mosaic" and k[:3] + ("mosaic",) in by_key]
  return max(0.0, statistics.median(ratios)) if ratios else 0.0


def fit(rows) -> list[dict]:
  """Per head dims: the partial-share threshold minimising the summed ratio of what "by_mask"
  would run to the faster backward, the Mosaic backward charged the choice's own cost
  (by_mask_overhead); a rule only when some layouts should run the Mosaic backward."""
  overhead = by_mask_overhead(rows)
  print(f"the choice's cost where it runs the Mosaic backward: {overhead:.1%}", flush=True)
  rules = []
  for dims in sorted({tuple(r["head_dims"]) for r in rows}):
    cases = {}
    for r in rows:
      if tuple(r["head_dims"]) == dims and r["impl"] in ("cuda", "mosaic"):
        cases.setdefault((r["seq"], r["layout"]), {"share": r["partial_share"]})[r["impl"]] = r["ms"]
    cases = [c for c in cases.values() if "cuda" in c and "mosaic" in c]
    shares = sorted({c["share"] for c in cases})
    candidates = [(a + b) / 2 for a, b in zip(shares, shares[1:])] + [shares[0] / 2, np.inf]

    def cost(t):
      return sum((c["mosaic"] * (1 + overhead) if c["share"] >= t else c["cuda"])
                 / min(c["cuda"], c["mosaic"]) for c in cases)
    best = min(candidates, key=lambda t: (cost(t), -t))
    print(f"D={dims[0]}/{dims[1]}: threshold {best:.4f} (summed ratio {cost(best):.4f} over "
          f"{len(cases)} layouts; CUDA always: {cost(np.inf):.4f})", flush=True)
    if np.isfinite(best):
      rules.append(dict(dtype="bfloat16", head_dims=list(dims), features=[],
                        mosaic_from_partial_share=round(float(best), 4)))
  return rules


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq", default="16384,65536")
  ap.add_argument("--num-docs", default="3,12,48,192")
  ap.add_argument("--head-dims", default="128")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--out", required=True, help="folder for backward_choice.json (the rows)")
  ap.add_argument("--write-table", action="store_true",
                  help=f"write the fitted rules to {hopper.BACKWARD_CHOICE.relative_to(ROOT)}")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (jax / reference)")
  ap.add_argument("--fit-from", metavar="JSON", help="fit (and --write-table) from the rows of "
                  "an earlier run's backward_choice.json instead of measuring")
  args = ap.parse_args(argv)
  seqs = [int(s) for s in args.seq.split(",")]
  num_docs = [int(n) for n in args.num_docs.split(",")]
  head_dims = [parse_head_dims(s) for s in args.head_dims.split(",")]
  impls = IMPLS
  if args.smoke:
    seqs, num_docs, head_dims, impls = [256], [3, 12], [(64, 64)], SMOKE_IMPLS
  if args.fit_from:
    earlier = json.loads(Path(args.fit_from).read_text())
    rows, measured = earlier["rows"], dict(earlier["measured"], results=args.fit_from)
  else:
    rows = measure(seqs, num_docs, head_dims, impls, args.rounds,
                   **(dict(heads=4, kv_heads=2) if args.smoke else {}))
    dev = jax.devices()[0]
    measured = dict(date=datetime.date.today().isoformat(), gpu=dev.device_kind,
                    jax=jax.__version__, command=" ".join(sys.argv),
                    layout="B=1, 32 query / 8 kv heads, bf16, forward+backward, round-robin "
                           f"medians of {args.rounds} rounds")
  rules = fit(rows)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "backward_choice.json").write_text(json.dumps(
      dict(measured=measured, rules=rules, rows=rows), indent=1) + "\n")
  if args.write_table:
    table = dict(about=TABLE_ABOUT, gpu=measured["gpu"], rules=rules)
    hopper.BACKWARD_CHOICE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {hopper.BACKWARD_CHOICE}")
  return rows, rules


TABLE_ABOUT = ('HopperOptions(backward="by_mask"), what "auto" runs on Hopper: the Mosaic '
               "backward where block_mask.partial_share(mask.dkv) >= mosaic_from_partial_share "
               "for the inputs' dtype, head dims and features, else the CUDA one. Written by "
               "python -m benchmarks.backward_choice --write-table; the measurement behind it: "
               "docs/status.md.")

if __name__ == "__main__":
  main()
