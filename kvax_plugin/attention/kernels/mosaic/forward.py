"""Forward kernel for Hopper in Pallas Mosaic GPU: FlashAttention over the block table.

One CTA per query tile (2 x 64 rows, one head): a producer warpgroup TMA-loads K / V into a
ring, two consumer warpgroups run the online softmax (ping-pong or intra-warpgroup overlap).
Design: docs/kernels.md ("mosaic"). Runs on the CPU through the interpreter (`interpret=True`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kvax_plugin.attention.block_mask import longest_first
from kvax_plugin.attention.options import producer_registers

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
M_INIT = -1.0e30  # finite "minus infinity" for the running max: exp2(M_INIT - m) == 0
ROWS_PER_WG = 64
CONSUMERS = 2
TILE_Q = ROWS_PER_WG * CONSUMERS
# q_seg of padding query rows becomes this id, which no kv token carries (real ids >= 0).
NO_SEGMENT = -2

_ROW = plgpu.Layout.WGMMA.reduce(1)
_COL = plgpu.Layout.WGMMA.reduce(0)


@dataclasses.dataclass(frozen=True)
class FwdConfig:

  block_kv: int
  stages: int
  table_q: int
  table_kv: int
  scale: float
  soft_cap: float  # 0: none
  has_sinks: bool
  causal: bool
  window: int  # 0: none
  interpret: bool
  # 0: one CTA per (batch, query tile, head). N > 0: a persistent kernel of N CTAs, the next
  # item's loads behind the current one; items dealt longest first as a snake draft.
  num_ctas: int = 0
  # Items of at least this many kv blocks run the intra-warpgroup overlap, shorter ones the
  # ping-pong; 0: always the ping-pong.
  overlap_min_blocks: int = 0
  # setmaxnreg per consumer thread; the producer gets 504 - 2 x this.
  consumer_registers: int = 240


def o_in_q(dk: int, dv: int, q_buffers: int) -> bool:
  """Whether the output tile is staged in Q's shared memory: always when Dv == Dk; with Dv < Dk
  (MLA) in the per-tile kernel, through a RefUnion (frees 32 KiB)."""
  return dv == dk or (dv < dk and q_buffers == 1)


def smem_bytes(block_kv: int, stages: int, dk: int, dv: int, itemsize: int,
               q_buffers: int = 1) -> int:
  """Shared memory of one CTA."""
  q = q_buffers * CONSUMERS * ROWS_PER_WG * dk * itemsize
  o = 0 if o_in_q(dk, dv, q_buffers) else CONSUMERS * ROWS_PER_WG * dv * itemsize
  ring = stages * block_kv * (dk + dv) * itemsize
  return q + o + ring + CONSUMERS * ROWS_PER_WG * 4 + 1024


def _smem(shape, dtype):
  """A shared-memory buffer in the 128-byte swizzled, (8, 64)-tiled layout wgmma reads."""
  elems = 128 // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)),
                                               plgpu.SwizzleTransform(128)))


def accumulate(acc, a, b, interpret: bool):
  """acc + a @ b on the tensor cores (a: registers or shared memory, b: shared memory)."""
  if interpret:
    # The interpreter supports neither run_state nor register A operands.
    a_val = a if isinstance(a, jax.Array) else a[...]
    return acc + jnp.dot(a_val, b[...], preferred_element_type=jnp.float32)

  def product_into(ref):
    plgpu.wgmma(ref, a, b)
  return pl.run_state(product_into)(plgpu.ACC.init(acc))


def accumulate_then(acc, a, b, interpret: bool, then):
  """accumulate(acc, a, b), running `then()` while the product is in flight."""
  if interpret:
    acc = accumulate(acc, a, b, True)
    then()
    return acc

  def product_into(ref):
    plgpu.wgmma(ref, a, b)
    then()
  return pl.run_state(product_into)(plgpu.ACC.init(acc))


def products_together(first, second, interpret: bool):
  """Two independent products issued back to back and awaited once; each of `first` / `second`
  is (acc, a, b) -> acc + a @ b, or (None, a, b, shape) for a fresh float32 product."""
  def init(spec):
    acc = spec[0]
    if acc is None:
      acc = plgpu.layout_cast(jnp.zeros(spec[3], jnp.float32), plgpu.Layout.WGMMA)
    return acc

  if interpret:
    return tuple(accumulate(init(x), x[1], x[2], True) for x in (first, second))

  def issue(refs):
    plgpu.wgmma(refs[0], first[1], first[2])
    plgpu.wgmma(refs[1], second[1], second[2])
  return pl.run_state(issue)((plgpu.ACC.init(init(first)), plgpu.ACC.init(init(second))))


def pair_keep(cfg, q_pos, q_seg, kv_pos, kv_seg, shape, q_dim: int = 0):
  """keep[i, j] of a tile: queries along dimension q_dim (0: rows, 1: columns), kv the other."""
  kv_dim = 1 - q_dim
  qp = lax.broadcast_in_dim(q_pos, shape, [q_dim])
  qs = lax.broadcast_in_dim(q_seg, shape, [q_dim])
  kp = lax.broadcast_in_dim(kv_pos, shape, [kv_dim])
  ks = lax.broadcast_in_dim(kv_seg, shape, [kv_dim])
  keep = qs == ks
  if cfg.causal:
    keep = keep & (kp <= qp)
  if cfg.window:
    keep = keep & (qp - kp < cfg.window)
    if not cfg.causal:
      keep = keep & (kp - qp < cfg.window)
  return keep


def visit_order(lower, full_lower, full_upper, upper):
  """(masked, block): a table row's masked blocks [lower, full_lower) and [full_upper, upper)
  as one loop, then the full ones. `masked`: their count; block(n): the n-th block visited."""
  before = full_lower - lower
  masked = before + (upper - full_upper)

  def block(n):
    return jnp.where(n < before, lower + n,
                     jnp.where(n < masked, full_upper + (n - before), full_lower + (n - masked)))
  return masked, block


def released_for_tma(interpret: bool) -> None:
  """After waiting on a ring slot's `free` barrier, before the TMA load that overwrites it: in
  the interpreter a proxy fence so its race detector sees the ordering (nothing on the GPU)."""
  if interpret:
    plgpu.commit_smem()


def produce_kv_ring(k_rows, v_rows, k_smem, v_smem, k_ready, v_ready, k_free, v_free, count,
                    block, block_kv: int, stages: int, interpret: bool = False, ids=None,
                    base=0, drain: bool = True):
  """The producer's loop: TMA-load kv blocks block(0) .. block(count - 1) of one kv head into a
  ring of `stages` slots. ids: None or (pos_rows, seg_rows, pos_smem, seg_smem), loaded with K.
  base: the ring position of the first block; drain: wait for the last blocks' release."""

  @pl.loop(0, count)
  def _(n):
    slot = lax.rem(base + n, stages)
    rows = pl.ds(block(n) * block_kv, block_kv)

    @pl.when(base + n >= stages)
    def _():
      plgpu.barrier_wait(k_free.at[slot])
      released_for_tma(interpret)
    plgpu.copy_gmem_to_smem(k_rows.at[rows], k_smem.at[slot], k_ready.at[slot])
    if ids is not None:
      pos_rows, seg_rows, pos_smem, seg_smem = ids
      plgpu.copy_gmem_to_smem(pos_rows.at[rows], pos_smem.at[slot], k_ready.at[slot])
      plgpu.copy_gmem_to_smem(seg_rows.at[rows], seg_smem.at[slot], k_ready.at[slot])

    @pl.when(base + n >= stages)
    def _():
      plgpu.barrier_wait(v_free.at[slot])
      released_for_tma(interpret)
    plgpu.copy_gmem_to_smem(v_rows.at[rows], v_smem.at[slot], v_ready.at[slot])

  if drain:
    drain_kv_ring(k_free, v_free, base + count, stages)


