"""Attention kernel benchmark: our backends against cuDNN and tokamax, timed in one run.

    python -m benchmarks.run --preset full                 # the README's table (uses this file)
    python benchmarks/bench_attention.py --seq 16384 --impls hopper,mosaic,cudnn --cases causal
    python benchmarks/bench_attention.py --seq 65536 --impls mosaic --split   # each kernel alone
    python benchmarks/bench_attention.py --seq 131072 --cases causal --impls mosaic \
        --variant 'pertile=mosaic:mosaic_forward_grid=per_tile'            # a KernelOptions field

Cases: "causal" (one causal document) and "docs" (12 random-length causal documents followed by
1000 padding tokens), B=1, 32 query heads, 8 kv heads, bf16, head dim 128 by default. Each
implementation is timed forward and forward+backward (jax.grad of <out, cotangent> w.r.t.
q, k, v, which includes the forward it needs), as the median over timed rounds of back-to-back
calls after warm-up; --interleave then times every implementation again round-robin, so a drift
of the GPU's clocks cannot favour whoever ran first (the medians of those rounds are reported).
Effective TFLOP/s count only the (q, kv) pairs the mask keeps: forward 2 * H * (Dk + Dv) per
pair (4 * H * D), forward+backward 3.5x that.

Implementations: ours through the public op, one per backend name (auto, hopper, mosaic,
mosaic_fused = mosaic with deterministic_backward=False, triton, jax); cudnn
(jax.nn.dot_product_attention, implementation="cudnn"); tokamax_mosaic and tokamax_triton
(tokamax's Mosaic GPU and Pallas-Triton flash attention). How the peers see documents: cuDNN
takes a dense [B, 1, S, S] boolean mask (it has no segment ids; skipped above
--max-dense-mask-seq); tokamax a per-row k_start mask (each row sees keys from its document's
start, plus causality; padding rows attend to themselves, which costs nothing extra). The mask
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
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvax_plugin.attention.api import flash_attention  # noqa: E402
from kvax_plugin.attention.block_mask import create_attention_mask  # noqa: E402

PAD = -1
OURS = ("auto", "hopper", "mosaic", "mosaic_fused", "triton", "jax")
PEERS = ("cudnn", "tokamax_mosaic", "tokamax_triton")
IMPLS = OURS + PEERS
FLOPS_FWD_BWD = 3.5  # forward+backward / forward: the backward does 2.5x the forward's products


def documents_layout(seq: int, num_docs: int, pad: int, seed: int):
  """positions, segment ids int32 [1, seq]: num_docs random-length documents, then pad padding."""
  rng = np.random.default_rng(seed)
  body = seq - pad
  cuts = np.sort(rng.choice(np.arange(1, body), size=num_docs - 1, replace=False))
  lengths = np.diff(np.concatenate([[0], cuts, [body]]))
  seg = np.full(seq, PAD, np.int32)
  pos = np.zeros(seq, np.int32)
  start = 0
  for d, ln in enumerate(lengths):
    seg[start:start + ln] = d
    pos[start:start + ln] = np.arange(ln)
    start += ln
  return pos[None], seg[None], lengths


def layout(case: str, seq: int, seed: int, num_docs: int = 12, pad: int = 1000):
  """(positions, segment ids, document lengths) of a case; "docs" = num_docs documents + pad."""
  if case == "causal":
    return np.arange(seq, dtype=np.int32)[None], np.zeros((1, seq), np.int32), np.array([seq])
  if case == "docs":
    return documents_layout(seq, num_docs, pad, seed)
  raise ValueError(f"case must be causal or docs, got {case!r}")


def kept_pairs(lengths, window: int | None = None) -> int:
  """Causal (q, kv) pairs kept in documents of these lengths; with a sliding window w, each
  query keeps min(its position + 1, w) of them."""
  lengths = np.asarray(lengths, np.int64)
  if window is None:
    return int(np.sum(lengths * (lengths + 1) // 2))
  w = np.minimum(lengths, window)
  return int(np.sum(w * (w + 1) // 2 + (lengths - w) * window))


# Attention features beyond the mask's causal / documents (--window, --soft-cap, --sinks): only
# our backends run them (the peers' rows say so), so the rows compare our backends.
NO_FEATURES = dict(window=None, soft_cap=None, sinks=False)


def time_fn(fn, args, rounds: int, inner: int) -> float:
  """Median ms per call over `rounds` rounds of `inner` back-to-back calls (after warm-up)."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  return statistics.median([round_ms(fn, args, inner) for _ in range(rounds)])


