"""Backward kernels for Hopper in Pallas Mosaic GPU, over the `dkv` and `dq` block tables
(design: docs/kernels.md).

dk/dv kernel: one CTA per 128 kv rows of one kv head; a producer warpgroup TMA-loads Q, lse, dO
and delta per query head of the GQA group and query block of the `dkv` row; two consumers (64 kv
rows each) accumulate dV and dK over the group in registers (deterministic). With `with_dq` it
also bulk reduce-adds dQ into a float32 buffer (not bitwise reproducible); otherwise the dq
kernel walks the `dq` table like the forward. lse: natural-log [B, H, Sq], +inf for empty rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kvax_plugin.attention.block_mask import longest_first_over_heads
from kvax_plugin.attention.options import producer_registers
from kvax_plugin.attention.kernels.mosaic.forward import (CONSUMERS, LOG2E, ROWS_PER_WG, _COL,
                                                          _ROW, _smem, accumulate, pair_keep,
                                                          produce_kv_ring, products_together,
                                                          released_for_tma, visit_order)

TILE_Q = 64  # query rows per step of the dk/dv kernel
TILE_KV = ROWS_PER_WG * CONSUMERS  # kv rows per dk/dv CTA
DQ_TILE_Q = ROWS_PER_WG * CONSUMERS  # query rows per dq CTA


def _logit_terms(cfg, st):
  """(base-2 logits, d logit / d (q.k)) of raw products st; the derivative is None when it is
  the constant scale."""
  if cfg.soft_cap:
    t = jnp.tanh(st * (cfg.scale / cfg.soft_cap))
    return t * (cfg.soft_cap * LOG2E), (1.0 - t * t) * cfg.scale
  return st * (cfg.scale * LOG2E), None


@dataclasses.dataclass(frozen=True)
class BwdConfig:
  table_q: int
  table_kv: int
  scale: float
  soft_cap: float  # 0: none
  causal: bool
  window: int  # 0: none
  with_dq: bool
  interpret: bool
  # Issue independent products together; the two-pair dk/dv step needs it.
  paired: bool = True
  # setmaxnreg of the consumers; the producer gets 504 - 2 x consumer_regs.
  consumer_regs: int = 232
  dq_after_dkv: bool = False
  # TMA-load each ring block's ids with it; masked steps read them from shared memory.
  ids_tma: bool = False

  # Fixed choices (the two-pair dk/dv step, lse / delta in the accumulators, the longest-first
  # launch over (head, tile) pairs) are described in docs/kernels.md, "mosaic".

  def __post_init__(self):
    producer_registers(self.consumer_regs, "consumer_regs")

  @property
  def producer_regs(self) -> int:
    return producer_registers(self.consumer_regs, "consumer_regs")


def splits_dq(cfg: "BwdConfig", dk: int) -> bool:
  # The column halves must be whole 64-element swizzle tiles of K in shared memory.
  return cfg.with_dq and dk % (64 * CONSUMERS) == 0


def dkv_smem_bytes(stages: int, dk: int, dv: int, itemsize: int, with_dq: bool,
                   split: bool = False, ids: bool = False) -> int:
  kv = CONSUMERS * ROWS_PER_WG * (dk + dv) * itemsize
  ring = stages * TILE_Q * ((dk + dv) * itemsize + 8 + (8 if ids else 0))  # + lse, delta; ids
  if split:
    dq = CONSUMERS * (2 * ROWS_PER_WG * TILE_Q * itemsize + TILE_Q * (dk // CONSUMERS) * 4)
  elif with_dq:
    dq = CONSUMERS * (ROWS_PER_WG * TILE_Q * itemsize + TILE_Q * dk * 4)
  else:
    dq = 0
  return kv + ring + dq + 1024


def dq_smem_bytes(block_kv: int, stages: int, dk: int, dv: int, itemsize: int,
                  ids: bool = False) -> int:
  qdo = CONSUMERS * ROWS_PER_WG * (dk + dv) * itemsize
  ring = stages * block_kv * ((dk + dv) * itemsize + (8 if ids else 0))
  return qdo + ring + 1024


def _interpret_params(cfg):
  if cfg.interpret:
    return dict(interpret=plgpu.InterpretGPUParams())
  return dict(compiler_params=plgpu.CompilerParams(approx_math=True))


def dkv_call(cfg: BwdConfig, stages: int, q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos,
             kv_seg, lower, upper, full_lower, full_upper):
  """(dk [B, Skv, K, Dk], dv [B, Skv, K, Dv]) in k.dtype, and dq [B, Sq, H, Dk] float32 when
  cfg.with_dq (else None). Inputs padded as for the forward."""
  b, sq, h, dk = q.shape
  skv, kh, dv = k.shape[1], k.shape[2], v.shape[3]
  group = h // kh
  tq = TILE_Q
  rq = cfg.table_q // tq
  rk = cfg.table_kv // TILE_KV
  dtype = q.dtype
  split = splits_dq(cfg, dk)
  dq_cols = dk // CONSUMERS if split else dk
  # The interpreter has no bulk reduce: each consumer of each kv tile adds into its own buffer,
  # summed after the kernel.
  n_tiles = skv // TILE_KV
  dq_copies = CONSUMERS * n_tiles if cfg.interpret else 1
  early_dp = not cfg.with_dq and cfg.paired
  # lse / delta start the products' accumulators (lse only without a soft cap).
  fold_delta = early_dp
  fold_lse = fold_delta and not cfg.soft_cap and cfg.scale != 0.0

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, kvpos_ref,
             kvseg_ref, lo_ref, up_ref, flo_ref, fup_ref, dq_ref, dk_ref, dv_ref,
             k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
             qpos_smem, qseg_smem,
             k_ready, v_ready, q_ready, do_ready, q_free, do_free, ds_ready, k_done,
             order_ref):
    kv_head = lax.axis_index("heads")
    bi = lax.axis_index("batch")
    tile = lax.axis_index("kv_tiles")
    code = order_ref[bi, kv_head * n_tiles + tile]
    kv_head, tile = lax.rem(code, kh), lax.div(code, kh)
    wg = lax.axis_index("wg")
    row = tile // rk
    lower = lo_ref[bi, row] * rq
    upper = up_ref[bi, row] * rq
    full_lower = flo_ref[bi, row] * rq
    full_upper = fup_ref[bi, row] * rq
    count = upper - lower
    masked_count, block = visit_order(lower, full_lower, full_upper, upper)

    @pl.when(wg < CONSUMERS)
    def consumer():
      if not cfg.interpret:
        plgpu.set_max_registers(cfg.consumer_regs, action="increase")
      rows = pl.ds(tile * TILE_KV + wg * ROWS_PER_WG, ROWS_PER_WG)
      my_k, my_v = k_smem.at[wg], v_smem.at[wg]
      plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kv_head], my_k, k_ready.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kv_head], my_v, v_ready.at[wg])
      kv_pos = plgpu.load(kvpos_ref.at[bi, rows], layout=_ROW, optimized=False)
      kv_seg = plgpu.load(kvseg_ref.at[bi, rows], layout=_ROW, optimized=False)
      dk_acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, dk), jnp.float32), plgpu.Layout.WGMMA)
      dv_acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, dv), jnp.float32), plgpu.Layout.WGMMA)
      plgpu.barrier_wait(k_ready.at[wg])
      plgpu.barrier_wait(v_ready.at[wg])
      total = group * count

      def step(n, qi, head, carry, masked: bool):
        dk_acc, dv_acc = carry
        slot = lax.rem(n, stages)
        if masked and not cfg.ids_tma:
          cols = pl.ds(qi * tq, tq)
          q_pos = plgpu.load(qpos_ref.at[bi, cols], layout=_COL, optimized=False)
          q_seg = plgpu.load(qseg_ref.at[bi, cols], layout=_COL, optimized=False)
        plgpu.barrier_wait(q_ready.at[slot])
        if masked and cfg.ids_tma:
          q_pos = plgpu.load(qpos_smem.at[slot], layout=_COL)
          q_seg = plgpu.load(qseg_smem.at[slot], layout=_COL)

        if early_dp:
          plgpu.barrier_wait(do_ready.at[slot])
          shape = (ROWS_PER_WG, tq)
          st0 = dpt0 = None
          if fold_lse:
            # S^T - lse / scale is the base-2 exponent of P^T: no lse vector live beside the tiles.
            lse = plgpu.load(lse_smem.at[slot], layout=_COL)
            st0 = plgpu.layout_cast(
                lax.broadcast_in_dim(lse * (-1.0 / cfg.scale), shape, [1]), plgpu.Layout.WGMMA)
          if fold_delta:
            delta = plgpu.load(delta_smem.at[slot], layout=_COL)
            dpt0 = plgpu.layout_cast(lax.broadcast_in_dim(-delta, shape, [1]),
                                     plgpu.Layout.WGMMA)
          st, dpt = products_together((st0, my_k, q_smem.at[slot].T, shape),
                                      (dpt0, my_v, do_smem.at[slot].T, shape), cfg.interpret)
        else:
          def scores(ref):
            plgpu.wgmma(ref, my_k, q_smem.at[slot].T)
            return ref[...]
          st = pl.run_scoped(scores, plgpu.ACC((ROWS_PER_WG, tq), jnp.float32))
        z2, dz = _logit_terms(cfg, st)
        if fold_lse:
          pt = jnp.exp2(z2)
        else:
          lse = plgpu.load(lse_smem.at[slot], layout=_COL)
          pt = jnp.exp2(z2 - lax.broadcast_in_dim(lse * LOG2E, z2.shape, [1]))
        if masked:
          keep = pair_keep(cfg, q_pos, q_seg, kv_pos, kv_seg, pt.shape, q_dim=1)
          pt = jnp.where(keep, pt, 0.0)
        pt16 = pt.astype(dtype)
        if not early_dp:
          plgpu.barrier_wait(do_ready.at[slot])
          if cfg.paired:
            dv_acc, dpt = products_together(
                (dv_acc, pt16, do_smem.at[slot]),
                (None, my_v, do_smem.at[slot].T, (ROWS_PER_WG, tq)), cfg.interpret)
          else:
            dv_acc = accumulate(dv_acc, pt16, do_smem.at[slot], cfg.interpret)

            def dprobs(ref):
              plgpu.wgmma(ref, my_v, do_smem.at[slot].T)
              return ref[...]
            dpt = pl.run_scoped(dprobs, plgpu.ACC((ROWS_PER_WG, tq), jnp.float32))
        if fold_delta:
          dst = pt * dpt
        else:
          delta = plgpu.load(delta_smem.at[slot], layout=_COL)
          dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
        dst = dst * (cfg.scale if dz is None else dz)
        if masked:
          # Masked pairs give exactly 0 even where dP holds NaN from a non-finite v (0 * NaN).
          dst = jnp.where(keep, dst, 0.0)
        ds16 = dst.astype(dtype)
        if split:
          # dS^T is shared with the other consumer (double-buffered: rewritten two steps later, once
          # the other consumer has read it); this consumer computes its column half of dQ = dS K.
          buf = lax.rem(n, 2)
          ds_smem.at[buf, wg][...] = ds16
          plgpu.commit_smem()
          plgpu.barrier_arrive(ds_ready.at[buf])
          half = pl.ds(wg * dq_cols, dq_cols)
          dk_acc, dq = _dk_and_dq_half(dk_acc, ds16, q_smem.at[slot], ds_smem.at[buf],
                                       k_smem, half, ds_ready.at[buf], dq_cols, cfg.interpret)
        elif cfg.with_dq:
          my_ds = ds_smem.at[wg]
          my_ds[...] = ds16
          plgpu.commit_smem()
          if cfg.paired:
            dk_acc, dq = products_together((dk_acc, ds16, q_smem.at[slot]),
                                           (None, my_ds.T, my_k, (tq, dk)), cfg.interpret)
          else:
            dk_acc = accumulate(dk_acc, ds16, q_smem.at[slot], cfg.interpret)

            def dq_part(ref):
              plgpu.wgmma(ref, my_ds.T, my_k)
              return ref[...]
            dq = pl.run_scoped(dq_part, plgpu.ACC((tq, dk), jnp.float32))
        elif early_dp:
          dv_acc, dk_acc = products_together((dv_acc, pt16, do_smem.at[slot]),
                                             (dk_acc, ds16, q_smem.at[slot]), cfg.interpret)
        else:
          dk_acc = accumulate(dk_acc, ds16, q_smem.at[slot], cfg.interpret)
        plgpu.barrier_arrive(q_free.at[slot])
        plgpu.barrier_arrive(do_free.at[slot])
        if cfg.with_dq:
          qrows = pl.ds(qi * tq, tq)
          cols = pl.ds(wg * dq_cols, dq_cols) if split else slice(None)
          my_dq = dq_smem.at[wg]

          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if cfg.interpret:
            target = dq_ref.at[tile * CONSUMERS + wg, bi, qrows, head, cols]
            my_dq[...] = dq + target[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_dq, target)
          else:
            my_dq[...] = dq
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_dq, dq_ref.at[0, bi, qrows, head, cols],
                                    reduction_op="add")
        return dk_acc, dv_acc

      def one_head(g, carry):
        head = kv_head * group + g
        base = g * count
        carry = lax.fori_loop(0, masked_count,
                              lambda m, c: step(base + m, block(m), head, c, True), carry)
        return lax.fori_loop(
            masked_count, count,
            lambda m, c: step(base + m, full_lower + (m - masked_count), head, c, False), carry)

      dk_acc, dv_acc = lax.fori_loop(0, group, one_head, (dk_acc, dv_acc))
      if cfg.with_dq:
        plgpu.wait_smem_to_gmem(0)
      if split:
        # The other consumer's last dQ product reads this K: wait before K's buffer stages dK.
        plgpu.barrier_arrive(k_done)
        plgpu.barrier_wait(k_done)
      my_k[...] = dk_acc.astype(dtype)
      my_v[...] = dv_acc.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_k, dk_ref.at[bi, rows, kv_head])
      plgpu.copy_smem_to_gmem(my_v, dv_ref.at[bi, rows, kv_head])
      plgpu.wait_smem_to_gmem(0, wait_read_only=not cfg.with_dq)

    @pl.when(wg == CONSUMERS)
    def producer():
      if not cfg.interpret:
        plgpu.set_max_registers(cfg.producer_regs, action="decrease")
      total = group * count

      @pl.loop(0, total)
      def _(n):
        safe = lax.max(count, 1)
        head = kv_head * group + lax.div(n, safe)
        qi = block(lax.rem(n, safe))
        slot = lax.rem(n, stages)
        qrows = pl.ds(qi * tq, tq)

        @pl.when(n >= stages)
        def _():
          plgpu.barrier_wait(q_free.at[slot])
          released_for_tma(cfg.interpret)
        plgpu.copy_gmem_to_smem(q_ref.at[bi, qrows, head], q_smem.at[slot], q_ready.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[bi, head, qrows], lse_smem.at[slot],
                                q_ready.at[slot])
        if cfg.ids_tma:
          plgpu.copy_gmem_to_smem(qpos_ref.at[bi, qrows], qpos_smem.at[slot], q_ready.at[slot])
          plgpu.copy_gmem_to_smem(qseg_ref.at[bi, qrows], qseg_smem.at[slot], q_ready.at[slot])

        @pl.when(n >= stages)
        def _():
          plgpu.barrier_wait(do_free.at[slot])
          released_for_tma(cfg.interpret)
        plgpu.copy_gmem_to_smem(do_ref.at[bi, qrows, head], do_smem.at[slot], do_ready.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[bi, head, qrows], delta_smem.at[slot],
                                do_ready.at[slot])

      @pl.loop(lax.max(0, total - stages), total)
      def _(n):
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(q_free.at[slot])
        plgpu.barrier_wait(do_free.at[slot])

  def entry(*refs):
    scratch = (
        _smem((CONSUMERS, ROWS_PER_WG, dk), dtype),
        _smem((CONSUMERS, ROWS_PER_WG, dv), dtype),
        _smem((stages, tq, dk), dtype),
        _smem((stages, tq, dv), dtype),
        plgpu.SMEM((stages, tq), jnp.float32),
        plgpu.SMEM((stages, tq), jnp.float32),
        (_smem((2, CONSUMERS, ROWS_PER_WG, tq), dtype) if split else
         _smem((CONSUMERS, ROWS_PER_WG, tq), dtype) if cfg.with_dq else None),
        # float32 dq partials swizzled: the WGMMA-layout register store is then free of bank
        # conflicts; TMA unswizzles on the way to global memory.
        _smem((CONSUMERS, tq, dq_cols), jnp.float32) if cfg.with_dq else None,
        plgpu.SMEM((stages, tq), jnp.int32) if cfg.ids_tma else None,
        plgpu.SMEM((stages, tq), jnp.int32) if cfg.ids_tma else None,
    )
    barriers = (
        plgpu.Barrier(num_barriers=CONSUMERS),
        plgpu.Barrier(num_barriers=CONSUMERS),

        plgpu.Barrier(num_arrivals=4 if cfg.ids_tma else 2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=2) if split else None,
        plgpu.Barrier(num_arrivals=CONSUMERS) if split else None,
    )
    order_ref, refs = refs[len(args) - 1], refs[:len(args) - 1] + refs[len(args):]
    pl.run_scoped(lambda *s: kernel(*refs, *s, order_ref=order_ref), *scratch, *barriers,
                  collective_axes="wg")

  out_types = (jax.ShapeDtypeStruct((b, skv, kh, dk), dtype),
               jax.ShapeDtypeStruct((b, skv, kh, dv), dtype))
  args = (q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg, lower, upper, full_lower,
          full_upper)
  args += (longest_first_over_heads(lower, upper, rk, n_tiles, kh),)
  launch = dict(out_type=out_types, grid=(kh, skv // TILE_KV, b),
                grid_names=("heads", "kv_tiles", "batch"), num_threads=CONSUMERS + 1,
                thread_name="wg", **_interpret_params(cfg))
  if cfg.with_dq:
    dq_buf = jax.new_ref(jnp.zeros((dq_copies, b, sq, h, dk), jnp.float32))
    dk_out, dv_out = plgpu.kernel(entry, **launch)(*args, dq_buf)
    dq = jnp.sum(dq_buf[...], axis=0) if dq_copies > 1 else dq_buf[...][0]
    return dq, dk_out, dv_out

  def entry_no_dq(*refs):
    n_in = len(args)
    entry(*refs[:n_in], None, *refs[n_in:])
  dk_out, dv_out = plgpu.kernel(entry_no_dq, **launch)(*args)
  return None, dk_out, dv_out


def _dk_and_dq_half(dk_acc, ds16, q_tile, ds_shared, k_smem, half, ds_ready, dq_cols,
                    interpret: bool):
  """(dk_acc + ds16 @ q_tile, dQ[:, half] = sum_j ds_shared[j]^T @ k_smem[j][:, half]): ds16
  this consumer's dS^T, ds_shared both consumers' (complete once `ds_ready` fires). The dK product
  is issued before the wait; all three are awaited once."""
  zeros = plgpu.layout_cast(jnp.zeros((TILE_Q, dq_cols), jnp.float32), plgpu.Layout.WGMMA)
  if interpret:
    dk_acc = accumulate(dk_acc, ds16, q_tile, True)
    plgpu.barrier_wait(ds_ready)
    dq = zeros
    for j in range(CONSUMERS):
      dq = dq + jnp.dot(ds_shared.at[j][...].T, k_smem.at[j, :, half][...],
                        preferred_element_type=jnp.float32)
    return dk_acc, dq

  def issue(refs):
    plgpu.wgmma(refs[0], ds16, q_tile)
    plgpu.barrier_wait(ds_ready)
    for j in range(CONSUMERS):
      plgpu.wgmma(refs[1], ds_shared.at[j].T, k_smem.at[j, :, half])
  return pl.run_state(issue)((plgpu.ACC.init(dk_acc), plgpu.ACC.init(zeros)))


def dq_call(cfg: BwdConfig, block_kv: int, stages: int, q, k, v, d_out, lse, delta, q_pos,
            q_seg, kv_pos, kv_seg, lower, upper, full_lower, full_upper):
  """dq [B, Sq, H, Dk] in q.dtype, deterministic: one CTA per 128 query rows of one head."""
  b, sq, h, dk = q.shape
  kh, dv = k.shape[2], v.shape[3]
  group = h // kh
  bk = block_kv
  rq = cfg.table_q // DQ_TILE_Q
  rk = cfg.table_kv // bk
  n_tiles = sq // DQ_TILE_Q
  dtype = q.dtype

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, kvpos_ref,
             kvseg_ref, lo_ref, up_ref, flo_ref, fup_ref, dq_ref,
             q_smem, do_smem, k_smem, v_smem, kvpos_smem, kvseg_smem,
             q_ready, k_ready, v_ready, k_free, v_free, order_ref):
    head = lax.axis_index("heads")
    bi = lax.axis_index("batch")
    code = order_ref[bi, head * n_tiles + lax.axis_index("q_tiles")]
    head, tile = lax.rem(code, h), lax.div(code, h)
    wg = lax.axis_index("wg")
    row = tile // rq
    lower = lo_ref[bi, row] * rk
    upper = up_ref[bi, row] * rk
    full_lower = flo_ref[bi, row] * rk
    full_upper = fup_ref[bi, row] * rk
    count = upper - lower
    masked_count, block = visit_order(lower, full_lower, full_upper, upper)

    @pl.when(wg < CONSUMERS)
    def consumer():
      if not cfg.interpret:
        plgpu.set_max_registers(cfg.consumer_regs, action="increase")
      rows = pl.ds(tile * DQ_TILE_Q + wg * ROWS_PER_WG, ROWS_PER_WG)
      my_q, my_do = q_smem.at[wg], do_smem.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, head], my_q, q_ready.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, head], my_do, q_ready.at[wg])
      q_pos = plgpu.load(qpos_ref.at[bi, rows], layout=_ROW, optimized=False)
      q_seg = plgpu.load(qseg_ref.at[bi, rows], layout=_ROW, optimized=False)
      lse = plgpu.load(lse_ref.at[bi, head, rows], layout=_ROW, optimized=False) * LOG2E
      delta = plgpu.load(delta_ref.at[bi, head, rows], layout=_ROW, optimized=False)
      acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, dk), jnp.float32), plgpu.Layout.WGMMA)
      plgpu.barrier_wait(q_ready.at[wg])

      def step(n, ki, acc, masked: bool):
        slot = lax.rem(n, stages)
        if masked and not cfg.ids_tma:
          cols = pl.ds(ki * bk, bk)
          kv_pos = plgpu.load(kvpos_ref.at[bi, cols], layout=_COL, optimized=False)
          kv_seg = plgpu.load(kvseg_ref.at[bi, cols], layout=_COL, optimized=False)
        plgpu.barrier_wait(k_ready.at[slot])
        if masked and cfg.ids_tma:
          kv_pos = plgpu.load(kvpos_smem.at[slot], layout=_COL)
          kv_seg = plgpu.load(kvseg_smem.at[slot], layout=_COL)
        if cfg.paired:
          plgpu.barrier_wait(v_ready.at[slot])
          s, dp = products_together((None, my_q, k_smem.at[slot].T, (ROWS_PER_WG, bk)),
                                    (None, my_do, v_smem.at[slot].T, (ROWS_PER_WG, bk)),
                                    cfg.interpret)
          plgpu.barrier_arrive(v_free.at[slot])
        else:
          def scores(ref):
            plgpu.wgmma(ref, my_q, k_smem.at[slot].T)
            return ref[...]
          s = pl.run_scoped(scores, plgpu.ACC((ROWS_PER_WG, bk), jnp.float32))
        z2, dz = _logit_terms(cfg, s)
        p = jnp.exp2(z2 - lax.broadcast_in_dim(lse, z2.shape, [0]))
        if masked:
          keep = pair_keep(cfg, q_pos, q_seg, kv_pos, kv_seg, p.shape)
          p = jnp.where(keep, p, 0.0)
        if not cfg.paired:
          plgpu.barrier_wait(v_ready.at[slot])

          def dprobs(ref):
            plgpu.wgmma(ref, my_do, v_smem.at[slot].T)
            return ref[...]
          dp = pl.run_scoped(dprobs, plgpu.ACC((ROWS_PER_WG, bk), jnp.float32))
          plgpu.barrier_arrive(v_free.at[slot])
        ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
        ds = ds * (cfg.scale if dz is None else dz)
        if masked:
          # Padding and masked pairs give exactly 0 (dP may hold NaN from a non-finite v).
          ds = jnp.where(keep, ds, 0.0)
        acc = accumulate(acc, ds.astype(dtype), k_smem.at[slot], cfg.interpret)
        plgpu.barrier_arrive(k_free.at[slot])
        return acc

      acc = lax.fori_loop(0, masked_count, lambda n, a: step(n, block(n), a, True), acc)
      acc = lax.fori_loop(masked_count, count,
                          lambda n, a: step(n, full_lower + (n - masked_count), a, False), acc)
      # Rows with nothing to attend (lse +inf) get exactly 0, even through 0 * NaN.
      acc = jnp.where(lax.broadcast_in_dim(lse == jnp.inf, acc.shape, [0]), 0.0, acc)
      my_q[...] = acc.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_q, dq_ref.at[bi, rows, head])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == CONSUMERS)
    def producer():
      if not cfg.interpret:
        plgpu.set_max_registers(cfg.producer_regs, action="decrease")
      ids = ((kvpos_ref.at[bi], kvseg_ref.at[bi], kvpos_smem, kvseg_smem) if cfg.ids_tma
             else None)
      produce_kv_ring(k_ref.at[bi, :, head // group], v_ref.at[bi, :, head // group], k_smem,
                      v_smem, k_ready, v_ready, k_free, v_free, count, block, bk, stages,
                      interpret=cfg.interpret, ids=ids)

  def entry(*refs):
    scratch = (
        _smem((CONSUMERS, ROWS_PER_WG, dk), dtype),
        _smem((CONSUMERS, ROWS_PER_WG, dv), dtype),
        _smem((stages, bk, dk), dtype),
        _smem((stages, bk, dv), dtype),
        plgpu.SMEM((stages, bk), jnp.int32) if cfg.ids_tma else None,
        plgpu.SMEM((stages, bk), jnp.int32) if cfg.ids_tma else None,
    )
    barriers = (
        plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMERS),

        plgpu.Barrier(num_arrivals=3 if cfg.ids_tma else 1, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
    )
    order_ref, refs = refs[n_in - 1], refs[:n_in - 1] + refs[n_in:]
    pl.run_scoped(lambda *s: kernel(*refs, *s, order_ref=order_ref), *scratch, *barriers,
                  collective_axes="wg")

  inputs = (q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg, lower, upper, full_lower,
            full_upper)
  inputs += (longest_first_over_heads(lower, upper, rq, n_tiles, h),)
  n_in = len(inputs)
  return plgpu.kernel(
      entry, out_type=jax.ShapeDtypeStruct((b, sq, h, dk), dtype),
      grid=(h, sq // DQ_TILE_Q, b), grid_names=("heads", "q_tiles", "batch"),
      num_threads=CONSUMERS + 1, thread_name="wg", **_interpret_params(cfg),
  )(*inputs)


SMEM_BUDGET = 227 * 1024


def backward_call(cfg: BwdConfig, q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg,
                  dkv_table, dq_table):
  """(dq, dk, dv) for padded inputs: dq from the dk/dv kernel's reduce-adds (float32) when
  cfg.with_dq and it fits shared memory, else from the deterministic dq kernel (q.dtype)."""
  dk_dim, dv_dim = q.shape[3], v.shape[3]
  itemsize = jnp.dtype(q.dtype).itemsize
  split = splits_dq(cfg, dk_dim)
  ids = cfg.ids_tma
  with_dq = cfg.with_dq and dkv_smem_bytes(2, dk_dim, dv_dim, itemsize, True,
                                           split, ids=ids) <= SMEM_BUDGET
  cfg = dataclasses.replace(cfg, with_dq=with_dq)
  split = splits_dq(cfg, dk_dim)
  stages = next((s for s in (3, 2, 1)
                 if dkv_smem_bytes(s, dk_dim, dv_dim, itemsize, with_dq, split,
                                   ids=ids) <= SMEM_BUDGET),
                None)
  if stages is None:
    raise ValueError(f"head dims ({dk_dim}, {dv_dim}) do not fit the Mosaic GPU dk/dv kernel's "
                     "shared memory")
  dq, dk, dv = dkv_call(cfg, stages, q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg,
                        *dkv_table)
  if dq is None:
    return _deterministic_dq(cfg, q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg,
                             dk, dv, dq_table)
  return dq, dk, dv


def _deterministic_dq(cfg, q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg, dk, dv,
                      dq_table):
  dk_dim, dv_dim = q.shape[3], v.shape[3]
  itemsize = jnp.dtype(q.dtype).itemsize
  ids = cfg.ids_tma
  if cfg.dq_after_dkv:
    # After the dk/dv kernel, so context parallelism's dk / dv reduce-scatter overlaps dq.
    q, dk, dv = jax.lax.optimization_barrier((q, dk, dv))
  # A 2-deep ring first (its loads overlap the products), then the largest kv tile.
  fits = [(bk, st) for st in (2, 1) for bk in (128, 64)
          if cfg.table_kv % bk == 0 and dq_smem_bytes(bk, st, dk_dim, dv_dim, itemsize,
                                                      ids=ids) <= SMEM_BUDGET]
  if not fits:
    raise ValueError(f"head dims ({dk_dim}, {dv_dim}) do not fit the Mosaic GPU dq kernel's "
                     "shared memory")
  bk, dq_stages = fits[0]
  if cfg.table_q % DQ_TILE_Q:
    # The dq kernel walks one table row per 128 query rows; finer (64) or unaligned (192) rows
    # are merged per tile.
    dq_table = tile_rows(dq_table, cfg.table_q, DQ_TILE_Q, q.shape[1] // DQ_TILE_Q)
    cfg = dataclasses.replace(cfg, table_q=DQ_TILE_Q)
  dq = dq_call(cfg, bk, dq_stages, q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg,
               *dq_table)
  return dq, dk, dv


def tile_rows(table, table_rows: int, tile_rows_: int, n_tiles: int):
  """The table [B, n_tiles] of tiles of `tile_rows_` outer rows, from one whose rows cover
  `table_rows` each: a tile visits the union of its rows' visits (extra visits are masked, so
  cost only time) and treats as full only the intersection of their full ranges."""
  lower, upper, full_lower, full_upper = (jnp.asarray(x) for x in table)
  n_rows = lower.shape[1]
  first = (np.arange(n_tiles) * tile_rows_) // table_rows
  last = ((np.arange(n_tiles) + 1) * tile_rows_ - 1) // table_rows
  span = int((last - first).max()) + 1
  idx = first[:, None] + np.arange(span)[None, :]
  valid = jnp.asarray((idx <= last[:, None]) & (idx < n_rows))
  idx = jnp.asarray(np.minimum(idx, n_rows - 1))
  take = lambda x: x[:, idx]
  lo, up, flo, fup = take(lower), take(upper), take(full_lower), take(full_upper)
  visits = valid & (up > lo)
  big = jnp.iinfo(jnp.int32).max
  u_lo = jnp.min(jnp.where(visits, lo, big), axis=-1)
  u_up = jnp.max(jnp.where(visits, up, 0), axis=-1)
  empty = ~jnp.any(visits, axis=-1)
  u_lo = jnp.where(empty, 0, u_lo)
  u_up = jnp.where(empty, 0, u_up)
  f_lo = jnp.max(jnp.where(valid, flo, 0), axis=-1)
  f_up = jnp.min(jnp.where(valid, fup, big), axis=-1)
  no_full = f_lo >= f_up
  f_lo = jnp.where(no_full, u_lo, f_lo)
  f_up = jnp.where(no_full, u_lo, f_up)
  return tuple(x.astype(jnp.int32) for x in (u_lo, u_up, f_lo, f_up))
