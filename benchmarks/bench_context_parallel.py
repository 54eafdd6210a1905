"""Context parallelism on N devices against one device: agreement and speed-up.

On the 2-GPU machine (backend "auto" resolves to Triton there), from the repository root:

    python benchmarks/bench_context_parallel.py --out_dir $OUT/cp

On CPU with small sizes (simulated devices; the jax backend):

    .venv/bin/python benchmarks/bench_context_parallel.py --cpu_devices 2 --seq_len 2048 \
        --heads 4 --kv_heads 2 --head_dim 64 --num_pad 100 --iters 3 --out_dir /tmp/cp

Defaults: 128k tokens (B=1) packed with 12 random-length documents and 1000 padding tokens,
32 query heads, 8 kv heads, head dim 128, bfloat16, causal; cp = every visible device.
The single-device run uses device 0 and inputs in natural order; the cp runs use a mesh
("context",) over the first cp devices, once with inputs in the load-balanced order
(to_load_balanced_order) and once in natural order (--orders picks). Masks are built once
outside the timed region (as a training step builds one per step for every layer); their build
time is reported apart. Timings: median of --iters runs after --warmup, each waited to completion.
Agreement: cp results are un-permuted and compared with the single-device ones (output and
dq, dk, dv): max |diff| and relative L2 error; `agree` is rel_l2 <= --tol (default 2e-2 for
16-bit inputs, 1e-5 for float32: dk / dv sums are rounded differently across shards).
Writes <out_dir>/context_parallel_cp<N>_<seq_len>.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the repository root: kvax_plugin without install
sys.path.insert(0, _HERE)


def _parse(argv):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out_dir", required=True, help="directory for the JSON result")
  ap.add_argument("--cp", type=int, default=None, help="context parallelism (default: all devices)")
  ap.add_argument("--seq_len", type=int, default=131072)
  ap.add_argument("--num_docs", type=int, default=12)
  ap.add_argument("--num_pad", type=int, default=1000)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--heads", type=int, default=32)
  ap.add_argument("--kv_heads", type=int, default=8)
  ap.add_argument("--head_dim", type=int, default=128)
  ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
  ap.add_argument("--backend", default="auto", choices=("auto", "jax", "triton", "reference"))
  ap.add_argument("--orders", default="permuted,natural",
                  help="token orders of the cp runs: permuted (load-balanced) and/or natural")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--tol", type=float, default=None, help="rel L2 bound for `agree`")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--cpu_devices", type=int, default=None,
                  help="run on CPU with this many simulated devices (sets XLA_FLAGS)")
  return ap.parse_args(argv)


def _median_ms(fn, args, iters: int, warmup: int):
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), times


def main(argv=None) -> dict:
  args = _parse(argv)
  if args.cpu_devices:
    # Must happen before jax initialises its backends.
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={args.cpu_devices}")
    os.environ["JAX_PLATFORMS"] = "cpu"

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from cp_layouts import random_documents
  from kvax_plugin.attention.api import create_attention_mask, flash_attention, resolve_backend
  from kvax_plugin.attention.context_parallel import (context_parallel_balance,
                                              to_load_balanced_order,
                                              from_load_balanced_order)

  devices = jax.devices()
  cp = args.cp or len(devices)
  if cp > len(devices):
    raise SystemExit(f"--cp {cp} needs {cp} devices, {len(devices)} visible: {devices}")
  backend = resolve_backend(args.backend)
  dtype = jnp.dtype(args.dtype)
  tol = args.tol if args.tol is not None else (1e-5 if dtype == jnp.float32 else 2e-2)
  b, s, h, kh, d = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
  scale = d ** -0.5

  # ---- inputs (natural order, host), generated once
  pos, seg = random_documents(s, args.num_docs, args.num_pad, batch=b, seed=args.seed)
  rng = np.random.default_rng(args.seed)
  host = {
      "q": rng.standard_normal((b, s, h, d), np.float32),
      "k": rng.standard_normal((b, s, kh, d), np.float32),
      "v": rng.standard_normal((b, s, kh, d), np.float32),
      "w": rng.standard_normal((b, s, h, d), np.float32),  # output cotangent
  }
  host = {n: x.astype(dtype) for n, x in host.items()}

  def make_fns(mesh, specs, perm):
    kw = dict(mesh=mesh, query_specs=specs[0], kv_specs=specs[1],
              permute_tokens_for_load_balance=perm) if mesh is not None else {}

    @jax.jit
    def build_mask(pos, seg):
      return create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, **kw)

    def attend(q, k, v, pos, seg, mask):
      return flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=scale, backend=backend,
                             **kw)

    fwd = jax.jit(attend)

    @jax.jit
    def fwd_bwd(q, k, v, w, pos, seg, mask):
      def loss(q, k, v):
        out = attend(q, k, v, pos, seg, mask)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
      (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
      return out, grads

    return build_mask, fwd, fwd_bwd

  def run(mesh, specs, perm, put):
    names = ("q", "k", "v", "w")
    arrs = [host[n] for n in names] + [pos, seg]
    if perm:
      arrs = to_load_balanced_order(tuple(arrs), cp)
    q, k, v, w, p, sg = (put(x) for x in arrs)
    build_mask, fwd, fwd_bwd = make_fns(mesh, specs, perm)
    mask_ms, _ = _median_ms(build_mask, (p, sg), max(3, args.iters // 4), 1)
    mask = build_mask(p, sg)
    fwd_ms, fwd_all = _median_ms(fwd, (q, k, v, p, sg, mask), args.iters, args.warmup)
    fb_ms, fb_all = _median_ms(fwd_bwd, (q, k, v, w, p, sg, mask), args.iters, args.warmup)
    out, grads = fwd_bwd(q, k, v, w, p, sg, mask)
    timing = {"mask_ms": mask_ms, "fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms,
              "fwd_all_ms": fwd_all, "fwd_bwd_all_ms": fb_all}
    return timing, (out, *grads)

  # ---- one device
  dev0 = devices[0]
  single_t, single_res = run(None, None, False, lambda x: jax.device_put(x, dev0))

  # ---- cp devices
  mesh = Mesh(np.array(devices[:cp]), ("context",))
  specs = ((None, "context", None, None), (None, None, None, None))

  def put_cp(x):  # batch replicated, sequence over "context", the rest whole
    return jax.device_put(x, NamedSharding(mesh, P(None, "context", *([None] * (x.ndim - 2)))))

  @jax.jit
  def compare(a, ref):
    a32, r32 = a.astype(jnp.float32), ref.astype(jnp.float32)
    diff = a32 - r32
    return (jnp.max(jnp.abs(diff)), jnp.sqrt(jnp.sum(diff * diff)),
            jnp.sqrt(jnp.sum(r32 * r32)), jnp.max(jnp.abs(r32)))

  unpermute = jax.jit(lambda x: from_load_balanced_order(x, cp))
  pairs = None
  runs = {}
  for order in args.orders.split(","):
    if order not in ("permuted", "natural"):
      raise SystemExit(f"--orders takes permuted and/or natural, got {order!r}")
    perm = order == "permuted" and cp > 1
    cp_t, cp_res = run(mesh, specs, perm, put_cp)
    # Agreement on device 0 in float32, cp results back in natural order.
    agreement = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), cp_res, single_res):
      got = jax.device_put(got, dev0)
      if perm:
        got = unpermute(got)
      mx, dn, rn, rmax = (float(x) for x in compare(got, want))
      agreement[name] = {"max_abs_diff": mx, "rel_l2": dn / rn if rn > 0 else float(dn > 0),
                         "ref_max_abs": rmax}
    del cp_res
    bal = context_parallel_balance(pos, seg, cp, permute=perm)
    pairs = sum(bal["kept_pairs"])
    runs[order] = {
        "timing": cp_t,
        "speedup": {"fwd": single_t["fwd_ms"] / cp_t["fwd_ms"],
                    "fwd_bwd": single_t["fwd_bwd_ms"] / cp_t["fwd_bwd_ms"]},
        "balance": {k: bal[k] for k in ("kept_pairs", "visited_blocks", "kept_max_over_min",
                                         "visited_max_over_min")},
        "agreement": agreement,
        "agree": all(a["rel_l2"] <= tol for a in agreement.values()),
    }

  # Work: exact kept pairs -> effective TFLOP/s (forward 4*H*D per pair, backward 2.5x that).
  fwd_flops = 4.0 * h * d * pairs
  fb_flops = fwd_flops * 3.5
  tflops = lambda flops, ms: flops / (ms * 1e-3) / 1e12
  for r in runs.values():
    r["effective_tflops_total"] = {"fwd": tflops(fwd_flops, r["timing"]["fwd_ms"]),
                                   "fwd_bwd": tflops(fb_flops, r["timing"]["fwd_bwd_ms"])}
  result = {
      "benchmark": "context_parallel", "cp": cp, "backend": backend,
      "config": {k: getattr(args, k) for k in ("seq_len", "num_docs", "num_pad", "batch", "heads",
                                               "kv_heads", "head_dim", "dtype", "iters", "warmup",
                                               "seed")},
      "devices": [str(x) for x in devices[:cp]], "device_kind": devices[0].device_kind,
      "jax_version": jax.__version__, "python": platform.python_version(),
      "kept_pairs": pairs, "tolerance_rel_l2": tol,
      "single_device": {"timing": single_t,
                        "effective_tflops": {"fwd": tflops(fwd_flops, single_t["fwd_ms"]),
                                             "fwd_bwd": tflops(fb_flops,
                                                               single_t["fwd_bwd_ms"])}},
      "context_parallel": runs,
      "agree": all(r["agree"] for r in runs.values()),
  }
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f"context_parallel_cp{cp}_{s}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)

  print(f"context parallelism cp={cp} vs 1 device, backend={backend}, {devices[0].device_kind}, "
        f"S={s}, {args.num_docs} docs + {args.num_pad} pad, H={h} K={kh} D={d} {args.dtype}")
  print(f"  {'':<16}{'mask ms':>10}{'fwd ms':>10}{'fwd+bwd ms':>12}{'speed-up fwd':>14}"
        f"{'fwd+bwd':>9}{'kept max/min':>14}{'rel L2 (max)':>14}")
  t = single_t
  print(f"  {'1 device':<16}{t['mask_ms']:>10.2f}{t['fwd_ms']:>10.2f}{t['fwd_bwd_ms']:>12.2f}")
  for order, r in runs.items():
    t = r["timing"]
    worst = max(a["rel_l2"] for a in r["agreement"].values())
    print(f"  {f'cp={cp} {order}':<16}{t['mask_ms']:>10.2f}{t['fwd_ms']:>10.2f}"
          f"{t['fwd_bwd_ms']:>12.2f}{r['speedup']['fwd']:>13.2f}x{r['speedup']['fwd_bwd']:>8.2f}x"
          f"{r['balance']['kept_max_over_min']:>14.2f}{worst:>14.3g}")
  print(f"  agree (rel L2 <= {tol:g} for out, dq, dk, dv): {result['agree']}; wrote {path}")
  return result


if __name__ == "__main__":
  main()
