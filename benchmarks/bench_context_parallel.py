"""Context parallelism on N devices against one device, per token order: agreement and speed-up.

On the 2-GPU machine (backend "auto" resolves to Triton there), from the repository root:

    python benchmarks/bench_context_parallel.py --out_dir $OUT/cp

The same program on CPU with tiny sizes (2 simulated devices, the jax backend, float32), so the
GPU run is never its first run:

    .venv/bin/python benchmarks/bench_context_parallel.py --smoke --out_dir /tmp/cp

Defaults: 128k tokens (B=1), 32 query heads, 8 kv heads, head dim 128, bfloat16, causal, the
library's default blocks (128), cp = every visible device. Two layouts: `one_doc` (one causal
document filling the row) and `packed` (12 random-length documents + 1000 padding tokens). For
each layout: one device in natural order, then the cp mesh ("context",) once per token order
(--orders: natural, llama3, balanced; see kvax_plugin.attention.token_order), all in the same
run. Inputs are permuted into the order on device 0, the mask is built once outside the timed
region (a training step builds one per step for every layer) and its build time is reported
apart; so is the time to compute the balanced order on the device. Timings: median of --iters
runs after --warmup, each waited to completion; forward and forward+backward (sum of output x
random cotangent, gradients of q, k, v). Compiled functions are shared by both layouts.
Agreement: cp results are put back in natural order and compared with the one-device ones
(output, dq, dk, dv): relative L2 error, `agree` when <= --tol (default 2e-2 for 16-bit inputs,
1e-5 for float32). Per order also the balance report (context_parallel_balance: max / min over
ranks of kept pairs and visited blocks). Finally the op's collectives are timed alone on the same shapes (the k / v all-gather; the dk / dv
reduce-scatter in the dtype the library sums in): the communication a token order cannot remove,
which is what separates a balanced cp step from the ideal cp-fold speed-up.
--overlap both also times every order with the k / v collective overlapped with the local part
of the attention (create_attention_mask's overlap_kv_gather; rows '<order>+overlap', same run);
--overlap on times only those.
Writes <out_dir>/context_parallel_cp<N>_<seq_len>.json
and .png (benchmarks/plot_context_parallel.py, which also plots several result files together)
and prints a summary. Target (issue 16): fwd+bwd speed-up >= 1.9x on 2 GPUs at 128k for both
layouts in the balanced order.
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

ORDERS = ("natural", "llama3", "balanced")
LAYOUTS = ("one_doc", "packed")
# The smallest run with every path of the program: 512 tokens are 4 query blocks of 128, the
# fewest that the balanced order can split evenly over 2 devices (2 blocks each); 8 documents
# leave several per block (partial blocks) and balance to 1.01; 2 query heads on 1 kv head keep
# the grouped-query path. Compilation is most of its time, and it grows with the blocks.
SMOKE = dict(cpu_devices=2, seq_len=512, num_docs=8, num_pad=50, heads=2, kv_heads=1,
             head_dim=16, dtype="float32", backend="jax", iters=2, warmup=1)


def _parse(argv):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out_dir", required=True, help="directory for the JSON result")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny CPU run (2 simulated devices, jax backend, float32): " +
                  " ".join(f"{k}={v}" for k, v in SMOKE.items()))
  ap.add_argument("--cp", type=int, default=None, help="context parallelism (default: all devices)")
  ap.add_argument("--seq_len", type=int, default=131072)
  ap.add_argument("--layouts", default=",".join(LAYOUTS), help="one_doc and/or packed")
  ap.add_argument("--num_docs", type=int, default=12, help="documents of the packed layout")
  ap.add_argument("--num_pad", type=int, default=1000, help="padding tokens of the packed layout")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--heads", type=int, default=32)
  ap.add_argument("--kv_heads", type=int, default=8)
  ap.add_argument("--head_dim", type=int, default=128)
  ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
  ap.add_argument("--backend", default="auto",
                  help="flash_attention backend (auto, jax, triton, mosaic, hopper, reference)")
  ap.add_argument("--orders", default=",".join(ORDERS), help="token orders of the cp runs")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--tol", type=float, default=None, help="rel L2 bound for `agree`")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--variant_options", action="append", default=[],
                  metavar="FIELD=VALUE[,...]",
                  help="also time every order with these kvax_plugin.KernelOptions fields "
                       "(e.g. dq_after_dkv=true; values: integers, true / false, or strings), "
                       "same run; repeatable; rows '<order>+<FIELD=VALUE,...>'")
  ap.add_argument("--kv_grad_reduce_dtype", choices=("auto", "float32", "input"), default="auto",
                  help="dtype of the cross-shard sum of dk / dv (create_attention_mask's "
                  "kv_grad_reduce_dtype): auto (the library's choice: the input dtype with two "
                  "context shards, float32 with more), float32, or the input dtype")
  ap.add_argument("--overlap", choices=("off", "on", "both"), default="off",
                  help="the context-parallel path with the k / v collective overlapped by the "
                       "local part of the attention (create_attention_mask's overlap_kv_gather): off, "
                       "on (only those rows, '<order>+overlap'), or both in the same run")
  ap.add_argument("--cpu_devices", type=int, default=None,
                  help="run on CPU with this many simulated devices (sets XLA_FLAGS)")
  args = ap.parse_args(argv)
  if args.smoke:
    for k, v in SMOKE.items():
      setattr(args, k, v)
  for name, allowed in (("layouts", LAYOUTS), ("orders", ORDERS)):
    values = getattr(args, name).split(",")
    bad = [v for v in values if v not in allowed]
    if bad or not values:
      ap.error(f"--{name}: {bad or values} not among {allowed}")
    setattr(args, name, values)
  for v in args.variant_options:
    try:
      _kernel_options(v)
    except (TypeError, ValueError) as e:
      ap.error(f"--variant_options {v!r}: {e}")
  return args


def _kernel_options(spec: str):
  """'field=value,field=value' -> kvax_plugin.KernelOptions (its own checks name a bad field)."""
  from kvax_plugin.attention.options import KernelOptions
  fields = {}
  for item in filter(None, spec.split(",")):
    key, eq, value = item.partition("=")
    if not eq or not key:
      raise ValueError(f"{item!r} is not FIELD=VALUE")
    low = value.lower()
    fields[key] = (True if low == "true" else False if low == "false"
                   else int(value) if value.lstrip("-").isdigit() else value)
  return KernelOptions(**fields)


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

  from cp_layouts import one_document, random_documents
  from kvax_plugin.attention import token_order as orders
  from kvax_plugin.attention.api import create_attention_mask, flash_attention, resolve_backend
  from kvax_plugin.attention.context_parallel import context_parallel_balance
  from kvax_plugin.attention.params import DEFAULT_BWD_PARAMS, DEFAULT_FWD_PARAMS

  devices = jax.devices()
  cp = args.cp or len(devices)
  if cp < 2 or cp > len(devices):
    raise SystemExit(f"--cp {cp}: needs 2 <= cp <= the {len(devices)} visible devices {devices}")
  backend = resolve_backend(args.backend)
  dtype = jnp.dtype(args.dtype)
  tol = args.tol if args.tol is not None else (1e-5 if dtype == jnp.float32 else 2e-2)
  b, s, h, kh, d = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
  scale = d ** -0.5
  # The balanced order moves whole query blocks of the tables the op builds (default blocks).
  unit = max(DEFAULT_FWD_PARAMS.query_block_size, DEFAULT_BWD_PARAMS.query_block_size)
  if "balanced" in args.orders and s % (cp * unit):
    raise SystemExit(f"--seq_len {s} must be a multiple of cp * {unit} = {cp * unit} for the "
                     "balanced order")

  # ---- inputs (natural order, host), generated once
  layouts = {}
  if "one_doc" in args.layouts:
    layouts["one_doc"] = one_document(s, batch=b)
  if "packed" in args.layouts:
    layouts["packed"] = random_documents(s, args.num_docs, args.num_pad, batch=b, seed=args.seed)
  rng = np.random.default_rng(args.seed)
  host = {
      "q": rng.standard_normal((b, s, h, d), np.float32),
      "k": rng.standard_normal((b, s, kh, d), np.float32),
      "v": rng.standard_normal((b, s, kh, d), np.float32),
      "w": rng.standard_normal((b, s, h, d), np.float32),  # output cotangent
  }
  host = {n: x.astype(dtype) for n, x in host.items()}

  mesh = Mesh(np.array(devices[:cp]), ("context",))
  specs = ((None, "context", None, None), (None, None, None, None))
  dev0 = devices[0]

  def put_one(x):
    return jax.device_put(x, dev0)

  def put_cp(x):  # batch replicated, sequence over "context", the rest whole
    return jax.device_put(x, NamedSharding(mesh, P(None, "context", *([None] * (x.ndim - 2)))))

  def make_fns(order, options=None, overlap=False):
    """Jitted (mask, fwd, fwd+bwd) on one device (order None) or the cp mesh in `order`, the
    kernels run with `options` (a KernelOptions; None: the defaults); `overlap`: the mask (and
    so the op) takes the overlapped kv exchange."""
    kw = {} if order is None else dict(mesh=mesh, query_specs=specs[0], kv_specs=specs[1],
                                       token_order=order)
    mask_kw = {} if order is None else dict(overlap_kv_gather=overlap,
                                            kv_grad_reduce_dtype=args.kv_grad_reduce_dtype)

    @jax.jit
    def build_mask(pos, seg):
      return create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, **kw, **mask_kw)

    def attend(q, k, v, pos, seg, mask):
      return flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=scale, backend=backend,
                             kernel_options=options, **kw)

    @jax.jit
    def fwd_bwd(q, k, v, w, pos, seg, mask):
      def loss(q, k, v):
        out = attend(q, k, v, pos, seg, mask)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
      (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
      return out, grads

    return build_mask, jax.jit(attend), fwd_bwd

  def communication_alone() -> dict:
    """ms of the op's collectives alone on this mesh and these shapes: the all-gather of k and v
    (forward) and the reduce-scatter of the dk / dv partials in the dtype the library sums them
    in (backward): the part of the cp step that a balanced order cannot remove."""
    from kvax_plugin.attention.context_parallel import kv_grad_reduce_dtype
    reduce_dtype = kv_grad_reduce_dtype(dtype, cp)
    tok_spec = P(None, "context", None, None)

    @jax.jit
    def gather(k, v):
      f = jax.shard_map(lambda k, v: tuple(jax.lax.all_gather(x, "context", axis=1, tiled=True)
                                       for x in (k, v)),
                    mesh=mesh, in_specs=(tok_spec, tok_spec), out_specs=(P(), P()),
                    check_vma=False)
      return f(k, v)

    @jax.jit
    def reduce(dk, dv):  # [cp, B, S, K, D]: every rank's partial for the whole sequence
      f = jax.shard_map(lambda a, b: tuple(
          jax.lax.psum_scatter(x[0].astype(reduce_dtype), "context", scatter_dimension=1,
                               tiled=True).astype(dtype)[None] for x in (a, b)),
          mesh=mesh, in_specs=(P("context"), P("context")),
          out_specs=(P(None, None, "context"), P(None, None, "context")), check_vma=False)
      return f(dk, dv)

    k, v = (jax.device_put(host[n], NamedSharding(mesh, tok_spec)) for n in ("k", "v"))
    gather_ms, _ = _median_ms(gather, (k, v), args.iters, args.warmup)
    part = NamedSharding(mesh, P("context"))
    dk = jax.device_put(np.broadcast_to(host["k"][None], (cp, *host["k"].shape)), part)
    dv = jax.device_put(np.broadcast_to(host["v"][None], (cp, *host["v"].shape)), part)
    reduce_ms, _ = _median_ms(reduce, (dk, dv), args.iters, args.warmup)
    return {"all_gather_kv_ms": gather_ms, "reduce_scatter_dkv_ms": reduce_ms,
            "reduce_dtype": str(jnp.dtype(reduce_dtype))}

  def arrangement_ms(pos, seg) -> float:
    """ms of the balanced order's per-shard kv arrangement alone, on one device: the gathers
    that put rank 0's all-gathered k and v in document order (forward) and dk / dv back
    (backward), as kv_exchange.arrange does, for this layout's real arrangement."""
    from kvax_plugin.attention.kv_exchange import arrange
    tok = orders.token_order(pos, seg, cp, order="balanced", block=unit)
    gathered_pos = np.take_along_axis(pos, np.asarray(tok.order), axis=1)
    gathered_seg = np.take_along_axis(seg, np.asarray(tok.order), axis=1)
    arrangement = jax.device_put(orders.document_order(jnp.asarray(gathered_pos),
                                                        jnp.asarray(gathered_seg)), dev0)
    k, v = (jax.device_put(jnp.asarray(host[n], dtype), dev0) for n in ("k", "v"))

    @jax.jit
    def there_and_back(k, v, arrangement):
      (a, b), vjp = jax.vjp(lambda k, v: (arrange(k, arrangement), arrange(v, arrangement)),
                            k, v)
      return vjp((a, b))
    return _median_ms(there_and_back, (k, v, arrangement), args.iters, args.warmup)[0]

  # Permutations run on device 0 (gathers of ~1 GB arrays are slow on the host).
  permute = jax.jit(lambda xs, tok: orders.apply_token_order(xs, tok))
  unpermute = jax.jit(lambda x, tok: orders.undo_token_order(x, tok))

  def run(fns, tok, put, pos, seg):
    arrs = tuple(put_one(x) for x in [host[n] for n in ("q", "k", "v", "w")] + [pos, seg])
    if tok is not None:
      arrs = permute(arrs, jax.device_put(tok, dev0))
    q, k, v, w, p, sg = (put(x) for x in arrs)
    del arrs
    build_mask, fwd, fwd_bwd = fns
    mask_ms, _ = _median_ms(build_mask, (p, sg), max(3, args.iters // 2), 1)
    mask = build_mask(p, sg)
    fwd_ms, fwd_all = _median_ms(fwd, (q, k, v, p, sg, mask), args.iters, args.warmup)
    fb_ms, fb_all = _median_ms(fwd_bwd, (q, k, v, w, p, sg, mask), args.iters, args.warmup)
    out, grads = fwd_bwd(q, k, v, w, p, sg, mask)
    timing = {"mask_ms": mask_ms, "fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms,
              "fwd_all_ms": fwd_all, "fwd_bwd_all_ms": fb_all}
    return timing, (out, *grads)

  @jax.jit
  def compare(a, ref):
    a32, r32 = a.astype(jnp.float32), ref.astype(jnp.float32)
    diff = a32 - r32
    return (jnp.max(jnp.abs(diff)), jnp.sqrt(jnp.sum(diff * diff)),
            jnp.sqrt(jnp.sum(r32 * r32)), jnp.max(jnp.abs(r32)))

  def order_ms(pos, seg):
    """Median time to compute the balanced order of the batch on device 0 (compiled)."""
    p, sg = put_one(pos), put_one(seg)
    fn = jax.jit(lambda p, sg: orders.balanced_order(p, sg, cp, block=unit))
    return _median_ms(fn, (p, sg), 5, 1)[0]

  def write(results) -> dict:
    result = {
        "benchmark": "context_parallel_orders", "cp": cp, "backend": backend,
        "smoke": args.smoke,
        "config": {k: getattr(args, k) for k in ("seq_len", "num_docs", "num_pad", "batch",
                                                 "heads", "kv_heads", "head_dim", "dtype",
                                                 "iters", "warmup", "seed", "orders", "layouts")},
        "order_unit": unit, "devices": [str(x) for x in devices[:cp]],
        "device_kind": devices[0].device_kind, "jax_version": jax.__version__,
        "kv_grad_reduce_dtype": args.kv_grad_reduce_dtype, "overlap": args.overlap,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "python": platform.python_version(), "tolerance_rel_l2": tol, "layouts": results,
        "communication_alone": results_comm,
        "complete": sorted(results) == sorted(layouts),
        "agree": all(r["agree"] for lay in results.values()
                     for r in lay["context_parallel"].values()),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    result["path"] = os.path.join(args.out_dir, f"context_parallel_cp{cp}_{s}.json")
    with open(result["path"], "w") as f:
      json.dump(result, f, indent=1)
    return result

  results_comm: dict = {}
  single_fns = make_fns(None)
  overlaps = {"off": (False,), "on": (True,), "both": (False, True)}[args.overlap]
  suffix = lambda overlap: "+overlap" if overlap else ""
  cp_fns = {(order, ov): make_fns(order, overlap=ov) for order in args.orders for ov in overlaps}
  variants = [(v, _kernel_options(v)) for v in args.variant_options]
  variant_fns = {(order, label, ov): make_fns(order, options, ov) for order in args.orders
                 for label, options in variants for ov in overlaps}
  fwd_flops_per_pair = 4.0 * h * d
  tflops = lambda flops, ms: flops / (ms * 1e-3) / 1e12
  results = {}
  for name, (pos, seg) in layouts.items():
    t0 = time.perf_counter()
    single_t, single_res = run(single_fns, None, put_one, pos, seg)
    layout = {"single_device": {"timing": single_t}, "context_parallel": {}}
    pairs = None
    runs = [(order + suffix(ov), order, cp_fns[(order, ov)], ov)
            for order in args.orders for ov in overlaps]
    runs += [(f"{order}{suffix(ov)}+{label}", order, variant_fns[(order, label, ov)], ov)
             for order in args.orders for label, _ in variants for ov in overlaps]
    for key, order, fns, ov in runs:
      tok = orders.token_order(pos, seg, cp, order=order, block=unit)
      cp_t, cp_res = run(fns, tok, put_cp, pos, seg)
      agreement = {}
      tok0 = jax.device_put(tok, dev0)
      for what, got, want in zip(("out", "dq", "dk", "dv"), cp_res, single_res):
        got = unpermute(jax.device_put(got, dev0), tok0)
        mx, dn, rn, rmax = (float(x) for x in compare(got, want))
        agreement[what] = {"max_abs_diff": mx, "rel_l2": dn / rn if rn > 0 else float(dn > 0),
                           "ref_max_abs": rmax}
      del cp_res
      bal = context_parallel_balance(pos, seg, cp, order=order)
      pairs = sum(bal["kept_pairs"])
      layout["context_parallel"][key] = {
          "timing": cp_t,
          "speedup": {"fwd": single_t["fwd_ms"] / cp_t["fwd_ms"],
                      "fwd_bwd": single_t["fwd_bwd_ms"] / cp_t["fwd_bwd_ms"]},
          "balance": {k: bal[k] for k in ("kept_pairs", "visited_blocks", "kept_max_over_min",
                                           "visited_max_over_min")},
          "agreement": agreement,
          "agree": all(a["rel_l2"] <= tol for a in agreement.values()),
      }
    del single_res
    # Effective TFLOP/s from the exact kept pairs (forward 4*H*D per pair, backward 2.5x that).
    fwd_flops = fwd_flops_per_pair * pairs
    for r in [layout["single_device"], *layout["context_parallel"].values()]:
      r["effective_tflops_total"] = {"fwd": tflops(fwd_flops, r["timing"]["fwd_ms"]),
                                     "fwd_bwd": tflops(3.5 * fwd_flops, r["timing"]["fwd_bwd_ms"])}
    layout["kept_pairs"] = pairs
    if "balanced" in args.orders:
      layout["balanced_order_ms"] = order_ms(pos, seg)
      layout["arrangement_alone_ms"] = arrangement_ms(pos, seg)
    layout["wall_s"] = time.perf_counter() - t0
    results[name] = layout
    write(results)  # after every layout: a run cut short keeps what it measured
  comm = communication_alone()
  results_comm.update(comm)
  for lay in results.values():
    # Where the time between the measured cp step and a perfect split goes: the collectives
    # and (balanced order) the kv arrangement, each timed alone, against the gap.
    single = lay["single_device"]["timing"]["fwd_bwd_ms"]
    fixed = comm["all_gather_kv_ms"] + comm["reduce_scatter_dkv_ms"]
    for key, r in lay["context_parallel"].items():
      ideal = single / cp
      gap = r["timing"]["fwd_bwd_ms"] - ideal
      parts = fixed + (lay.get("arrangement_alone_ms", 0.0) if key.startswith("balanced") else 0.0)
      r["gap_to_ideal"] = {"ideal_ms": ideal, "gap_ms": gap, "fixed_costs_alone_ms": parts,
                           "fixed_share_of_gap": parts / gap if gap > 0 else float("nan")}
  result = write(results)

  print(f"context parallelism cp={cp} vs 1 device, backend={backend}, {devices[0].device_kind}, "
        f"S={s}, H={h} K={kh} D={d} {args.dtype}")
  print(f"  {'':<32}{'mask ms':>9}{'fwd ms':>10}{'fwd+bwd ms':>12}{'speed-up fwd':>14}"
        f"{'fwd+bwd':>9}{'kept max/min':>14}{'blocks max/min':>16}{'rel L2 (max)':>14}")
  for name, lay in results.items():
    t = lay["single_device"]["timing"]
    extra = (f"   (balanced order: {lay['balanced_order_ms']:.2f} ms; kv arrangement there "
             f"and back alone: {lay['arrangement_alone_ms']:.2f} ms)"
             if "balanced_order_ms" in lay else "")
    print(f"  {name + ' 1 device':<32}{t['mask_ms']:>9.2f}{t['fwd_ms']:>10.2f}"
          f"{t['fwd_bwd_ms']:>12.2f}{extra}")
    for order, r in lay["context_parallel"].items():
      t = r["timing"]
      worst = max(a["rel_l2"] for a in r["agreement"].values())
      print(f"  {f'{name} cp={cp} {order}':<32}{t['mask_ms']:>9.2f}{t['fwd_ms']:>10.2f}"
            f"{t['fwd_bwd_ms']:>12.2f}{r['speedup']['fwd']:>13.2f}x"
            f"{r['speedup']['fwd_bwd']:>8.2f}x{r['balance']['kept_max_over_min']:>14.2f}"
            f"{r['balance']['visited_max_over_min']:>16.2f}{worst:>14.3g}")
  print(f"  communication alone: k / v all-gather {comm['all_gather_kv_ms']:.2f} ms, dk / dv "
        f"reduce-scatter ({comm['reduce_dtype']}) {comm['reduce_scatter_dkv_ms']:.2f} ms")
  for name, lay in results.items():
    for order, r in lay["context_parallel"].items():
      g = r["gap_to_ideal"]
      print(f"  {name} {order}: {g['gap_ms']:.2f} ms over a perfect split "
            f"({g['ideal_ms']:.2f}); collectives{' + arrangement' if order.startswith('balanced') else ''}"
            f" alone {g['fixed_costs_alone_ms']:.2f} ms")
  from plot_context_parallel import plot
  png = result["path"][:-len(".json")] + ".png"
  plot([result], png)
  print(f"  agree (rel L2 <= {tol:g} for out, dq, dk, dv): {result['agree']}; wrote "
        f"{result['path']} and {png}")
  return result


if __name__ == "__main__":
  main()
