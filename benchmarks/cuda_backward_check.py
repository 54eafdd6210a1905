"""The CUDA C++ fused backward (kvax_plugin/attention/kernels/cuda_sm90) on a GPU: its gradients
against the float32 reference on small awkward layouts, then its backward time against the Mosaic
backward (two kernels, 7 products) and cuDNN's, same run, interleaved.

    python benchmarks/cuda_backward_check.py --out outputs/cuda_bwd   # writes .json and .log

Timing is of the backward alone: jax.vjp runs the forward once, and the jitted vjp function
(residuals passed in) is timed; every implementation gets the same q, k, v and cotangent
(B=1, 32 query / 8 kv heads, --head-dim 128 by default, bf16). The CUDA kernel's backward is timed
with the Mosaic forward's residuals (its custom VJP), so the two rows differ only in the backward
kernels. The Mosaic backward is timed up to head dim 128 (above, a one-stage ring: 0.31x cuDNN).

A variant named NAME+in_loop (e.g. --variants v7,v7+in_loop) is NAME with the mask in the
exponentials' loop (MASK_IN_LOOP, what a scale that is not > 0 gets): the A/B of the mask pass
at head dims 128 and 64 (the head dim 256 layout has the mask in its loop only: there the two
are one kernel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import layouts  # noqa: E402
from benchmarks.cases import kept_pairs, layout  # noqa: E402
from benchmarks.timing import time_fn  # noqa: E402
from kvax_plugin.attention.block_mask import create_attention_mask  # noqa: E402
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as cuda_bwd  # noqa: E402
from kvax_plugin.attention.reference import reference_attention  # noqa: E402

# name: (layout builder (rng) -> positions, segment ids [B, S]; query heads; kv heads; causal;
# optionally query rows: the queries are the last that many tokens, the keys all S, as on the
# last shard of context parallelism)
CASES = {
    "causal_gqa_512": (lambda r: (np.arange(512, dtype=np.int32)[None],
                                  np.zeros((1, 512), np.int32)), 4, 2, True),
    "docs_padding_mqa_1024": (lambda r: layouts.packed_documents(r, 1, 1024, num_docs=5,
                                                                 pad_tail=77, one_token_docs=2),
                              4, 1, True),
    "non_contiguous_768": (lambda r: layouts.non_contiguous_documents(r, 1, 768, num_docs=3,
                                                                      chunk=41), 2, 2, True),
    "not_causal_docs_640": (lambda r: layouts.packed_documents(r, 1, 640, num_docs=3,
                                                               huge_ids=True), 8, 2, False),
    # two batch rows with different documents
    "batch2_docs_384": (lambda r: layouts.packed_documents(r, 2, 384, num_docs=3, pad_tail=20),
                        4, 2, True),
    # Sq != Skv (as on context parallelism's last shard)
    "query_shorter_docs_768": (lambda r: layouts.packed_documents(r, 1, 768, num_docs=4,
                                                                  pad_tail=30), 4, 2, True, 256),
}


def attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask, *, scale: float,
              variant: str = cuda_bwd.DEFAULT_VARIANT):
  """Attention with the Mosaic forward and the CUDA fused backward (differentiable in q, k, v):
  backend="hopper"'s custom VJP (kernels/hopper.py) with the given fused_backward variant, its
  argument checks left out (so Sq != Skv runs); variant="hopper": the public op itself."""
  import kvax_plugin as kvax
  from kvax_plugin.attention.kernels import hopper

  if variant == "hopper":
    return kvax.flash_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask, scale=scale,
                                backend="hopper")
  cfg = hopper._Static(scale=float(scale), soft_cap=0.0, has_sinks=False,
                       causal=bool(mask.spec.causal), window=0, deterministic=True,
                       interpret=False, variant=variant)
  sinks = jnp.zeros((q.shape[2],), jnp.float32)
  ints = tuple(x.astype(jnp.int32) for x in (q_pos, q_seg, kv_pos, kv_seg))
  return hopper._attention(cfg, q, k, v, sinks, *ints, mask)


def _rel(a, b):
  a, b = (np.asarray(x, np.float32) for x in (a, b))
  return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def check_case(name: str, variant: str = cuda_bwd.DEFAULT_VARIANT,
               d: int = cuda_bwd.HEAD_DIM) -> dict:
  """Relative errors of out, dq, dk, dv against the float32 reference (bf16 inputs)."""
  build, h, kh, causal, *q_rows = CASES[name]
  pos, seg = (jnp.asarray(x) for x in build(np.random.default_rng(sum(map(ord, name)))))
  b, s = pos.shape
  sq = q_rows[0] if q_rows else s
  q_pos, q_seg = pos[:, s - sq:], seg[:, s - sq:]
  keys = jax.random.split(jax.random.PRNGKey(len(name)), 4)
  q = jax.random.normal(keys[0], (b, sq, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kh, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kh, d), jnp.bfloat16)
  cot = jax.random.normal(keys[3], (b, sq, h, d), jnp.float32)
  mask = create_attention_mask(q_pos, q_seg, pos, seg, calc_bwd_mask=True, causal=causal)
  scale = d ** -0.5

  def ours(q, k, v):
    return attention(q, k, v, q_pos, q_seg, pos, seg, mask, scale=scale, variant=variant)

  def ref(q, k, v):
    f32 = lambda x: x.astype(jnp.float32)
    return reference_attention(f32(q), f32(k), f32(v), q_pos, q_seg, pos, seg, causal=causal,
                               scale=scale)

  def grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out,) + vjp(cot.astype(out.dtype))

  mine = jax.device_get(jax.jit(lambda *a: grads(ours, *a))(q, k, v))
  f32 = lambda x: x.astype(jnp.float32)
  theirs = jax.device_get(jax.jit(lambda *a: grads(ref, *a))(f32(q), f32(k), f32(v)))
  errs = {n: _rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), mine, theirs)}
  finite = all(bool(np.isfinite(np.asarray(x, np.float32)).all()) for x in mine)
  return dict(case=name, variant=variant, head_dim=d, errors=errs, finite=finite)


def register_in_loop(variants) -> None:
  """Adds each NAME+in_loop of `variants` to fused_backward.VARIANTS in this process: NAME's
  bits with MASK_IN_LOOP (the kernels built for scales that are not > 0)."""
  for name in variants:
    base, _, suffix = name.partition("+")
    if suffix == "in_loop":
      cuda_bwd.VARIANTS[name] = cuda_bwd.VARIANTS[base] | cuda_bwd.MASK_IN_LOOP
    elif suffix:
      raise ValueError(f"variant {name!r}: expected NAME or NAME+in_loop")


def time_backwards(seq: int, case: str, rounds: int, reps: int, variants,
                   d: int = cuda_bwd.HEAD_DIM) -> list[dict]:
  import kvax_plugin as kvax
  h, kh = 32, 8
  pos, seg, lengths = layout(case, seq, seed=seq)
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (1, seq, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, seq, kh, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, seq, kh, d), jnp.bfloat16)
  cot = jax.random.normal(keys[3], (1, seq, h, d), jnp.bfloat16)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  scale = d ** -0.5
  impls = {}
  if d <= 128:
    impls["mosaic"] = lambda q, k, v: kvax.flash_attention(q, k, v, pos, seg, pos, seg, mask,
                                                           scale=scale, backend="mosaic")
  for variant in variants:
    impls[f"cuda_{variant}"] = (lambda var: lambda q, k, v: attention(
        q, k, v, pos, seg, pos, seg, mask, scale=scale, variant=var))(variant)
  if case == "causal":
    impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation="cudnn")
  backward = {}
  for name, fn in impls.items():
    _, vjp = jax.vjp(fn, q, k, v)
    backward[name] = (jax.jit(lambda vjp, ct: vjp(ct)), (vjp, cot))
  rows = {name: [] for name in impls}
  for _ in range(rounds):
    for name, (fn, args) in backward.items():
      rows[name].append(time_fn(fn, args, rounds=reps, inner=1))  # bench_attention's timer
  pairs = kept_pairs(lengths)  # kept (q, kv) pairs: 5 products of 2 * d flops each
  out = []
  for name, ms in rows.items():
    med = statistics.median(ms)
    out.append(dict(seq=seq, case=case, impl=name, pass_="bwd", ms=med, ms_rounds=ms,
                    tflops=pairs * h * 5 * 2 * d / (med * 1e-3) / 1e12))
  return out


def time_epilogue(seq: int, rounds: int, reps: int,
                  variant: str = cuda_bwd.DEFAULT_VARIANT) -> list[dict]:
  """The fused backward's fixed cost per call outside its kernel, timed alone: zeroing the
  float32 dq buffer [B, H, 2, S / 64, 4096] (the FFI handler's cudaMemsetAsync; here an XLA
  fill of the same bytes) and turning it into dq (reorder, scale, cast: fused_backward's
  epilogue), B = 1, 32 heads."""
  h, d = 32, cuda_bwd.HEAD_DIM
  shape = (1, h, 2, seq // cuda_bwd.Q_BLOCK, cuda_bwd.Q_BLOCK * 64)
  epilogue = lambda accum: cuda_bwd.dq_from_accum(accum, variant, d ** -0.5, jnp.bfloat16)

  accum = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)
  fns = {"dq_zero": (jax.jit(lambda x: jnp.zeros(shape, jnp.float32) + x), (jnp.float32(0),)),
         "dq_epilogue": (jax.jit(epilogue), (accum,))}
  rows = {name: [] for name in fns}
  for _ in range(rounds):
    for name, (fn, args) in fns.items():
      rows[name].append(time_fn(fn, args, rounds=reps, inner=1))
  return [dict(seq=seq, case="fixed", impl=name, pass_="bwd part", ms=statistics.median(ms),
               ms_rounds=ms, tflops=0.0) for name, ms in rows.items()]


def plot(result: dict, path: Path) -> None:
  """Backward ms per implementation, one group of bars per (length, case), the device in the
  title; each bar labelled with its ms and effective TF/s."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = result["timings"]
  if not rows:
    return
  groups = sorted({(r["seq"], r["case"]) for r in rows})
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  fig, ax = plt.subplots(figsize=(max(7, 2.4 * len(groups)), 4.5))
  width = 0.8 / len(impls)
  for i, name in enumerate(impls):
    for g, key in enumerate(groups):
      match = [r for r in rows if (r["seq"], r["case"]) == key and r["impl"] == name]
      if not match:
        continue
      x = g + i * width
      ax.bar(x, match[0]["ms"], width, color=f"C{i}", label=name if g == 0 else None)
      ax.text(x, match[0]["ms"], f"{match[0]['ms']:.1f}\n{match[0]['tflops']:.0f} TF/s",
              ha="center", va="bottom", fontsize=7)
  ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
  ax.set_xticklabels([f"{s // 1024}k {c}" for s, c in groups])
  ax.set_ylim(0, 1.18 * max(r["ms"] for r in rows))  # room for the labels
  ax.set_ylabel("backward ms (lower is better)")
  head_dim = result["conditions"].get("head_dim", 128)
  ax.set_title(f"attention backward alone, B=1, 32 / 8 heads, D {head_dim}, bf16 - "
               f"{result['conditions']['device']}", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--plot-from", type=Path, default=None,
                  help="only draw --out's .png from a saved results .json (no GPU needed)")
  ap.add_argument("--lib", default=None, help="the shared object (default: next to the module)")
  ap.add_argument("--seqs", default="16384")
  ap.add_argument("--cases", default="causal,docs")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--variants", default=cuda_bwd.DEFAULT_VARIANT,
                  help="kernel variants (fused_backward.VARIANTS), each also as NAME+in_loop")
  ap.add_argument("--head-dim", type=int, default=cuda_bwd.HEAD_DIM, choices=(64, 128, 256),
                  help="q / k / v head dim of the checks and timings")
  ap.add_argument("--epilogue", action="store_true",
                  help="also time the fixed cost outside the kernel (dq buffer zeroed, dq "
                       "epilogue) once per length")
  args = ap.parse_args()
  if args.plot_from:
    plot(json.loads(args.plot_from.read_text()), args.out.with_suffix(".png"))
    return
  variants = args.variants.split(",")
  register_in_loop(variants)
  cuda_bwd.load(args.lib)
  result = dict(conditions=dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                                head_dim=args.head_dim, argv=sys.argv[1:]),
                checks=[], timings=[])
  args.out.parent.mkdir(parents=True, exist_ok=True)
  log = open(args.out.with_suffix(".log"), "w")

  def say(msg):
    print(msg, flush=True)
    log.write(msg + "\n")
    log.flush()

  say(f"device {result['conditions']['device']}, jax {jax.__version__}")
  if not args.skip_check:
    for name, variant in ((n, v) for v in variants for n in CASES):
      row = check_case(name, variant, args.head_dim)
      result["checks"].append(row)
      ok = row["finite"] and max(row["errors"].values()) < 2e-2
      say(f"check {variant} {name:24s} {'ok' if ok else 'FAIL'} " +
          " ".join(f"{k} {v:.2e}" for k, v in row["errors"].items()))
      args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
  for seq in (int(x) for x in args.seqs.split(",") if x):
    if args.epilogue:
      for row in time_epilogue(seq, args.rounds, args.reps):
        result["timings"].append(row)
        say(f"time {seq:6d} {row['case']:6s} {row['impl']:10s} {row['ms']:9.3f} ms  rounds "
            f"{[round(x, 3) for x in row['ms_rounds']]}")
    for case in args.cases.split(","):
      for row in time_backwards(seq, case, args.rounds, args.reps, variants, args.head_dim):
        result["timings"].append(row)
        say(f"time {seq:6d} {case:6s} {row['impl']:10s} backward {row['ms']:9.3f} ms "
            f"{row['tflops']:6.1f} TF/s  rounds {[round(x, 3) for x in row['ms_rounds']]}")
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
  plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
  main()
