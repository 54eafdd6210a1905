"""Attention benchmark: ours (backend="mosaic" and "triton") against cuDNN and tokamax, in one run.

    python benchmarks/bench_attention.py                      # the issue's grid: 16k and 64k
    python benchmarks/bench_attention.py --seq 16384 --impls ours,cudnn --cases causal
    python benchmarks/bench_attention.py --seq 16384 --impls ours --split \
        --variant 'dq64|dq=64,64,4,2' --variant 'perhead|gqa=perhead'   # tuning runs

Cases: "causal" (one causal document) and "docs" (12 random-length causal documents followed by
1000 padding tokens), B=1, 32 query heads, 8 kv heads, bf16, head dim 128 by default. Each
implementation is timed forward and forward+backward (jax.grad of <out, cotangent> w.r.t.
q, k, v, which includes the forward it needs), as the median over many timed rounds of
back-to-back calls after warm-up. Effective TFLOP/s count only the (q, kv) pairs the mask keeps:
forward 4 * H * D * pairs, backward 2.5x that (so forward+backward 3.5x).

How the peers see documents: cuDNN through jax.nn.dot_product_attention with a dense [B, 1, S, S]
boolean mask (it has no segment ids; skipped where that mask would not fit the time budget);
tokamax through its per-row k_start mask (each row may see keys from its document's start, plus
causality); padding rows there attend to themselves (they cost nothing extra).
Our mask build time is timed on its own and reported separately (it is built once per step and
shared by all layers).

--split also times each of our kernels alone (forward, delta, dq, dk/dv); --variant adds runs of
ours with other launch tiles or tables (see --help); benchmarks/NOTES.md records what they showed.

Writes benchmarks/results/<name>.json (conditions: GPU, versions, command, date) and a PNG plot.
A peer that fails records its error instead of a number.
"""

from __future__ import annotations

import argparse
import dataclasses
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvax_plugin.attention.api import flash_attention  # noqa: E402
from kvax_plugin.attention.kernels.triton import backend as triton_backend  # noqa: E402
from kvax_plugin.attention.block_mask import create_attention_mask  # noqa: E402
from kvax_plugin.attention.params import (DEFAULT_BWD_PARAMS,  # noqa: E402
                                          DEFAULT_FWD_PARAMS)

PAD = -1


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


def layout(case: str, seq: int, seed: int):
  if case == "causal":
    return np.arange(seq, dtype=np.int32)[None], np.zeros((1, seq), np.int32), np.array([seq])
  if case == "docs":
    return documents_layout(seq, 12, 1000, seed)
  raise ValueError(case)