def drain_kv_ring(k_free, v_free, total, stages: int):
  """Wait for the release of a ring's last loads (the interpreter checks every phase)."""

  @pl.loop(lax.max(0, total - stages), total)
  def _(n):
    slot = lax.rem(n, stages)
    plgpu.barrier_wait(k_free.at[slot])
    plgpu.barrier_wait(v_free.at[slot])


def forward_call(cfg: FwdConfig, q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks, lower, upper,
                 full_lower, full_upper):
  """out [B, Sq, H, Dv] (q.dtype), lse [B, H, Sq] float32. Inputs padded: Sq a multiple of
  cfg.table_q, Skv of cfg.table_kv, head dims of 64; q_seg's padding rows NO_SEGMENT."""
  b, sq, h, dk = q.shape
  kh, dv = k.shape[2], v.shape[3]
  group = h // kh
  bk, stages = cfg.block_kv, cfg.stages
  rq = cfg.table_q // TILE_Q
  rk = cfg.table_kv // bk
  dtype = q.dtype
  n_tiles = sq // TILE_Q
  n_work = b * n_tiles * h
  q_buffers = 2 if cfg.num_ctas else 1
  union = dv != dk and o_in_q(dk, dv, q_buffers)

  def kernel(q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, sinks_ref,
             lo_ref, up_ref, flo_ref, fup_ref, out_ref, lse_ref,
             q_smem, o_smem, k_smem, v_smem, lse_smem,
             q_ready, k_ready, v_ready, k_free, v_free, turn, q_dead=None, order_ref=None):
    wg = lax.axis_index("wg")
    if cfg.num_ctas:
      # Persistent: this CTA's items of the snake draft over cfg.num_ctas CTAs.
      sm = lax.axis_index("sm")
      full, part = divmod(n_work, cfg.num_ctas)
      slot = sm if full % 2 == 0 else cfg.num_ctas - 1 - sm
      n_items = full + (slot < part).astype(jnp.int32)
    else:
      n_items = 1

    def coords(i):
      if not cfg.num_ctas:
        head, bi, t = (lax.axis_index(n) for n in ("heads", "batch", "q_tiles"))
      else:
        sm = lax.axis_index("sm")
        sm = jnp.where(lax.rem(i, 2) == 0, sm, cfg.num_ctas - 1 - sm)
        w = sm + i * cfg.num_ctas
        bi, r = lax.div(w, n_tiles * h), lax.rem(w, n_tiles * h)
        t, head = lax.div(r, h), lax.rem(r, h)
      # The tiles longest first (by visited blocks), so a long tile does not start last and run
      # alone: dealt as a snake draft (persistent) or in launch order (per-tile), where the
      # hardware hands the next CTA to the first free SM.
      return bi, head, order_ref[bi, t]

    def item_table(bi, tile):
      row = tile // rq
      lower = lo_ref[bi, row] * rk
      upper = up_ref[bi, row] * rk
      full_lower = flo_ref[bi, row] * rk
      full_upper = fup_ref[bi, row] * rk
      masked_count, block = visit_order(lower, full_lower, full_upper, upper)
      return upper - lower, masked_count, block, full_lower

    def take_turn():
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

    def load_q(i, buf):
      bi, head, tile = coords(i)
      rows = pl.ds(tile * TILE_Q + wg * ROWS_PER_WG, ROWS_PER_WG)
      plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, head], q_smem.at[buf, wg],
                              q_ready.at[buf * CONSUMERS + wg])

    def consume_item(i, base):
      bi, head, tile = coords(i)
      count, masked_count, block, full_lower = item_table(bi, tile)
      q_base = tile * TILE_Q + wg * ROWS_PER_WG
      rows = pl.ds(q_base, ROWS_PER_WG)
      buf = lax.rem(i, q_buffers) if q_buffers > 1 else 0
      my_q = q_smem.at[buf, wg]
      if not cfg.num_ctas:
        load_q(i, buf)
      q_pos = plgpu.load(qpos_ref.at[bi, rows], layout=_ROW, optimized=False)
      q_seg = plgpu.load(qseg_ref.at[bi, rows], layout=_ROW, optimized=False)
      m_i = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), M_INIT, jnp.float32), _ROW)
      l_i = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), 0.0, jnp.float32), _ROW)
      acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, dv), jnp.float32), plgpu.Layout.WGMMA)
      plgpu.barrier_wait(q_ready.at[buf * CONSUMERS + wg])
      if cfg.num_ctas:
        pl.when(i + 1 < n_items)(lambda: load_q(i + 1, 1 - buf))

      @pl.when(count > 0)
      def _():
        plgpu.barrier_wait(k_ready.at[lax.rem(base, stages)])

      def kv_ids(ki, masked: bool):
        """A masked block's kv ids, loaded before the product to hide their latency."""
        if not masked:
          return None
        cols = pl.ds(ki * bk, bk)
        return (plgpu.load(kvpos_ref.at[bi, cols], layout=_COL, optimized=False),
                plgpu.load(kvseg_ref.at[bi, cols], layout=_COL, optimized=False))

      def softmax(qk, m_i, l_i, ids):
        """Online-softmax update from raw logits qk [64, bk] float32: (P, new max, new row sum,
        alpha rescaling the old sums). ids: the kv ids of a masked block."""
        if cfg.soft_cap == 0.0 and cfg.scale > 0.0:
          # The scale folds into one FMA inside exp2.
          s, mul = qk, cfg.scale * LOG2E
        else:
          if cfg.soft_cap:
            s = jnp.tanh(qk * (cfg.scale / cfg.soft_cap)) * (cfg.soft_cap * LOG2E)
          else:
            s = qk * (cfg.scale * LOG2E)
          mul = 1.0
        if ids is not None:
          keep = pair_keep(cfg, q_pos, q_seg, *ids, s.shape)
          s = jnp.where(keep, s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1) * mul)
        p = jnp.exp2(s * mul - lax.broadcast_in_dim(m_new, s.shape, [0]))
        alpha = jnp.exp2(m_i - m_new)
        l_new = l_i * alpha + p.sum(axis=1)
        return p, m_new, l_new, alpha

      def rescaled(acc, alpha):
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      def await_next_k(n):
        @pl.when(n + 1 < count)
        def _():
          plgpu.barrier_wait(k_ready.at[lax.rem(base + n + 1, stages)])

      def issue_logits(ref, slot):
        plgpu.wgmma(ref, my_q, k_smem.at[slot].T)

      def logits(slot, then=lambda: None):
        def product(ref):
          issue_logits(ref, slot)
          then()
          return ref[...]
        return pl.run_scoped(product, plgpu.ACC((ROWS_PER_WG, bk), jnp.float32))

      def step(n, ki, carry, masked: bool):
        """The ping-pong schedule's step: S, softmax, then P V."""
        acc, m_i, l_i = carry
        slot = lax.rem(base + n, stages)
        ids = kv_ids(ki, masked)

        qk = logits(slot, then=take_turn)
        plgpu.barrier_arrive(k_free.at[slot])
        p, m_new, l_i, alpha = softmax(qk, m_i, l_i, ids)
        acc = rescaled(acc, alpha)
        p16 = p.astype(dtype)
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_wait(turn)
        if not cfg.interpret:
          def pv_then_next_k(ref):
            plgpu.wgmma(ref, p16, v_smem.at[slot])
            await_next_k(n)
          acc = pl.run_state(pv_then_next_k)(plgpu.ACC.init(acc))
        else:
          acc = accumulate(acc, p16, v_smem.at[slot], cfg.interpret)
          await_next_k(n)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i

      # Overlapped schedule: step n issues S_n then O += P_{n-1} V_{n-1} and runs S_n's softmax
      # while P V runs. No register a product reads may be written before its wait (else ptxas
      # serializes, C7513). Same sums in the same order as `step`: bitwise equal output.
      def first_block(m_i, l_i):
        slot = lax.rem(base, stages)
        ids = kv_ids(block(0), True)

        qk = logits(slot)
        plgpu.barrier_arrive(k_free.at[slot])
        p, m_new, l_new, _ = softmax(qk, m_i, l_i, ids)
        await_next_k(0)
        return p.astype(dtype), m_new, l_new

      def overlapped_step(n, ki, carry, masked: bool):
        acc, p_prev, m_i, l_i = carry
        slot = lax.rem(base + n, stages)
        prev = lax.rem(base + n - 1, stages)
        ids = kv_ids(ki, masked)
        if cfg.interpret:
          qk = logits(slot)
          plgpu.barrier_wait(v_ready.at[prev])
          acc = accumulate(acc, p_prev, v_smem.at[prev], True)
          plgpu.barrier_arrive(k_free.at[slot])
          p, m_new, l_new, alpha = softmax(qk, m_i, l_i, ids)
          await_next_k(n)
        else:
          def with_s(s_ref):
            issue_logits(s_ref, slot)
            plgpu.barrier_wait(v_ready.at[prev])

            def with_o(refs):
              o_ref, p_ref, m_ref, l_ref, a_ref = refs
              plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
              qk = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
              plgpu.barrier_arrive(k_free.at[slot])
              p, m_new, l_new, alpha = softmax(qk, m_ref[...], l_ref[...], ids)
              p_ref[...] = p
              m_ref[...] = m_new
              l_ref[...] = l_new
              a_ref[...] = alpha
              await_next_k(n)
            p_init = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, bk), jnp.float32),
                                       plgpu.Layout.WGMMA)
            return pl.run_state(with_o)((plgpu.ACC.init(acc), p_init, m_i, l_i, m_i))
          acc, p, m_new, l_new, alpha = pl.run_scoped(
              with_s, plgpu.ACC((ROWS_PER_WG, bk), jnp.float32))
        plgpu.barrier_arrive(v_free.at[prev])
        return rescaled(acc, alpha), p.astype(dtype), m_new, l_new

      def last_pv(acc, p_prev):
        prev = lax.rem(base + count - 1, stages)
        plgpu.barrier_wait(v_ready.at[prev])
        acc = accumulate(acc, p_prev, v_smem.at[prev], cfg.interpret)
        plgpu.barrier_arrive(v_free.at[prev])
        return acc

      def ping_pong_blocks():
        pl.when(wg == 1)(take_turn)
        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(0, masked_count, lambda n, c: step(n, block(n), c, True), carry)
        carry = lax.fori_loop(
            masked_count, count, lambda n, c: step(n, full_lower + (n - masked_count), c, False),
            carry)
        pl.when(wg == 0)(take_turn)
        return carry

      def overlapped_blocks():
        p16, m, l = first_block(m_i, l_i)
        carry = (acc, p16, m, l)
        carry = lax.fori_loop(1, masked_count,
                              lambda n, c: overlapped_step(n, block(n), c, True), carry)
        carry = lax.fori_loop(
            lax.max(1, masked_count), count,
            lambda n, c: overlapped_step(n, full_lower + (n - masked_count), c, False), carry)
        acc_n, p16, m, l = carry
        return last_pv(acc_n, p16), m, l

      if cfg.overlap_min_blocks:
        # Both consumers take the same branch, so the schedule barrier stays in step.
        acc, m_i, l_i = lax.cond(count >= cfg.overlap_min_blocks, overlapped_blocks,
                                 ping_pong_blocks)
      else:
        acc, m_i, l_i = ping_pong_blocks()

      # Empty rows (l == 0) are 0 with lse +inf; the sink joins after the loop; an overflowing
      # log-sum-exp stores NaN, never +inf.
      empty = l_i == 0.0
      if cfg.has_sinks:
        sink = sinks_ref[head] * LOG2E
        m_f = jnp.maximum(m_i, sink)
        alpha = jnp.exp2(m_i - m_f)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha + jnp.exp2(sink - m_f)
        m_i = m_f
      l_safe = jnp.where(empty, 1.0, l_i)
      out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
      out = jnp.where(lax.broadcast_in_dim(empty, out.shape, [0]), 0.0, out)
      lse = (m_i + jnp.log2(l_safe)) * LN2
      lse = jnp.where(empty, jnp.inf, jnp.where(lse == jnp.inf, jnp.nan, lse))
      if union:
        # O and Q share memory: both consumers must be past their last Q K^T before O is written.
        plgpu.barrier_arrive(q_dead)
        plgpu.barrier_wait(q_dead)
      my_o = my_q if o_smem is None else o_smem.at[wg]
      my_o[...] = out.astype(dtype)
      lse_smem.at[wg][...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_o, out_ref.at[bi, rows, head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[bi, head, rows])
      # Wait only until the stores have read shared memory, which the next item reuses.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      return base + count

    @pl.when(wg < CONSUMERS)
    def consumer():
      if not cfg.interpret:
        plgpu.set_max_registers(cfg.consumer_registers, action="increase")
      if cfg.num_ctas:
        pl.when(n_items > 0)(lambda: load_q(0, 0))
        lax.fori_loop(0, n_items, consume_item, jnp.int32(0))
      else:
        consume_item(0, 0)

    @pl.when(wg == CONSUMERS)
    def producer():
      if not cfg.interpret:
        plgpu.set_max_registers(producer_registers(cfg.consumer_registers), action="decrease")

      def produce_item(i, base):
        bi, head, tile = coords(i)
        count, _, block, _ = item_table(bi, tile)
        produce_kv_ring(k_ref.at[bi, :, head // group], v_ref.at[bi, :, head // group],
                        k_smem, v_smem, k_ready, v_ready, k_free, v_free, count, block, bk,
                        stages, interpret=cfg.interpret, base=base, drain=not cfg.num_ctas)
        return base + count

      if cfg.num_ctas:
        # One ring across the CTA's items, drained once after the last.
        total = lax.fori_loop(0, n_items, produce_item, jnp.int32(0))
        drain_kv_ring(k_free, v_free, total, stages)
      else:
        produce_item(0, 0)


  def entry(*refs):
    q_spec = _smem((q_buffers, CONSUMERS, ROWS_PER_WG, dk), dtype)
    o_spec = None if dv == dk else _smem((CONSUMERS, ROWS_PER_WG, dv), dtype)
    scratch = (
        plgpu.RefUnion(q_spec, o_spec) if union else q_spec,
        None if union else o_spec,
        _smem((stages, bk, dk), dtype),
        _smem((stages, bk, dv), dtype),
        plgpu.SMEM((CONSUMERS, ROWS_PER_WG), jnp.float32),
    )
    barriers = (
        plgpu.Barrier(num_barriers=q_buffers * CONSUMERS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS),
        plgpu.Barrier(num_arrivals=CONSUMERS) if union else None,
    )
    order_ref, refs = refs[n_in - 1], refs[:n_in - 1] + refs[n_in:]
    def scoped(q_or_union, o_smem, *rest):
      q_smem, o_smem = q_or_union if union else (q_or_union, o_smem)
      kernel(*refs, q_smem, o_smem, *rest, order_ref=order_ref)
    pl.run_scoped(scoped, *scratch, *barriers, collective_axes="wg")

  params = dict(interpret=plgpu.InterpretGPUParams()) if cfg.interpret else dict(
      compiler_params=plgpu.CompilerParams(approx_math=True))
  inputs = (q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks, lower, upper, full_lower, full_upper,
            longest_first(lower, upper, rq, sq // TILE_Q))
  n_in = len(inputs)
  return plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((b, sq, h, dv), dtype),
                jax.ShapeDtypeStruct((b, h, sq), jnp.float32)),
      **(dict(grid=(cfg.num_ctas,), grid_names=("sm",)) if cfg.num_ctas else
         dict(grid=(h, sq // TILE_Q, b), grid_names=("heads", "q_tiles", "batch"))),
      num_threads=CONSUMERS + 1,
      thread_name="wg",
      **params,
  )(*inputs)
