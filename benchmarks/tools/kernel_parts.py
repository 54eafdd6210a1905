"""Each of our kernels timed alone (bench_attention.py --split): where a backend's time goes.

    python benchmarks/bench_attention.py --seq 65536 --impls mosaic,triton --split

The Mosaic parts: the forward, the deterministic backward's dk/dv and dq kernels, and the fused
dk/dv kernel that also reduce-adds dq; the Triton parts: forward, delta, dq, dk/dv. These call
the backends' private functions, so this file changes with the kernels. With interpret=True
the Mosaic parts run through Pallas' interpreter (CPU tests; the times are then meaningless).
"""

from __future__ import annotations

import dataclasses as dc

import jax
import jax.numpy as jnp

from benchmarks.timing import time_fn
from kvax_plugin.attention.kernels.mosaic import backend as mb
from kvax_plugin.attention.kernels.mosaic import backward as bk
from kvax_plugin.attention.kernels.triton import backend as tb


def _ms(rounds):
  # one round lasts about 20 ms, as bench_attention's rows
  return lambda f, a: time_fn(f, a, rounds, max(1, int(20.0 / max(time_fn(f, a, 1, 1), 1e-3))))


def time_parts_triton(mask, pos, seg, q, k, v, cot, scale, rounds,
                      memory_optimized_gqa_backward=False):
  """ms of each Triton kernel alone: forward, delta, dq, dk/dv (with the GQA group sum)."""
  cfg = tb.static_config(mask, scale=scale, logits_soft_cap=None, has_sinks=False,
                         memory_optimized_gqa_backward=memory_optimized_gqa_backward)
  ints = (jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(seg))
  sinks = jnp.zeros((q.shape[2],), jnp.float32)
  fwd = jax.jit(lambda q, k, v: tb._forward(cfg, q, k, v, sinks, *ints, mask))
  out, lse = fwd(q, k, v)
  delta_fn = jax.jit(tb._bwd_delta)
  delta = delta_fn(out, cot)
  dq = jax.jit(lambda q, k, v, lse, delta, do: tb._bwd_dq(cfg, q, k, v, *ints, mask, lse, delta,
                                                          do))
  dkv = jax.jit(lambda q, k, v, lse, delta, do: tb._bwd_dkv(cfg, q, k, v, *ints, mask, lse,
                                                            delta, do))
  ms = _ms(rounds)
  return dict(fwd=ms(fwd, (q, k, v)), delta=ms(delta_fn, (out, cot)),
              dq=ms(dq, (q, k, v, lse, delta, cot)), dkv=ms(dkv, (q, k, v, lse, delta, cot)))


def time_parts_mosaic(mask, pos, seg, q, k, v, cot, scale, rounds, interpret=False):
  """ms of each Mosaic GPU kernel alone (causal / documents as the mask says): forward, the dk/dv
  kernel of the deterministic backward, its dq kernel, and the fused dk/dv kernel that also
  reduce-adds dq."""
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
  # the deepest ring that fits shared memory, as the backend chooses it
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
  ms = _ms(rounds)
  return dict(fwd=ms(fwd, (q, k, v)), dkv=ms(dkv, args), dq=ms(dq, args),
              fused_dkv_dq=ms(fused, args))