def kept_pairs(lengths) -> int:
  lengths = np.asarray(lengths, np.int64)
  return int(np.sum(lengths * (lengths + 1) // 2))


def time_fn(fn, args, rounds: int, inner: int) -> float:
  """Median ms per call over `rounds` rounds of `inner` back-to-back calls (after warm-up)."""
  out = fn(*args)
  jax.block_until_ready(out)
  out = fn(*args)
  jax.block_until_ready(out)
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
  dk = int(parts[0])
  return dk, int(parts[-1])


def interleave(timed, args, rounds: int, flops_fwd: float) -> None:
  """Times the compiled implementations of each pass round-robin (--interleave): per round one
  `inner`-call round of each, in an order rotated every round; rows get ms (median of these
  rounds), ms_sequential (their one-by-one median) and tflops from the new ms."""
  for p, entries in timed.items():
    if len(entries) < 2:
      continue
    times = {name: [] for name, *_ in entries}
    for r in range(rounds):
      for name, f, inner, _ in entries[r % len(entries):] + entries[:r % len(entries)]:
        times[name].append(round_ms(f, args, inner))
    flops = flops_fwd * (1.0 if p == "fwd" else 3.5)
    for name, _, _, row in entries:
      ms = statistics.median(times[name])
      row.update(ms_sequential=row["ms"], ms=ms, tflops=flops / ms / 1e9, interleaved=True,
                 ms_rounds=times[name])
      print(f"  {name:15s} {p:8s} {ms:9.3f} ms  {row['tflops']:7.1f} TF/s  (interleaved; "
            f"alone {row['ms_sequential']:.3f})", flush=True)


def make_impls(case, pos, seg, h, kh, d, scale, variants=()):
  """name -> forward function of (q, k, v) (or a string: why it is unavailable).

  variants: (label, tiles, flags) for extra runs of ours named "ours@label"; tiles in the
  KVAX_TRITON_TILES format, set while that variant is traced (see triton_backend); flags: "mo"
  (memory_optimized_gqa_backward), "bq=N" / "fq=N" (backward / forward tables at query block N
  instead of the default, so the kernels may use N-row tiles).
  """
  impls = {}
  jpos, jseg = jnp.asarray(pos), jnp.asarray(seg)

  # --- ours
  def make_ours(flags=()):
    kw = {}
    for f in flags:
      if f.startswith("bq="):
        kw["bwd_params"] = dataclasses.replace(DEFAULT_BWD_PARAMS, query_block_size=int(f[3:]))
      if f.startswith("fq="):
        kw["fwd_params"] = dataclasses.replace(DEFAULT_FWD_PARAMS, query_block_size=int(f[3:]))
    mask = create_attention_mask(jpos, jseg, jpos, jseg, calc_bwd_mask=True, **kw)
    mo = "mo" in flags

    def ours(q, k, v):
      return flash_attention(q, k, v, jpos, jseg, jpos, jseg, mask, scale=scale,
                             memory_optimized_gqa_backward=mo, backend="triton")
    ours.mask, ours.mo, ours.tiles = mask, mo, ""
    return ours
  impls["ours"] = make_ours()
  mask = impls["ours"].mask

  # --- ours, Mosaic GPU (Hopper): deterministic backward (the default), the fused-dq one
  # (reduce-adds), and the one-wait-per-product variant (KVAX_MOSAIC_UNPAIRED, read while
  # tracing)
  def make_mosaic(det=True, env=None):
    def mosaic(q, k, v):
      return flash_attention(q, k, v, jpos, jseg, jpos, jseg, mask, scale=scale,
                             backend="mosaic", deterministic_backward=det)
    mosaic.env = env or {}
    mosaic.mask = mask
    return mosaic
  impls["mosaic"] = make_mosaic()

  # --- ours, backend="hopper": the Mosaic forward with the CUDA C++ fused backward (its shared
  # object built by python -m kvax_plugin.attention.kernels.cuda_sm90.build)
  def hopper(q, k, v):
    return flash_attention(q, k, v, jpos, jseg, jpos, jseg, mask, scale=scale, backend="hopper")
  hopper.mask = mask
  impls["hopper"] = hopper

  def hopper_variant(variant):  # another fused-backward variant (kernels/hopper.py's hook)
    def fn(q, k, v):
      return hopper(q, k, v)
    fn.env, fn.mask = {"KVAX_HOPPER_BWD_VARIANT": variant}, mask
    return fn
  for variant in ("v2", "v6"):  # the default is v7 (fused_backward.DEFAULT_VARIANT)
    impls[f"hopper_{variant}"] = hopper_variant(variant)
  impls["mosaic_fused"] = make_mosaic(det=False)
  impls["mosaic_unpaired"] = make_mosaic(env={"KVAX_MOSAIC_UNPAIRED": "1"})
  # fused dq with whole 64 x D partials per consumer (before the column-split dq)
  impls["mosaic_fused_whole"] = make_mosaic(det=False, env={"KVAX_MOSAIC_DQ_WHOLE": "1"})
  # register split 240 / 24 for the backward's consumers / producer (ptxas spills at 232 / 40),
  # the dq kernel stepping 64 kv rows (half the S / dP registers), and their combinations
  regs240 = {"KVAX_MOSAIC_BWD_REGS": "240"}
  impls["mosaic_regs240"] = make_mosaic(env=regs240)
  impls["mosaic_dq64"] = make_mosaic(env={"KVAX_MOSAIC_DQ_KV_TILE": "64"})
  impls["mosaic_regs240_dq64"] = make_mosaic(env={**regs240, "KVAX_MOSAIC_DQ_KV_TILE": "64"})
  impls["mosaic_fused_regs240"] = make_mosaic(det=False, env=regs240)
  impls["mosaic_fused_unpaired"] = make_mosaic(det=False, env={"KVAX_MOSAIC_UNPAIRED": "1"})
  # unpaired frees P's 16-bit copy before dP is accumulated (16 registers at the fused kernel's
  # peak: dK 64 + dV 64 + P 32 + dP 32 float32 per thread)
  impls["mosaic_fused_unpaired_regs240"] = make_mosaic(
      det=False, env={**regs240, "KVAX_MOSAIC_UNPAIRED": "1"})
  # forward hooks: optimization barrier after the softmax; the next K awaited at the top of a
  # step (the default since session 7 awaits it behind the P V product)
  impls["mosaic_fwd_optbar"] = make_mosaic(env={"KVAX_MOSAIC_FWD_OPT_BARRIER": "1"})
  impls["mosaic_fwd_noprewait"] = make_mosaic(env={"KVAX_MOSAIC_FWD_PREWAIT": "0"})
  # masked steps read the kv positions / segment ids from a ring the producer fills with K
  impls["mosaic_fwd_ids_tma"] = make_mosaic(env={"KVAX_MOSAIC_FWD_IDS_TMA": "1"})
  # ... and the backward kernels' masked steps likewise (q ids in the dk/dv kernel's q ring,
  # kv ids in the dq kernel's K ring)
  impls["mosaic_ids_tma"] = make_mosaic(env={"KVAX_MOSAIC_FWD_IDS_TMA": "1",
                                             "KVAX_MOSAIC_BWD_IDS_TMA": "1"})
  # every kernel's CTAs in longest-first order of their table rows (forward.longest_first)
  impls["mosaic_lpt"] = make_mosaic(env={"KVAX_MOSAIC_LPT": "1"})
  # every kernel's CTA exits once its output stores have read shared memory (the default since
  # session 9; mosaic_exit_write: the old wait for the global writes)
  impls["mosaic_exit_read"] = make_mosaic(env={"KVAX_MOSAIC_EXIT_AFTER_READ": "1"})
  impls["mosaic_exit_write"] = make_mosaic(env={"KVAX_MOSAIC_EXIT_AFTER_READ": "0"})
  # the forward as a persistent kernel, one CTA per SM (FwdConfig.num_ctas)
  impls["mosaic_persistent"] = make_mosaic(env={"KVAX_MOSAIC_FWD_PERSISTENT": "1"})
  # ... and the per-tile grid (one CTA per (query tile, head)) it replaced as the default
  impls["mosaic_pertile"] = make_mosaic(env={"KVAX_MOSAIC_FWD_PERSISTENT": "0"})
  # the deterministic dk/dv step's products in two pairs (S^T with dP^T, dV with dK) are the
  # default since session 12 ("mosaic"); the order before it (1 + 2 + 1 products per step)
  impls["mosaic_no_early_dp"] = make_mosaic(env={"KVAX_MOSAIC_DKV_EARLY_DP": "0"})
  # the dk/dv kernel's S^T / dP^T accumulators started from -lse / scale and -delta: the default
  # since session 15 ("mosaic"); without it
  impls["mosaic_nofold"] = make_mosaic(env={"KVAX_MOSAIC_DKV_FOLD": "0"})
  # the backward kernels' launch order longest tile first over all (head, tile) pairs: the
  # default since session 15 ("mosaic"); the grid's head-major order instead
  impls["mosaic_head_major"] = make_mosaic(env={"KVAX_MOSAIC_HEAD_LPT": "0"})
  # the persistent forward's items dealt as a snake draft in longest-first order: the default
  # since session 16 ("mosaic"); the round robin before it
  impls["mosaic_fwd_round_robin"] = make_mosaic(env={"KVAX_MOSAIC_FWD_SNAKE": "0"})
  for label, tiles, flags in variants:
    impls[f"ours@{label}"] = make_ours(flags)
    impls[f"ours@{label}"].tiles = tiles

  # --- cuDNN through jax.nn
  if case == "causal":
    def cudnn(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                          implementation="cudnn")
    impls["cudnn"] = cudnn
  else:
    def cudnn(q, k, v):
      s = jseg[:, :, None]
      dense = (s == jseg[:, None, :]) & (s != PAD) & (jpos[:, None, :] <= jpos[:, :, None])
      return jax.nn.dot_product_attention(q, k, v, mask=dense[:, None], scale=scale,
                                          implementation="cudnn")
    impls["cudnn"] = cudnn

  # --- tokamax (Mosaic GPU and Pallas-Triton flash attention)
  try:
    from tokamax._src.ops.attention import api as tk_api
    from tokamax._src.ops.attention import base as tk_base
    if case == "causal":
      tk_mask = tk_base.Mask(is_causal=True)
    else:
      idx = np.arange(seg.shape[1])
      start = np.zeros(seg.shape[1], np.int32)
      for i in range(seg.shape[1]):  # start index of each row's document; padding: itself
        start[i] = i if seg[0, i] == PAD else (start[i - 1] if i and seg[0, i - 1] == seg[0, i]
                                                else i)
      del idx
      tk_mask = tk_base.Mask(k_start=jnp.asarray(start)[None, None, :], is_causal=True)
    for name, key in (("tokamax_mosaic", "mosaic_gpu"), ("tokamax_triton", "triton")):
      if key not in tk_api.IMPLEMENTATIONS:
        impls[name] = f"tokamax has no {key!r} implementation here"
        continue
      impl = tk_api.IMPLEMENTATIONS[key]
      impls[name] = (lambda impl: (lambda q, k, v: impl(q, k, v, mask=tk_mask,
                                                          logits_scale=scale)))(impl)
  except Exception as e:  # noqa: BLE001 - record why the peer is missing
    impls["tokamax_mosaic"] = impls["tokamax_triton"] = f"tokamax import failed: {e!r}"
  return impls, mask


def time_parts(fn, pos, seg, q, k, v, cot, scale, rounds):
  """ms of each kernel of ours alone: forward, delta, dq, dk/dv (+ the GQA group sum)."""
  saved = os.environ.get("KVAX_TRITON_TILES")
  os.environ["KVAX_TRITON_TILES"] = fn.tiles
  try:
    cfg = triton_backend.static_config(fn.mask, scale=scale, logits_soft_cap=None,
                                       has_sinks=False, memory_optimized_gqa_backward=fn.mo)
  finally:
    if saved is None:
      os.environ.pop("KVAX_TRITON_TILES", None)
    else:
      os.environ["KVAX_TRITON_TILES"] = saved
  ints = (jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(seg))
  sinks = jnp.zeros((q.shape[2],), jnp.float32)
  mask = fn.mask
  fwd = jax.jit(lambda q, k, v: triton_backend._forward(cfg, q, k, v, sinks, *ints, mask))
  out, lse = fwd(q, k, v)
  delta_fn = jax.jit(triton_backend._bwd_delta)
  delta = delta_fn(out, cot)
  dq = jax.jit(lambda q, k, v, lse, delta, do: triton_backend._bwd_dq(
      cfg, q, k, v, *ints, mask, lse, delta, do))
  dkv = jax.jit(lambda q, k, v, lse, delta, do: triton_backend._bwd_dkv(
      cfg, q, k, v, *ints, mask, lse, delta, do))
  ms = lambda f, args: time_fn(f, args, rounds, max(1, int(20.0 / max(time_fn(f, args, 1, 1),
                                                                       1e-3))))
  return dict(fwd=ms(fwd, (q, k, v)), delta=ms(delta_fn, (out, cot)),
              dq=ms(dq, (q, k, v, lse, delta, cot)), dkv=ms(dkv, (q, k, v, lse, delta, cot)))


def time_parts_mosaic(mask, pos, seg, q, k, v, cot, scale, rounds, interpret=False):
  """ms of each Mosaic GPU kernel alone (causal / documents as the mask says): forward, the dk/dv
  kernel of the deterministic backward, its dq kernel, and the fused dk/dv kernel that also
  reduce-adds dq."""
  import dataclasses as dc
  from kvax_plugin.attention.kernels.mosaic import backend as mb
  from kvax_plugin.attention.kernels.mosaic import backward as bk
  ints = (jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(seg))
  sinks = jnp.zeros((q.shape[2],), jnp.float32)
  st = mb.Static(scale=float(scale), soft_cap=0.0, has_sinks=False, causal=bool(mask.spec.causal),
                 window=0, deterministic=True, interpret=interpret)
  fwd = jax.jit(lambda q, k, v: mb._forward(st, q, k, v, sinks, *ints, mask))
  out, lse = fwd(q, k, v)
  p = mb._Padded(mask, q, k, v, *ints)
  delta = jnp.einsum("bshd,bshd->bhs", cot.astype(jnp.float32), out.astype(jnp.float32))
  d_out = cot.astype(q.dtype)
  spec = mask.spec
  cfg = bk.BwdConfig(table_q=spec.bwd_params.query_block_size,
                     table_kv=spec.bwd_params.kv_block_size, scale=float(scale), soft_cap=0.0,
                     causal=bool(spec.causal), window=0, with_dq=False, interpret=interpret)
  itemsize = jnp.dtype(q.dtype).itemsize
  dk_dim, dv_dim = q.shape[3], v.shape[3]
  stages = next(s for s in (3, 2, 1)
                if bk.dkv_smem_bytes(s, dk_dim, dv_dim, itemsize, False) <= bk.SMEM_BUDGET)
  args = (p.q, p.k, p.v, d_out, lse, delta, p.q_pos, p.q_seg, p.kv_pos, p.kv_seg)
  dkv = jax.jit(lambda *a: bk.dkv_call(cfg, stages, *a, *mask.dkv)[1:])
  bk_tile = 128 if spec.bwd_params.kv_block_size % 128 == 0 else 64
  dq = jax.jit(lambda *a: bk.dq_call(cfg, bk_tile, 2, *a, *mask.dq))
  fcfg = dc.replace(cfg, with_dq=True)
  split = bk.splits_dq(fcfg, dk_dim)
  fstages = next(s for s in (3, 2, 1)
                 if bk.dkv_smem_bytes(s, dk_dim, dv_dim, itemsize, True, split) <= bk.SMEM_BUDGET)
  fused = jax.jit(lambda *a: bk.dkv_call(fcfg, fstages, *a, *mask.dkv))
  ms = lambda f, a: time_fn(f, a, rounds, max(1, int(20.0 / max(time_fn(f, a, 1, 1), 1e-3))))
  parts = dict(fwd=ms(fwd, (q, k, v)), dkv=ms(dkv, args), dq=ms(dq, args),
               fused_dkv_dq=ms(fused, args))
  # Variants of single kernels: the fastest fused variant measured in session 7 (consumers at
  # 240 registers, products awaited one by one). The register split 240 / 24 and the dq
  # kernel's 64-row kv steps changed nothing for the deterministic kernels there (dkv 111.7 vs
  # 111.8 ms, dq 76.9 / 79.2 vs 76.6; results/mosaic/s7_bench_64k_split.*).
  # (Hooks measured slower and removed in sessions 12 and 13 - backward pre-waits, a 4-deep
  # ring, 128-query steps, P^T in 16 bits, K in registers, the software-pipelined dk/dv and dq
  # steps - are in benchmarks/NOTES.md.)
  f240 = dc.replace(fcfg, consumer_regs=240)
  variants = dict(
      fused_dkv_dq_unpaired_regs240=(lambda *a: bk.dkv_call(
          dc.replace(f240, paired=False), fstages, *a, *mask.dkv)))
  for name, fn in variants.items():
    try:
      parts[name] = ms(jax.jit(fn), args)
    except Exception as e:  # noqa: BLE001  (a variant that fails to compile is reported)
      parts[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
  return parts


def bench_mask_build(pos, seg, rounds):
  jpos, jseg = jnp.asarray(pos), jnp.asarray(seg)
  build = jax.jit(lambda p, s: create_attention_mask(p, s, p, s, calc_bwd_mask=True))
  return time_fn(build, (jpos, jseg), rounds, 5)


def versions():
  out = {"python": platform.python_version(), "jax": jax.__version__}
  for mod in ("jaxlib", "triton", "jax_triton", "tokamax"):
    try:
      m = __import__(mod)
      out[mod] = getattr(m, "__version__", "?")
    except Exception as e:  # noqa: BLE001
      out[mod] = f"unavailable ({type(e).__name__})"
  return out


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [r for r in results if r.get("tflops") is not None]
  groups = sorted({(r["seq"], r["case"], r["head_dim"], r["pass"]) for r in rows})
  impls = sorted({r["impl"] for r in rows}, key=lambda n: (not n.startswith("mosaic"),
                                                          n != "ours", n))
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
  ax.set_title(f"attention, B=1, 32 q heads, 8 kv heads, bf16 - {jax.devices()[0].device_kind}")
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
  ap.add_argument("--impls", default="mosaic,mosaic_fused,ours,cudnn,tokamax_mosaic,"
                                     "tokamax_triton")
  ap.add_argument("--passes", default="fwd,fwd_bwd")
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--min-round-ms", type=float, default=20.0)
  ap.add_argument("--max-dense-mask-seq", type=int, default=32768,
                  help="cuDNN documents need an S x S mask: skip it above this length")
  ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_attention"))
  ap.add_argument("--check", action="store_true", help="compare outputs with cuDNN (causal)")
  ap.add_argument("--variant", action="append", default=[],
                  help="extra run of ours: 'label|fwd=128,64,8,3;dq=64,64,4,3;dkv=...|mo' "
                       "(tiles in KVAX_TRITON_TILES format; a trailing |mo turns on "
                       "memory_optimized_gqa_backward, |bq=128 / |fq=256 build the backward / "
                       "forward tables at that query block; flags are comma-separated)")
  ap.add_argument("--interleave", action="store_true",
                  help="after timing each implementation alone, time them again round-robin "
                  "(one round of each per pass, --rounds times, order rotated every round) and "
                  "report those medians as ms (the one-by-one medians stay as ms_sequential): "
                  "a slow drift of the GPU's clocks then cannot favour whoever ran first")
  ap.add_argument("--split", action="store_true",
                  help="also time each kernel of ours (and its variants) alone: forward, "
                       "delta, dq, dk/dv; and of mosaic: forward, dk/dv, dq, fused dk/dv+dq")
  args = ap.parse_args()

  heads, kv_heads = 32, 8
  variants = []
  for spec in args.variant:
    parts = spec.split("|")
    flags = tuple(f for f in parts[2].split(",") if f) if len(parts) > 2 else ()
    unknown = [f for f in flags if f != "mo" and not f.startswith(("bq=", "fq="))]
    if unknown:
      ap.error(f"--variant {spec!r}: unknown flags {unknown} (expected mo, bq=N, fq=N)")
    variants.append((parts[0], parts[1] if len(parts) > 1 else "", flags))
  wanted = args.impls.split(",") + [f"ours@{v[0]}" for v in variants]
  passes = args.passes.split(",")
  results = []
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}; versions: {versions()}", flush=True)
  for d, dv in map(parse_head_dims, args.head_dims.split(",")):
    for seq in map(int, args.seq.split(",")):
      for case in args.cases.split(","):
        pos, seg, lengths = layout(case, seq, seed=seq)
        pairs = kept_pairs(lengths)
        flops_fwd = 2.0 * heads * (d + dv) * pairs  # Q K^T (2 d) and P V (2 dv) per pair
        scale = d ** -0.5
        keys = jax.random.split(jax.random.PRNGKey(seq + d), 4)
        q = jax.random.normal(keys[0], (1, seq, heads, d), jnp.bfloat16)
        k = jax.random.normal(keys[1], (1, seq, kv_heads, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (1, seq, kv_heads, dv), jnp.bfloat16)
        cot = jax.random.normal(keys[3], (1, seq, heads, dv), jnp.bfloat16)
        mask_ms = bench_mask_build(pos, seg, args.rounds)
        results.append(dict(impl="ours_mask_build", seq=seq, case=case, head_dim=d, head_dim_v=dv,
                            **{"pass": "mask"}, ms=mask_ms, tflops=None, pairs=pairs))
        print(f"S={seq} {case} D={d}: mask build {mask_ms:.3f} ms; kept pairs {pairs:.3e}",
              flush=True)
        impls, _ = make_impls(case, pos, seg, heads, kv_heads, d, scale, variants)
        outs = {}
        timed = {p: [] for p in passes}  # pass -> [(name, compiled fn, inner, row)]
        for name in wanted:
          fn = impls.get(name, f"unknown implementation {name}")
          for p in passes:
            row = dict(impl=name, seq=seq, case=case, head_dim=d, head_dim_v=dv, pairs=pairs, ms=None,
                       tflops=None, **{"pass": p})
            if isinstance(fn, str):
              row["error"] = fn
              results.append(row)
              print(f"  {name:15s} {p:8s} unavailable: {fn}", flush=True)
              continue
            if name == "cudnn" and case == "docs" and seq > args.max_dense_mask_seq:
              row["error"] = (f"skipped: dense {seq}x{seq} mask above --max-dense-mask-seq "
                              f"{args.max_dense_mask_seq}")
              results.append(row)
              print(f"  {name:15s} {p:8s} {row['error']}", flush=True)
              continue
            try:
              if p == "fwd":
                f = jax.jit(fn)
              else:
                f = jax.jit(jax.grad(
                    lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * cot),
                    argnums=(0, 1, 2)))
              tiles = getattr(fn, "tiles", None)
              env = dict(getattr(fn, "env", {}))
              if tiles:  # read while tracing: the first call below compiles this variant
                env["KVAX_TRITON_TILES"] = tiles
                row["tiles"] = tiles
              if getattr(fn, "env", None):
                row["env"] = fn.env
              saved = {key_: os.environ.get(key_) for key_ in env}
              os.environ.update(env)
              # Size the inner loop so one round lasts about --min-round-ms. The hooks in env
              # are read while tracing: the first call (the check's, or the timing's) compiles.
              try:
                if p == "fwd" and args.check:
                  outs[name] = f(q, k, v)
                t1 = time_fn(f, (q, k, v), 1, 1)
              finally:
                for key_, val in saved.items():
                  if val is None:
                    os.environ.pop(key_, None)
                  else:
                    os.environ[key_] = val
              inner = max(1, int(args.min_round_ms / max(t1, 1e-3)))
              ms = time_fn(f, (q, k, v), args.rounds, inner)
              flops = flops_fwd * (1.0 if p == "fwd" else 3.5)
              row.update(ms=ms, tflops=flops / ms / 1e9, inner=inner, rounds=args.rounds)
              timed[p].append((name, f, inner, row))
              print(f"  {name:15s} {p:8s} {ms:9.3f} ms  {row['tflops']:7.1f} TF/s", flush=True)
            except Exception as e:  # noqa: BLE001 - a peer's failure is a result, not a crash
              row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
              print(f"  {name:15s} {p:8s} FAILED {row['error'][:200]}", flush=True)
              traceback.print_exc(limit=2)
            results.append(row)
          if args.split and not isinstance(fn, str) and (name == "mosaic"
                                                         or name.startswith("ours")):
            try:
              if name == "mosaic":
                kparts = time_parts_mosaic(fn.mask, pos, seg, q, k, v, cot, scale, args.rounds)
              else:
                kparts = time_parts(fn, pos, seg, q, k, v, cot, scale, args.rounds)
              results.append(dict(impl=name, seq=seq, case=case, head_dim=d, head_dim_v=dv, pairs=pairs,
                                  **{"pass": "parts"}, parts_ms=kparts,
                                  tiles=getattr(fn, "tiles", None)))
              print(f"  {name:15s} parts    " + "  ".join(
                  f"{kk} {vv:.3f}" if isinstance(vv, float) else f"{kk} {vv}"
                  for kk, vv in kparts.items()) + " ms",
                    flush=True)
            except Exception as e:  # noqa: BLE001
              print(f"  {name:15s} parts    FAILED {type(e).__name__}: {str(e)[:200]}",
                    flush=True)
              traceback.print_exc(limit=2)
        if args.interleave:
          interleave(timed, (q, k, v), args.rounds, flops_fwd)
        if args.check and "ours" in outs:
          for other, o in outs.items():
            if other != "ours":
              a = outs["ours"].astype(jnp.float32)
              b = o.astype(jnp.float32)
              real = jnp.asarray(seg != PAD)[..., None, None]
              err = float(jnp.linalg.norm(jnp.where(real, a - b, 0)) /
                          jnp.linalg.norm(jnp.where(real, b, 0)))
              print(f"  check: ours vs {other} rel-L2 {err:.2e} (non-padding rows)", flush=True)
              results.append(dict(impl=f"check_vs_{other}", seq=seq, case=case, head_dim=d, head_dim_v=dv,
                                  **{"pass": "check"}, rel_l2=err, ms=None))
        del impls, outs
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              gpu=dev.device_kind, versions=versions(), command=" ".join(sys.argv),
              env={k: v for k, v in os.environ.items() if k.startswith("KVAX_")},
              layout="B=1, 32 q heads, 8 kv heads, bf16; docs = 12 random documents + 1000 pad",
              flops="fwd 2*H*(Dk+Dv)*kept_pairs (4*H*D when Dk = Dv); fwd_bwd 3.5x that")
  out.with_suffix(".json").write_text(json.dumps(dict(conditions=meta, results=results),
                                                 indent=1))
  plot(results, out.with_suffix(".png"))
  # Summary table: ms and ratio against the peers.
  print("\nseq   case   D    pass   mosaic ms  triton ms   cudnn ms  tk_mosaic ms  "
        "tk_triton ms  mosaic vs cudnn  vs best tokamax  vs triton")
  keys = sorted({(r["seq"], r["case"], r["head_dim"], r["pass"]) for r in results
                 if r["pass"] in ("fwd", "fwd_bwd")})
  for key in keys:
    get = lambda n: next((r.get("ms") for r in results if r["impl"] == n and
                          (r["seq"], r["case"], r["head_dim"], r["pass"]) == key), None)
    o, c, tm, tt = get("ours"), get("cudnn"), get("tokamax_mosaic"), get("tokamax_triton")
    m = get("mosaic")
    fmt = lambda x: f"{x:9.3f}" if x else "      n/a"
    ratio = lambda a, b: f"{b / a:6.2f}x" if a and b else "   n/a "
    best_tk = min([x for x in (tm, tt) if x], default=None)
    print(f"{key[0]:6d} {key[1]:6s} {key[2]:4d} {key[3]:8s} {fmt(m)} {fmt(o)} {fmt(c)} "
          f"{fmt(tm)}     {fmt(tt)}      {ratio(m, c)}          {ratio(m, best_tk)}"
          f"        {ratio(m, o)}")


if __name__ == "__main__":
  main()