def round_ms(fn, args, inner: int) -> float:
  """ms per call of one round: `inner` back-to-back calls, waited for at the end."""
  t0 = time.perf_counter()
  for _ in range(inner):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) * 1e3 / inner


def parse_head_dims(spec: str) -> tuple[int, int]:
  """'128' -> (128, 128); '192:128' -> (192, 128): query / key and value head dims."""
  parts = spec.split(":")
  if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
    raise ValueError(f"--head-dims entry {spec!r}: expected D or DK:DV, e.g. 128 or 192:128")
  return int(parts[0]), int(parts[-1])


def interleave(timed, args, rounds: int, flops_fwd: float) -> None:
  """Times the compiled implementations of each pass round-robin: per round one `inner`-call
  round of each, in an order rotated every round; rows get ms (median of these rounds),
  ms_sequential (their one-by-one median) and tflops from the new ms."""
  for p, entries in timed.items():
    if len(entries) < 2:
      continue
    times = {name: [] for name, *_ in entries}
    for r in range(rounds):
      for name, f, inner, _ in entries[r % len(entries):] + entries[:r % len(entries)]:
        times[name].append(round_ms(f, args, inner))
    flops = flops_fwd * (1.0 if p == "fwd" else FLOPS_FWD_BWD)
    for name, _, _, row in entries:
      ms = statistics.median(times[name])
      row.update(ms_sequential=row["ms"], ms=ms, tflops=flops / ms / 1e9, interleaved=True,
                 ms_rounds=times[name])
      print(f"  {name:15s} {p:8s} {ms:9.3f} ms  {row['tflops']:7.1f} TF/s  (interleaved; "
            f"alone {row['ms_sequential']:.3f})", flush=True)


def auto_choice(mask, dtype, dk: int, dv: int, features=NO_FEATURES) -> str | None:
  """What backend="auto" runs for these inputs here (None if it cannot say)."""
  needed = [name for name, on in (("sliding_window", features["window"]),
                                  ("logits_soft_cap", features["soft_cap"]),
                                  ("sinks", features["sinks"])) if on]
  try:
    from kvax_plugin.attention.kernels import resolve_backend_for
    return resolve_backend_for("auto", dtype, dk, dv, tuple(needed), mask)
  except Exception:  # noqa: BLE001 - only a label for the table
    return None


def parse_variant(spec: str) -> tuple[str, str, dict]:
  """'label=BACKEND:field=value,field=value' -> (label, backend, KernelOptions fields): a run of
  one of our backends with kvax_plugin.KernelOptions set (values: integers, true / false, or
  strings as written)."""
  label, sep, rest = spec.partition("=")
  backend, _, fields = rest.partition(":")
  if not sep or not label or backend not in OURS:
    raise ValueError(f"--variant {spec!r}: expected LABEL=BACKEND:FIELD=VALUE,... with BACKEND "
                     f"one of {OURS}")
  options = {}
  for item in filter(None, fields.split(",")):
    key, eq, value = item.partition("=")
    if not eq:
      raise ValueError(f"--variant {spec!r}: {item!r} is not FIELD=VALUE")
    low = value.lower()
    options[key] = (True if low == "true" else False if low == "false"
                    else int(value) if value.lstrip("-").isdigit() else value)
  return label, backend, options


