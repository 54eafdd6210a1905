"""The dk/dv (and fused dq) backward in small CTAs: one warpgroup of 64 kv rows per CTA, so two
CTAs share an SM.

Why: the big-CTA kernels of backward.py (128 kv rows, two consumer warpgroups and a producer,
~200 KiB of shared memory, one CTA per SM) run their products at 640-700 TF/s but do 7 of them
per tile pair (dk/dv kernel + dq kernel); their 5-product variant (dq reduce-added from the
dk/dv kernel) measured slower, because each step's softmax, dS staging, barriers and dq
reduce-add leave the tensor cores idle and nothing else on the SM fills the gap. cuDNN's
backward on Hopper runs 64 x 64 tiles in 4-warp CTAs (its kernel name), several per SM: while one
CTA is in its element-wise phase or waits on memory, another CTA's products run. This kernel
is that shape.

One CTA = 64 kv rows of one kv head, 128 threads, no producer warpgroup (the warpgroup issues its
own TMA loads one step ahead). For every query head of the GQA group and every query block of the
CTA's `dkv` table row, a step of 64 query rows:

    S^T = K Q^T                       (K, Q from shared memory)
    P^T = exp(S^T - lse)              (masked pairs 0)
    dV += P^T dO,  dP^T = V dO^T      (P^T and V from registers; issued together)
    dS^T = P^T o (dP^T - delta)
    dK += dS^T Q                      (dS^T from registers)
    with_dq: dQ_part = dS K, in 64-column chunks (dS^T staged in shared memory, read
             transposed), each chunk bulk-reduce-added (TMA, add) into a float32 dq buffer:
             5 products per tile pair; the summation order over kv tiles is not fixed (not
             bitwise reproducible), as in backward.py's fused mode.

Shared memory per CTA (head dim 128, bf16): K 16 KiB, a 2-slot Q + lse ring 32.5 KiB, one dO +
delta slot 16.25 KiB (the next step's dO loads as soon as the step's dV / dP^T products are done,
while dS, dK and dQ run), dS^T 8 KiB, and V 16 KiB, which is read into registers once and then
becomes the dq staging (two 64 x 64 float32 chunk buffers, 32 KiB, a RefUnion): 105.75 KiB, so
two CTAs fit the SM's 228 KiB (1 KiB of it reserved per CTA). Registers per thread: dK and dV
accumulators 64 + 64, V 32, P^T (16-bit) 16, dP^T 32, a dq chunk 32: two CTAs of 128 threads may
each use 255.

Numerics as backward.py: base-2 logits, lse natural-log [B, H, Sq] (+inf for rows with nothing,
whose probabilities are then 0), delta = rowsum(dO * O); with a soft cap the derivative of the
cap enters dS. P^T is kept only in 16 bits (dS^T = P^T(16 bit) * (dP^T - delta), as the dV product
already uses it), which keeps the peak register count at dK + dV + V + P^T + dP^T = 208.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kvax_plugin.attention.kernels.mosaic.forward import (LOG2E, _COL, _ROW, _smem, accumulate,
                                                          pair_keep, products_together,
                                                          visit_order)

TILE = 64  # kv rows per CTA and query rows per step
DQ_CHUNK = 64  # dq columns per reduce-add (one 128-byte swizzle tile of K in 16 bits)
# Two CTAs per SM: an H100 / H200 SM has 228 KiB of shared memory, 1 KiB of it reserved per CTA.
TWO_PER_SM_BYTES = 113 * 1024


def smem_bytes(dk: int, dv: int, itemsize: int, with_dq: bool) -> int:
  """Shared memory of one CTA (see the module docstring), + 1 KiB for barriers and alignment."""
  k = TILE * dk * itemsize
  q_ring = 2 * TILE * (dk * itemsize + 4)  # Q + lse, two slots
  d_o = TILE * (dv * itemsize + 4)  # dO + delta, one slot
  v = TILE * dv * itemsize
  if not with_dq:
    return k + q_ring + d_o + v + 1024
  ds = TILE * TILE * itemsize
  stage = 2 * TILE * DQ_CHUNK * 4  # two float32 dq chunk buffers, in V's memory
  return k + q_ring + d_o + ds + max(v, stage) + 1024


def fits(dk: int, dv: int, itemsize: int, with_dq: bool) -> bool:
  """Whether two CTAs of this kernel fit an SM (head dims 64 and 128; not MLA's 192 or 256)."""
  return (dk % DQ_CHUNK == 0 and dv % 64 == 0
          and smem_bytes(dk, dv, itemsize, with_dq) <= TWO_PER_SM_BYTES)


def _logit_terms(cfg, st):
  """(base-2 logits, d logit / d (q.k)) of raw products st; the derivative is None when it is
  the constant scale."""
  if cfg.soft_cap:
    t = jnp.tanh(st * (cfg.scale / cfg.soft_cap))
    return t * (cfg.soft_cap * LOG2E), (1.0 - t * t) * cfg.scale
  return st * (cfg.scale * LOG2E), None


def dkv_call(cfg, q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg, lower, upper,
             full_lower, full_upper):
  """(dq float32 [B, Sq, H, Dk] or None, dk [B, Skv, K, Dk], dv [B, Skv, K, Dv]).

  cfg: backward.BwdConfig (table blocks, scale, soft cap, causal, window, with_dq, interpret,
  exit_after_read are read). Inputs padded as for the forward: Sq a multiple of the table's query
  block, Skv of its kv block; lse +inf on padding query rows. The `dkv` table's rows are kv blocks
  of cfg.table_kv rows (a multiple of 64), its bounds query blocks of cfg.table_q.
  """
  b, sq, h, dk = q.shape
  skv, kh, dv = k.shape[1], k.shape[2], v.shape[3]
  group = h // kh
  rq = cfg.table_q // TILE  # steps per table query block
  rk = cfg.table_kv // TILE  # CTAs per table kv block
  n_tiles = skv // TILE
  chunks = dk // DQ_CHUNK
  dtype = q.dtype
  with_dq = cfg.with_dq
  # The interpreter has no bulk reduce: there every CTA adds into a dq buffer of its own (CTAs
  # of other kv tiles add into the same rows and may run concurrently), summed afterwards.
  dq_copies = n_tiles if cfg.interpret else 1

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, kvpos_ref,
             kvseg_ref, lo_ref, up_ref, flo_ref, fup_ref, dq_ref, dk_ref, dv_ref,
             k_smem, v_smem, stage, q_smem, lse_smem, do_smem, delta_smem, ds_smem,
             k_ready, v_ready, q_ready, do_ready):
    kv_head = lax.axis_index("heads")
    bi = lax.axis_index("batch")
    tile = lax.axis_index("kv_tiles")
    row = tile // rk
    lower = lo_ref[bi, row] * rq
    upper = up_ref[bi, row] * rq
    full_lower = flo_ref[bi, row] * rq
    full_upper = fup_ref[bi, row] * rq
    count = upper - lower
    masked_count, block = visit_order(lower, full_lower, full_upper, upper)
    total = group * count  # steps: every query head of the group x every visited query block
    rows = pl.ds(tile * TILE, TILE)

    def coords(n):
      """(query block, query head) of step n."""
      safe = lax.max(count, 1)
      return block(lax.rem(n, safe)), kv_head * group + lax.div(n, safe)

    def load_q(n):  # Q and lse of step n into ring slot n % 2
      qi, head = coords(n)
      slot = lax.rem(n, 2)
      qrows = pl.ds(qi * TILE, TILE)
      plgpu.copy_gmem_to_smem(q_ref.at[bi, qrows, head], q_smem.at[slot], q_ready.at[slot])
      plgpu.copy_gmem_to_smem(lse_ref.at[bi, head, qrows], lse_smem.at[slot], q_ready.at[slot])

    def load_do(n):  # dO and delta of step n into the single slot
      qi, head = coords(n)
      qrows = pl.ds(qi * TILE, TILE)
      plgpu.copy_gmem_to_smem(do_ref.at[bi, qrows, head], do_smem, do_ready)
      plgpu.copy_gmem_to_smem(delta_ref.at[bi, head, qrows], delta_smem, do_ready)

    plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kv_head], k_smem, k_ready)
    plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kv_head], v_smem, v_ready)

    @pl.when(total > 0)
    def _():
      load_q(0)
      load_do(0)
    kv_pos = plgpu.load(kvpos_ref.at[bi, rows], layout=_ROW, optimized=False)
    kv_seg = plgpu.load(kvseg_ref.at[bi, rows], layout=_ROW, optimized=False)
    plgpu.barrier_wait(k_ready)
    plgpu.barrier_wait(v_ready)
    # V is the A operand of dP^T = V dO^T: held in registers for the whole CTA.
    v_regs = (v_smem[...] if cfg.interpret
              else plgpu.load(v_smem, (), layout=plgpu.Layout.WGMMA, optimized=True))
    if with_dq and not cfg.dq_atomic:
      # V's memory becomes the dq staging (a RefUnion): every thread has read V first (the
      # fence + warpgroup barrier of commit_smem).
      plgpu.commit_smem()
    dk_acc = plgpu.layout_cast(jnp.zeros((TILE, dk), jnp.float32), plgpu.Layout.WGMMA)
    dv_acc = plgpu.layout_cast(jnp.zeros((TILE, dv), jnp.float32), plgpu.Layout.WGMMA)

    def store_dq_chunk(n, c, head, qrows, part):
      """Bulk-reduce-add dQ_part[:, chunk c] of step n through a staging buffer (or, with
      cfg.dq_atomic, atomic adds straight from registers)."""
      cols = pl.ds(c * DQ_CHUNK, DQ_CHUNK)
      if cfg.dq_atomic:
        if cfg.interpret:  # a buffer of its own (see dq_copies): a plain add is exact
          target = dq_ref.at[tile, bi, qrows, head, cols]
          target[...] = target[...] + part
        else:
          plgpu.atomic_add(dq_ref.at[0, bi, qrows, head, cols], part)
        return
      buf = c % 2 if chunks % 2 == 0 else lax.rem(n * chunks + c, 2)
      my_stage = stage.at[buf]
      # The reduce that last used this buffer (two chunks ago) has read it; this also makes
      # every thread wait for it (the wait ends with a warpgroup barrier).
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      if cfg.interpret:
        target = dq_ref.at[tile, bi, qrows, head, cols]
        my_stage[...] = part + target[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_stage, target)
      else:
        my_stage[...] = part
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_stage, dq_ref.at[0, bi, qrows, head, cols],
                                reduction_op="add")

    def dk_and_dq_chunk0(dk_acc, ds16, q_tile):
      """(dk_acc + dS^T Q, dS K[:, :64]), issued together and awaited once."""
      zeros = plgpu.layout_cast(jnp.zeros((TILE, DQ_CHUNK), jnp.float32), plgpu.Layout.WGMMA)
      k0 = k_smem.at[:, pl.ds(0, DQ_CHUNK)]
      if cfg.interpret:
        return (accumulate(dk_acc, ds16, q_tile, True),
                accumulate(zeros, ds_smem.T, k0, True))

      def issue(refs):
        plgpu.wgmma(refs[0], ds16, q_tile)
        plgpu.wgmma(refs[1], ds_smem.T, k0)
      return pl.run_state(issue)((plgpu.ACC.init(dk_acc), plgpu.ACC.init(zeros)))

    def step(n, qi, head, carry, masked: bool):
      dk_acc, dv_acc = carry
      slot = lax.rem(n, 2)
      qrows = pl.ds(qi * TILE, TILE)
      if masked:  # loaded before the first product, which hides their latency
        q_pos = plgpu.load(qpos_ref.at[bi, qrows], layout=_COL, optimized=False)
        q_seg = plgpu.load(qseg_ref.at[bi, qrows], layout=_COL, optimized=False)

      @pl.when(n + 1 < total)
      def _():
        # The other slot held step n - 1's Q / lse, read by its products (awaited) and by
        # every thread's lse load: the fence + barrier orders those reads before the TMA.
        plgpu.commit_smem()
        load_q(n + 1)
      plgpu.barrier_wait(q_ready.at[slot])
      st = accumulate(plgpu.layout_cast(jnp.zeros((TILE, TILE), jnp.float32),
                                        plgpu.Layout.WGMMA),
                      k_smem, q_smem.at[slot].T, cfg.interpret)
      z2, dz = _logit_terms(cfg, st)
      lse = plgpu.load(lse_smem.at[slot], layout=_COL)
      pt = jnp.exp2(z2 - lax.broadcast_in_dim(lse * LOG2E, z2.shape, [1]))
      if masked:
        pt = jnp.where(pair_keep(cfg, q_pos, q_seg, kv_pos, kv_seg, pt.shape, q_dim=1), pt, 0.0)
      pt16 = pt.astype(dtype)
      plgpu.barrier_wait(do_ready)
      dv_acc, dpt = products_together((dv_acc, pt16, do_smem),
                                      (None, v_regs, do_smem.T, (TILE, TILE)), cfg.interpret)
      delta = plgpu.load(delta_smem, layout=_COL)

      @pl.when(n + 1 < total)
      def _():
        plgpu.commit_smem()  # every thread has read delta; the products have read dO
        load_do(n + 1)
      dst = pt16.astype(jnp.float32) * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
      dst = dst * (cfg.scale if dz is None else dz)
      if masked:
        # Masked pairs give exactly 0 even where dP holds NaN from a non-finite v (0 * NaN).
        keep = pair_keep(cfg, q_pos, q_seg, kv_pos, kv_seg, dst.shape, q_dim=1)
        dst = jnp.where(keep, dst, 0.0)
      ds16 = dst.astype(dtype)
      if not with_dq:
        return accumulate(dk_acc, ds16, q_smem.at[slot], cfg.interpret), dv_acc
      ds_smem[...] = ds16
      plgpu.commit_smem()
      dk_acc, part = dk_and_dq_chunk0(dk_acc, ds16, q_smem.at[slot])
      store_dq_chunk(n, 0, head, qrows, part)
      for c in range(1, chunks):
        part = accumulate(
            plgpu.layout_cast(jnp.zeros((TILE, DQ_CHUNK), jnp.float32), plgpu.Layout.WGMMA),
            ds_smem.T, k_smem.at[:, pl.ds(c * DQ_CHUNK, DQ_CHUNK)], cfg.interpret)
        store_dq_chunk(n, c, head, qrows, part)
      return dk_acc, dv_acc

    def one_head(g, carry):
      head = kv_head * group + g
      base = g * count  # step number of this head's first query block
      carry = lax.fori_loop(0, masked_count,
                            lambda m, c: step(base + m, block(m), head, c, True), carry)
      return lax.fori_loop(
          masked_count, count,
          lambda m, c: step(base + m, full_lower + (m - masked_count), head, c, False), carry)

    dk_acc, dv_acc = lax.fori_loop(0, group, one_head, (dk_acc, dv_acc))
    if with_dq:
      plgpu.wait_smem_to_gmem(0)
    # K (last read by the final dQ product, awaited) stages dK; the dO slot (no load pending
    # after the last step) stages dV.
    k_smem[...] = dk_acc.astype(dtype)
    do_smem[...] = dv_acc.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[bi, rows, kv_head])
    plgpu.copy_smem_to_gmem(do_smem, dv_ref.at[bi, rows, kv_head])
    plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.exit_after_read and not with_dq)

  v_spec = _smem((TILE, dv), dtype)
  # float32 dq chunks in the swizzled layout: the WGMMA-layout register store is free of bank
  # conflicts; TMA unswizzles on the way to global memory.
  stage_spec = _smem((2, TILE, DQ_CHUNK), jnp.float32)

  def entry(*refs):
    scratch = (
        _smem((TILE, dk), dtype),
        plgpu.RefUnion(v_spec, stage_spec) if with_dq and not cfg.dq_atomic else v_spec,
        _smem((2, TILE, dk), dtype),
        plgpu.SMEM((2, TILE), jnp.float32),
        _smem((TILE, dv), dtype),
        plgpu.SMEM((TILE,), jnp.float32),
        _smem((TILE, TILE), dtype) if with_dq else None,
    )
    barriers = (
        plgpu.Barrier(),  # k_ready
        plgpu.Barrier(),  # v_ready
        plgpu.Barrier(num_arrivals=2, num_barriers=2),  # q_ready: Q and lse per slot
        plgpu.Barrier(num_arrivals=2),  # do_ready: dO and delta
    )

    def scoped(k_smem, v_or_union, *rest):
      v_smem, stage = (v_or_union if with_dq and not cfg.dq_atomic
                       else (v_or_union, None))
      kernel(*refs, k_smem, v_smem, stage, *rest)
    pl.run_scoped(scoped, *scratch, *barriers)

  params = (dict(interpret=plgpu.InterpretGPUParams()) if cfg.interpret
            else dict(compiler_params=plgpu.CompilerParams(approx_math=True)))
  args = (q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg, lower, upper, full_lower,
          full_upper)
  out_types = (jax.ShapeDtypeStruct((b, skv, kh, dk), dtype),
               jax.ShapeDtypeStruct((b, skv, kh, dv), dtype))
  launch = dict(out_type=out_types, grid=(kh, n_tiles, b),
                grid_names=("heads", "kv_tiles", "batch"), **params)
  if with_dq:
    dq_buf = jax.new_ref(jnp.zeros((dq_copies, b, sq, h, dk), jnp.float32))
    dk_out, dv_out = plgpu.kernel(entry, **launch)(*args, dq_buf)
    dq = jnp.sum(dq_buf[...], axis=0) if dq_copies > 1 else dq_buf[...][0]
    return dq, dk_out, dv_out

  def entry_no_dq(*refs):
    n_in = len(args)
    entry(*refs[:n_in], None, *refs[n_in:])
  dk_out, dv_out = plgpu.kernel(entry_no_dq, **launch)(*args)
  return None, dk_out, dv_out
