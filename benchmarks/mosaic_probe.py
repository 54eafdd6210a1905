"""GPU probe for the Mosaic GPU backend: correctness on awkward cases, then same-run timings.

    python benchmarks/mosaic_probe.py --out $OUT/probe.json [--seq 16384] [--skip_check]

Part 1 checks forward and every gradient against the float32 reference (relative L2) on small
cases (causal, documents with padding, GQA/MQA, window + soft cap + sinks, head dims 64..256,
MLA 192/128, Sq != Skv), both backward modes. Part 2 times, in one process, forward and
forward+backward of mosaic (fused-dq and deterministic backward), triton (if importable) and
cuDNN (jax.nn.dot_product_attention) at --seq, B=1, 32/8 heads, head dim 128, bf16, for a causal
document and for 12 documents + 1000 padding tokens (cuDNN: causal only). Effective TFLOP/s count
kept pairs only. Development tool: the benchmark of record is bench_attention.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvax_plugin.attention.block_mask import create_attention_mask  # noqa: E402
from kvax_plugin.attention.kernels.mosaic import backend as mosaic  # noqa: E402
from kvax_plugin.attention.reference import reference_attention  # noqa: E402


def rel(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def layout_from_segments(segs, b):
  sg = np.asarray(segs, np.int32)
  ps = np.zeros(len(sg), np.int32)
  for s in np.unique(sg):
    ps[sg == s] = np.arange((sg == s).sum())
  return jnp.asarray(ps)[None].repeat(b, 0), jnp.asarray(sg)[None].repeat(b, 0)


def docs_layout(seq, num_docs, pad, seed):
  rng = np.random.default_rng(seed)
  body = seq - pad
  cuts = np.sort(rng.choice(np.arange(1, body), size=num_docs - 1, replace=False))
  lengths = np.diff(np.concatenate([[0], cuts, [body]]))
  segs = np.concatenate([np.full(n, d) for d, n in enumerate(lengths)] + [np.full(pad, -1)])
  return segs, lengths


def check_case(name, *, s, skv=None, h=4, kh=2, d=128, dv=None, causal=True, window=None,
               cap=None, sinks=False, segs=None, det=False, b=1, dtype=jnp.bfloat16):
  dv = dv or d
  skv = skv or s
  ks = jax.random.split(jax.random.key(hash(name) % 1000), 6)
  q = jax.random.normal(ks[0], (b, s, h, d), dtype)
  k = jax.random.normal(ks[1], (b, skv, kh, d), dtype)
  v = jax.random.normal(ks[2], (b, skv, kh, dv), dtype)
  do = jax.random.normal(ks[4], (b, s, h, dv), jnp.float32)
  if segs is None:
    qpos, qseg = layout_from_segments(np.zeros(s), b)
    kpos, kseg = layout_from_segments(np.zeros(skv), b)
  else:
    qpos, qseg = layout_from_segments(segs[:s], b)
    kpos, kseg = layout_from_segments(segs[:skv], b)
  if skv != s:
    qpos = qpos + (skv - s)
  mask = create_attention_mask(qpos, qseg, kpos, kseg, causal=causal, sliding_window=window,
                               calc_bwd_mask=True)
  sk = jax.random.normal(ks[3], (h,), jnp.float32) if sinks else None
  scale = d ** -0.5

  def ours(q, k, v, sk):
    return mosaic.flash_attention_mosaic(q, k, v, qpos, qseg, kpos, kseg, mask, scale=scale,
                                         logits_soft_cap=cap, sinks=sk,
                                         deterministic_backward=det)

  def ref(q, k, v, sk):
    f32 = lambda x: x.astype(jnp.float32)
    return reference_attention(f32(q), f32(k), f32(v), qpos, qseg, kpos, kseg, causal=causal,
                               sliding_window=window, scale=scale, logits_soft_cap=cap,
                               sinks=sk)

  with jax.default_matmul_precision("highest"):
    o2, vjp2 = jax.vjp(ref, q, k, v, sk) if sinks else jax.vjp(
        lambda q, k, v: ref(q, k, v, None), q, k, v)
    g2 = vjp2(do)
  o1, vjp1 = jax.vjp(jax.jit(ours), q, k, v, sk) if sinks else jax.vjp(
      jax.jit(lambda q, k, v: ours(q, k, v, None)), q, k, v)
  g1 = vjp1(do.astype(o1.dtype))
  errs = [rel(o1, o2)] + [rel(x, y) for x, y in zip(g1, g2)]
  finite = bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in (o1, *g1)))
  return dict(errs=errs, finite=finite)


CASES = [
    dict(name="causal_d128", s=1024),
    dict(name="docs_pad_d128_det", s=1000, det=True,
         segs=[3] * 300 + [0] * 1 + [9] * 400 + [2] * 150 + [-1] * 149),
    dict(name="docs_pad_d128", s=1000,
         segs=[3] * 300 + [0] * 1 + [9] * 400 + [2] * 150 + [-1] * 149),
    dict(name="mqa_window_cap_sinks_noncontig", s=768, h=8, kh=1, window=100, cap=30.0,
         sinks=True, segs=([0] * 100 + [2**30] * 156) * 3),
    dict(name="d256", s=512, d=256, h=4, kh=2),
    dict(name="mla_192_128", s=512, d=192, dv=128, h=4, kh=4),
    dict(name="sq_ne_skv_fp16", s=256, skv=1280, h=4, kh=2, dtype=jnp.float16),
    dict(name="d64_noncausal_window", s=512, d=64, causal=False, window=64, h=2, kh=2),
]


def time_fn(fn, args, rounds=20, inner=5):
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3 / inner)
  return statistics.median(times)


def bench(seq, results, rounds):
  h, kh, d = 32, 8, 128
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (1, seq, h, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, seq, kh, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, seq, kh, d), jnp.bfloat16)
  do = jax.random.normal(ks[3], (1, seq, h, d), jnp.bfloat16)
  try:
    from kvax_plugin.attention.kernels.triton import backend as triton_backend
  except Exception as e:  # noqa: BLE001
    triton_backend = None
    print("triton backend unavailable:", e)
  for case in ("causal", "docs"):
    if case == "causal":
      segs, lengths = np.zeros(seq, np.int32), np.array([seq])
    else:
      segs, lengths = docs_layout(seq, 12, 1000, 0)
    pos, seg = layout_from_segments(segs, 1)
    pairs = int(np.sum(lengths.astype(np.int64) * (lengths + 1) // 2))
    mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
    impls = {}
    for det in (False, True):
      impls[f"mosaic{'_det' if det else ''}"] = (
          lambda q, k, v, det=det: mosaic.flash_attention_mosaic(
              q, k, v, pos, seg, pos, seg, mask, scale=d ** -0.5, logits_soft_cap=None,
              sinks=None, deterministic_backward=det))
    if triton_backend is not None:
      impls["triton"] = lambda q, k, v: triton_backend.flash_attention_triton(
          q, k, v, pos, seg, pos, seg, mask, scale=d ** -0.5, logits_soft_cap=None, sinks=None)
    if case == "causal":
      impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, scale=d ** -0.5, implementation="cudnn")
    outs = {}
    for name, f in impls.items():
      row = dict(case=case, seq=seq, impl=name)
      try:
        fwd = jax.jit(f)
        grad = jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v)[1](do))
        outs[name] = fwd(q, k, v)
        row["fwd_ms"] = time_fn(fwd, (q, k, v), rounds)
        row["fwd_bwd_ms"] = time_fn(grad, (q, k, v), rounds)
        row["fwd_tflops"] = 4 * h * d * pairs / row["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3.5 * 4 * h * d * pairs / row["fwd_bwd_ms"] / 1e9
      except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        traceback.print_exc()
      results["bench"].append(row)
      print(json.dumps(row), flush=True)
    if "mosaic" in outs:
      for name, o in outs.items():
        print(f"  {case}: rel diff mosaic vs {name}: {rel(outs['mosaic'], o):.2e}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/probe.json")
  ap.add_argument("--seq", type=int, default=16384)
  ap.add_argument("--rounds", type=int, default=20)
  ap.add_argument("--skip_check", action="store_true")
  ap.add_argument("--only", default="")
  args = ap.parse_args()
  results = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, checks={},
                 bench=[])
  if not args.skip_check:
    for case in CASES:
      case = dict(case)
      name = case.pop("name")
      if args.only and args.only not in name:
        continue
      t0 = time.time()
      try:
        r = check_case(name, **case)
      except Exception as e:  # noqa: BLE001
        r = dict(error=f"{type(e).__name__}: {str(e)[:3000]}")
        traceback.print_exc()
      r["seconds"] = round(time.time() - t0, 1)
      results["checks"][name] = r
      print(name, json.dumps(r), flush=True)
      Path(args.out).write_text(json.dumps(results, indent=1))
  if args.seq:
    bench(args.seq, results, args.rounds)
  Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