def make_impls(case, pos, seg, scale, names=IMPLS, variants=(), features=NO_FEATURES,
               heads: int = 32):
  """name -> forward function of (q, k, v), or a string saying why it cannot run here; and the
  block mask ours use (built once, as a training step does). variants: parse_variant's
  (label, backend, KernelOptions fields), each an implementation named by its label.
  features: window / soft_cap / sinks (NO_FEATURES: none); with any, the peers do not run."""
  jpos, jseg = jnp.asarray(pos), jnp.asarray(seg)
  mask = create_attention_mask(jpos, jseg, jpos, jseg, calc_bwd_mask=True,
                               sliding_window=features["window"])
  impls = {}
  sinks = (jnp.linspace(-1.0, 1.0, heads, dtype=jnp.float32) if features["sinks"] else None)

  def ours(backend, **kw):
    def fn(q, k, v):
      return flash_attention(q, k, v, jpos, jseg, jpos, jseg, mask, scale=scale,
                             backend=backend, logits_soft_cap=features["soft_cap"],
                             sinks=sinks, **kw)
    fn.mask = mask
    return fn

  for name in names:
    if name == "mosaic_fused":  # dq reduce-added by the dk/dv kernel: 5 products, not bitwise
      impls[name] = ours("mosaic", deterministic_backward=False)
    elif name in OURS:
      impls[name] = ours(name)
  for label, backend, fields in variants:
    from kvax_plugin.attention.options import KernelOptions
    impls[label] = ours("mosaic" if backend == "mosaic_fused" else backend,
                        kernel_options=KernelOptions(**fields),
                        **({"deterministic_backward": False} if backend == "mosaic_fused" else {}))
    impls[label].kernel_options = fields
  on_gpu = jax.devices()[0].platform == "gpu"
  if features != NO_FEATURES:
    for name in ("cudnn", "tokamax_mosaic", "tokamax_triton"):
      if name in names:
        impls[name] = f"not run with {features} (our backends' comparison)"
    return impls, mask
  if "cudnn" in names:
    if not on_gpu:
      impls["cudnn"] = f"cuDNN needs a CUDA GPU (JAX platform: {jax.devices()[0].platform})"
    elif case == "causal":
      impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    else:
      def cudnn(q, k, v):
        s = jseg[:, :, None]
        dense = (s == jseg[:, None, :]) & (s != PAD) & (jpos[:, None, :] <= jpos[:, :, None])
        return jax.nn.dot_product_attention(q, k, v, mask=dense[:, None], scale=scale,
                                            implementation="cudnn")
      impls["cudnn"] = cudnn
  wanted_tk = [n for n in ("tokamax_mosaic", "tokamax_triton") if n in names]
  if wanted_tk and not on_gpu:
    for n in wanted_tk:
      impls[n] = f"tokamax's GPU kernels need a CUDA GPU (JAX platform: {jax.devices()[0].platform})"
  elif wanted_tk:
    try:
      from tokamax._src.ops.attention import api as tk_api
      from tokamax._src.ops.attention import base as tk_base
      if case == "causal":
        tk_mask = tk_base.Mask(is_causal=True)
      else:
        start = np.zeros(seg.shape[1], np.int32)
        for i in range(seg.shape[1]):  # start index of each row's document; padding: itself
          same = i and seg[0, i] != PAD and seg[0, i - 1] == seg[0, i]
          start[i] = start[i - 1] if same else i
        tk_mask = tk_base.Mask(k_start=jnp.asarray(start)[None, None, :], is_causal=True)
      for name in wanted_tk:
        key = "mosaic_gpu" if name == "tokamax_mosaic" else "triton"
        if key not in tk_api.IMPLEMENTATIONS:
          impls[name] = f"tokamax has no {key!r} implementation here"
          continue
        impl = tk_api.IMPLEMENTATIONS[key]
        impls[name] = (lambda impl: (lambda q, k, v: impl(q, k, v, mask=tk_mask,
                                                            logits_scale=scale)))(impl)
    except Exception as e:  # noqa: BLE001 - record why the peer is missing
      for name in wanted_tk:
        impls[name] = f"tokamax import failed: {e!r}"
  return impls, mask


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
            check=False, variants=(), features=NO_FEATURES):
  """Time every implementation on every (head dims, length, case, pass); the rows as dicts
  (impl, seq, case, head_dim, head_dim_v, pass, ms, tflops, pairs, ...; error where one failed).
  features: window / soft_cap / sinks for our backends (NO_FEATURES: none)."""
  results = []
  for d, dv in head_dims:
    for seq in seqs:
      for case in cases:
        pos, seg, lengths = layout(case, seq, seed=seq, num_docs=num_docs, pad=pad)
        pairs = kept_pairs(lengths, features["window"])
        flops_fwd = 2.0 * heads * (d + dv) * pairs  # Q K^T (2 d) and P V (2 dv) per pair
        scale = d ** -0.5
        keys = jax.random.split(jax.random.PRNGKey(seq + d), 4)
        q = jax.random.normal(keys[0], (1, seq, heads, d), dtype)
        k = jax.random.normal(keys[1], (1, seq, kv_heads, d), dtype)
        v = jax.random.normal(keys[2], (1, seq, kv_heads, dv), dtype)
        cot = jax.random.normal(keys[3], (1, seq, heads, dv), dtype)
        base = dict(seq=seq, case=case, head_dim=d, head_dim_v=dv, pairs=pairs,
                    dtype=jnp.dtype(dtype).name,
                    **({"features": features} if features != NO_FEATURES else {}))
        mask_ms = bench_mask_build(pos, seg, rounds)
        results.append(dict(impl="mask_build", **base, **{"pass": "mask"}, ms=mask_ms,
                            tflops=None))
        print(f"S={seq} {case} D={d}/{dv}: mask build {mask_ms:.3f} ms; kept pairs {pairs:.3e}",
              flush=True)
        fns, mask = make_impls(case, pos, seg, scale, impls, variants, features, heads)
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
                f = jax.jit(jax.grad(
                    lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * cot),
                    argnums=(0, 1, 2)))
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
            from benchmarks.tools import kernel_parts
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
              + (", implementations interleaved round-robin" if interleaved else "")),
      flops=("fwd 2*H*(Dk+Dv)*kept_pairs (4*H*D when Dk = Dv); fwd_bwd "
             f"{FLOPS_FWD_BWD}x that"))


