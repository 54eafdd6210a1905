"""Attention kernel benchmark: our backends against cuDNN, tokamax and FA3, timed in one run.

    python -m benchmarks.run --preset full                 # the README's table (uses this file)
    python benchmarks/bench_attention.py --seq 16384 --impls hopper,mosaic,cudnn --cases causal
    python benchmarks/bench_attention.py --seq 65536 --impls mosaic --split   # each kernel alone
    python benchmarks/bench_attention.py --seq 131072 --cases causal --impls mosaic \
        --variant 'pertile=mosaic:mosaic_forward_grid=per_tile'            # a KernelOptions field

Cases (benchmarks/cases.py): "causal" (one causal document) and "docs" (12 random-length causal
documents followed by 1000 padding tokens), B=1, 32 query heads, 8 kv heads, bf16, head dim 128
by default. Each implementation is timed forward and forward+backward (jax.grad of <out, cotangent> w.r.t.
q, k, v, which includes the forward it needs), as the median over timed rounds of back-to-back
calls after warm-up; --interleave then times every implementation again round-robin, so a drift
of the GPU's clocks cannot favour whoever ran first (the medians of those rounds are reported).
Effective TFLOP/s count only the (q, kv) pairs the mask keeps: forward 2 * H * (Dk + Dv) per
pair (4 * H * D), forward+backward 3.5x that.

Implementations (benchmarks/impls.py): ours through the public op, one per backend name (auto,
hopper, mosaic, mosaic_fused = mosaic with deterministic_backward=False, triton, jax); cudnn
(jax.nn.dot_product_attention, implementation="cudnn"; documents as a dense [B, 1, S, S] mask,
skipped above --max-dense-mask-seq); tokamax_mosaic and tokamax_triton (tokamax's Mosaic GPU and
Pallas-Triton flash attention, documents as a per-row k_start mask); fa3 (FlashAttention-3 for
JAX, benchmarks/fa3.py: documents as separate sequences through its varlen call). The mask
build is timed on its own: it runs once per step, shared by all layers.

Writes <out>.json (conditions: date, GPU, versions, command, shapes) and <out>.png. A peer that
fails or cannot run here records its error instead of a number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages without install
  sys.path.insert(0, str(ROOT))

from benchmarks.cases import (FLOPS_FWD_BWD, NO_FEATURES, PAD, kept_pairs, layout,  # noqa: E402
                              parse_head_dims, random_inputs)
from benchmarks.impls import IMPLS, auto_choice, make_impls, parse_variant  # noqa: E402
from benchmarks.results import kernel_table, plot_kernels  # noqa: E402
from benchmarks.timing import fwd_bwd, interleave, time_fn  # noqa: E402
from benchmarks.tools import kernel_parts  # noqa: E402
from kvax_plugin.attention.block_mask import create_attention_mask  # noqa: E402


def bench_mask_build(pos, seg, rounds):
  jpos, jseg = jnp.asarray(pos), jnp.asarray(seg)
  build = jax.jit(lambda p, s: create_attention_mask(p, s, p, s, calc_bwd_mask=True))
  return time_fn(build, (jpos, jseg), rounds, 5)


def versions():
  out = {"python": platform.python_version(), "jax": jax.__version__}
  for mod in ("jaxlib", "triton", "jax_triton", "tokamax", "maxtext", "kvax_plugin"):
    try:
      m = __import__(mod)
      out[mod] = getattr(m, "__version__", "?")
    except Exception as e:  # noqa: BLE001
      out[mod] = f"unavailable ({type(e).__name__})"
  return out


def measure(*, seqs, cases, impls, passes=("fwd", "fwd_bwd"), head_dims=((128, 128),),
            heads=32, kv_heads=8, dtype=jnp.bfloat16, rounds=15, min_round_ms=20.0,
            interleaved=True, max_dense_mask_seq=32768, num_docs=12, pad=1000, split=False,
            check=False, variants=(), features=NO_FEATURES, after_case=None):
  """Time every implementation on every (head dims, length, case, pass); the rows as dicts
  (impl, seq, case, head_dim, head_dim_v, pass, ms, tflops, pairs, ...; error where one failed).
  features: window / soft_cap / sinks for our backends (NO_FEATURES: none). after_case: called
  with the rows so far after each (head dims, length, case), e.g. to save them before a time
  limit cuts the run."""
  results = []
  for d, dv in head_dims:
    for seq in seqs:
      for case in cases:
        pos, seg, lengths = layout(case, seq, seed=seq, num_docs=num_docs, pad=pad)
        pairs = kept_pairs(lengths, features["window"])
        flops_fwd = 2.0 * heads * (d + dv) * pairs  # Q K^T (2 d) and P V (2 dv) per pair
        scale = d ** -0.5
        q, k, v, cot = random_inputs(seq + d, seq, heads, kv_heads, d, dv, dtype)
        base = dict(seq=seq, case=case, head_dim=d, head_dim_v=dv, pairs=pairs,
                    dtype=jnp.dtype(dtype).name,
                    **({"features": features} if features != NO_FEATURES else {}))
        mask_ms = bench_mask_build(pos, seg, rounds)
        results.append(dict(impl="mask_build", **base, **{"pass": "mask"}, ms=mask_ms,
                            tflops=None))
        print(f"S={seq} {case} D={d}/{dv}: mask build {mask_ms:.3f} ms; kept pairs {pairs:.3e}",
              flush=True)
        fns, mask = make_impls(case, pos, seg, scale, impls, variants, features, heads, (d, dv))
        picked = auto_choice(mask, dtype, d, dv, features)
        outs = {}
        timed = {p: [] for p in passes}  # pass -> [(name, compiled fn, inner, row)]
        for name in list(impls) + [v[0] for v in variants]:
          fn = fns.get(name, f"unknown implementation {name!r} (known: {', '.join(IMPLS)})")
          for p in passes:
            row = dict(impl=name, **base, ms=None, tflops=None, **{"pass": p})
            if getattr(fn, "kernel_options", None):
              row["kernel_options"] = fn.kernel_options
            if name == "auto" and picked:
              row["auto_picked"] = picked
            if isinstance(fn, str):
              row["error"] = fn
            elif name == "cudnn" and case == "docs" and seq > max_dense_mask_seq:
              row["error"] = (f"skipped: a dense {seq}x{seq} mask is above "
                              f"max_dense_mask_seq {max_dense_mask_seq}")
            if "error" in row:
              results.append(row)
              print(f"  {name:15s} {p:8s} not run: {row['error']}", flush=True)
              continue
            try:
              if p == "fwd":
                f = jax.jit(fn)
              else:
                f = fwd_bwd(fn, cot)
              if p == "fwd" and check:
                outs[name] = f(q, k, v)
              # one round lasts about min_round_ms: short kernels are called many times a round
              inner = max(1, int(min_round_ms / max(time_fn(f, (q, k, v), 1, 1), 1e-3)))
              ms = time_fn(f, (q, k, v), rounds, inner)
              flops = flops_fwd * (1.0 if p == "fwd" else FLOPS_FWD_BWD)
              row.update(ms=ms, tflops=flops / ms / 1e9, inner=inner, rounds=rounds)
              timed[p].append((name, f, inner, row))
              print(f"  {name:15s} {p:8s} {ms:9.3f} ms  {row['tflops']:7.1f} TF/s", flush=True)
            except Exception as e:  # noqa: BLE001 - a peer's failure is a result, not a crash
              row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
              print(f"  {name:15s} {p:8s} FAILED {row['error'][:200]}", flush=True)
              traceback.print_exc(limit=2)
            results.append(row)
          if split and not isinstance(fn, str) and name in ("mosaic", "triton"):
            try:
              time_parts = (kernel_parts.time_parts_mosaic if name == "mosaic"
                            else kernel_parts.time_parts_triton)
              parts = time_parts(mask, pos, seg, q, k, v, cot, scale, rounds)
              results.append(dict(impl=name, **base, **{"pass": "parts"}, parts_ms=parts))
              print(f"  {name:15s} parts    " + "  ".join(
                  f"{kk} {vv:.3f}" if isinstance(vv, float) else f"{kk} {vv}"
                  for kk, vv in parts.items()) + " ms", flush=True)
            except Exception as e:  # noqa: BLE001
              print(f"  {name:15s} parts    FAILED {type(e).__name__}: {str(e)[:200]}",
                    flush=True)
        if interleaved:
          interleave(timed, (q, k, v), rounds, flops_fwd)
        if check and len(outs) > 1:
          first, ref = next(iter(outs.items()))
          real = jnp.asarray(seg != PAD)[..., None, None]
          for other, o in list(outs.items())[1:]:
            a, b = ref.astype(jnp.float32), o.astype(jnp.float32)
            err = float(jnp.linalg.norm(jnp.where(real, a - b, 0)) /
                        jnp.linalg.norm(jnp.where(real, a, 0)))
            print(f"  check: {other} vs {first} rel-L2 {err:.2e} (non-padding rows)", flush=True)
            results.append(dict(impl=f"check_{other}_vs_{first}", **base, **{"pass": "check"},
                                rel_l2=err, ms=None))
        del fns, outs
        if after_case is not None:
          after_case(results)
  return results


def conditions(*, heads, kv_heads, dtype, num_docs, pad, rounds, interleaved, argv=None):
  dev = jax.devices()[0]
  return dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      gpu=dev.device_kind, platform=dev.platform, versions=versions(),
      command=" ".join(argv if argv is not None else sys.argv),
      env={k: v for k, v in os.environ.items() if k.startswith(("KVAX_", "XLA_FLAGS"))},
      layout=(f"B=1, {heads} q heads, {kv_heads} kv heads, {jnp.dtype(dtype).name}; docs = "
              f"{num_docs} random-length documents + {pad} padding tokens"),
      timing=(f"median of {rounds} rounds of back-to-back calls"
              + (", implementations interleaved round-robin in balanced orders "
                 "(timing.round_orders)" if interleaved else "")),
      flops=("fwd 2*H*(Dk+Dv)*kept_pairs (4*H*D when Dk = Dv); fwd_bwd "
             f"{FLOPS_FWD_BWD}x that"))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq", default="16384,65536")
  ap.add_argument("--cases", default="causal,docs")
  ap.add_argument("--head-dims", default="128",
                  help="comma-separated head dims; DK:DV for a value head dim unlike the "
                       "query / key one (MLA: 192:128)")
  ap.add_argument("--impls", default="auto,hopper,mosaic,cudnn,tokamax_mosaic",
                  help=f"comma-separated, of: {', '.join(IMPLS)}")
  ap.add_argument("--passes", default="fwd,fwd_bwd")
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--min-round-ms", type=float, default=20.0)
  ap.add_argument("--max-dense-mask-seq", type=int, default=32768,
                  help="cuDNN documents need an S x S mask: skip it above this length")
  ap.add_argument("--out", default=str(ROOT / "outputs" / "bench_attention"))
  ap.add_argument("--check", action="store_true",
                  help="compare every forward output with the first implementation's")
  ap.add_argument("--interleave", action="store_true",
                  help="after timing each implementation alone, time them again round-robin "
                  "and report those medians as ms (the one-by-one medians stay as "
                  "ms_sequential)")
  ap.add_argument("--variant", action="append", default=[], metavar="LABEL=BACKEND:FIELD=VALUE,...",
                  help="an extra run of one of our backends with kvax_plugin.KernelOptions "
                       "fields set, e.g. 'pertile=mosaic:mosaic_forward_grid=per_tile' "
                       "(repeatable; docs/kernels.md lists the fields)")
  ap.add_argument("--num-docs", type=int, default=12,
                  help="documents in the 'docs' case's row (before its 1000 padding tokens)")
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  ap.add_argument("--window", type=int, default=None,
                  help="sliding window for our backends (the peers are then not run)")
  ap.add_argument("--soft-cap", type=float, default=None,
                  help="logits soft cap for our backends (the peers are then not run)")
  ap.add_argument("--sinks", action="store_true",
                  help="one sink logit per head for our backends (the peers are then not run)")
  ap.add_argument("--split", action="store_true",
                  help="also time each kernel of mosaic / triton alone "
                       "(benchmarks/tools/kernel_parts.py)")
  args = ap.parse_args()
  if args.num_docs < 1:
    ap.error(f"--num-docs: expected a positive number of documents, got {args.num_docs}")
  try:
    variants = [parse_variant(v) for v in args.variant]
  except ValueError as e:
    ap.error(str(e))
  heads, kv_heads, dtype = 32, 8, jnp.dtype(args.dtype)
  features = dict(window=args.window, soft_cap=args.soft_cap, sinks=args.sinks)
  print(f"device: {jax.devices()[0].device_kind}; versions: {versions()}", flush=True)
  results = measure(seqs=[int(s) for s in args.seq.split(",")], cases=args.cases.split(","),
                    impls=args.impls.split(","), passes=args.passes.split(","),
                    head_dims=[parse_head_dims(s) for s in args.head_dims.split(",")],
                    heads=heads, kv_heads=kv_heads, dtype=dtype, rounds=args.rounds,
                    min_round_ms=args.min_round_ms, interleaved=args.interleave,
                    max_dense_mask_seq=args.max_dense_mask_seq, split=args.split,
                    check=args.check, variants=variants, features=features,
                    num_docs=args.num_docs)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  meta = conditions(heads=heads, kv_heads=kv_heads, dtype=dtype, num_docs=args.num_docs, pad=1000,
                    rounds=args.rounds, interleaved=args.interleave)
  if features != NO_FEATURES:
    meta["features"] = features
  out.with_suffix(".json").write_text(json.dumps(dict(conditions=meta, results=results),
                                                 indent=1))
  plot_kernels(results, out.with_suffix(".png"),
               f"attention kernels - {jax.devices()[0].device_kind}")
  print("\n" + kernel_table(results))


if __name__ == "__main__":
  main()