def impl_order(rows) -> list[str]:
  """The implementations of timed rows: ours, the peers, then --variant labels as they came."""
  names = [r["impl"] for r in rows if r.get("pass") in ("fwd", "fwd_bwd")]
  return ([n for n in IMPLS if n in names]
          + [n for n in dict.fromkeys(names) if n not in IMPLS])


def plot(results, path, title=None):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [r for r in results if r.get("tflops") is not None]
  groups = sorted({(r["seq"], r["case"], r["head_dim"], r["pass"]) for r in rows})
  impls = impl_order(rows)
  fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups)), 5))
  width = 0.8 / max(1, len(impls))
  for i, name in enumerate(impls):
    vals = []
    for g in groups:
      match = [r for r in rows if (r["seq"], r["case"], r["head_dim"], r["pass"]) == g
               and r["impl"] == name]
      vals.append(match[0]["tflops"] if match else 0.0)
    ax.bar(np.arange(len(groups)) + i * width, vals, width, label=name)
  ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
  ax.set_xticklabels([f"{s // 1024}k {c}\nD{d} {p}" for s, c, d, p in groups], fontsize=7)
  ax.set_ylabel("effective TFLOP/s (kept pairs only)")
  ax.set_title(title or f"attention kernels - {jax.devices()[0].device_kind}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


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
                    check=args.check, variants=variants, features=features)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  meta = conditions(heads=heads, kv_heads=kv_heads, dtype=dtype, num_docs=12, pad=1000,
                    rounds=args.rounds, interleaved=args.interleave)
  if features != NO_FEATURES:
    meta["features"] = features
  out.with_suffix(".json").write_text(json.dumps(dict(conditions=meta, results=results),
                                                 indent=1))
  plot(results, out.with_suffix(".png"))
  from benchmarks import run
  print("\n" + run.kernel_table(results))


if __name__ == "__main__":
  main()
