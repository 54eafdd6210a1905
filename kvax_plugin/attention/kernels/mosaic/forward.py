"""Forward kernel for Hopper in Pallas Mosaic GPU: FlashAttention over the block table.

One CTA per query tile (2 x 64 rows, one head): a producer warpgroup TMA-loads K / V into a ring,
two consumer warpgroups run the online softmax (ping-pong or intra-warpgroup overlap). Numerics
match the Triton kernel (base-2 logits, finite M_INIT, lse in natural log). Design:
docs/kernels.md ("mosaic"). Runs on the CPU through the Mosaic GPU interpreter (`interpret=True`).
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
ROWS_PER_WG = 64  # query rows per consumer warpgroup (one wgmma M tile)
CONSUMERS = 2
TILE_Q = ROWS_PER_WG * CONSUMERS
# q_seg of padding query rows becomes this id, which no kv token carries (real ids >= 0).
NO_SEGMENT = -2

_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per query row of a wgmma tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per kv column


@dataclasses.dataclass(frozen=True)
class FwdConfig:
  """Static description of one forward launch (hashable: part of the jit key)."""

  block_kv: int
  stages: int
  table_q: int  # the table's query block (a multiple of TILE_Q)
  table_kv: int  # the table's kv block (a multiple of block_kv)
  scale: float
  soft_cap: float  # 0: none
  has_sinks: bool
  causal: bool
  window: int  # 0: none
  interpret: bool
  # 0: one CTA per (batch, query tile, head). N > 0: a persistent kernel of N CTAs; between two
  # items the next item's Q and first kv blocks load behind the current one, hiding the per-CTA
  # start and end. Items are dealt like a snake draft (longest first; CTA c takes item c of even
  # rounds and N - 1 - c of odd ones) so the CTAs do not drift apart over a long row.
  num_ctas: int = 0
  # Items of at least this many kv blocks run the intra-warpgroup overlap, shorter ones the
  # ping-pong; 0: always the ping-pong (and head dims above 128, where it does not fit).
  overlap_min_blocks: int = 0
  # Registers per consumer thread (setmaxnreg; KernelOptions.mosaic_forward_registers); the
  # producer warpgroup gets 504 - 2 x this.
  consumer_registers: int = 240


def o_in_q(dk: int, dv: int, q_buffers: int) -> bool:
  """Whether the output tile is staged in Q's shared memory: always when Dv == Dk; with Dv < Dk
  (MLA) in the per-tile kernel through a RefUnion, both consumers past their last Q K^T before
  either writes O (frees 32 KiB so MLA fits 128-row kv blocks)."""
  return dv == dk or (dv < dk and q_buffers == 1)


def smem_bytes(block_kv: int, stages: int, dk: int, dv: int, itemsize: int,
               q_buffers: int = 1) -> int:
  """Shared memory of one CTA: Q (and O unless o_in_q) per consumer, times q_buffers, the K/V
  ring, lse."""
  q = q_buffers * CONSUMERS * ROWS_PER_WG * dk * itemsize
  o = 0 if o_in_q(dk, dv, q_buffers) else CONSUMERS * ROWS_PER_WG * dv * itemsize
  ring = stages * block_kv * (dk + dv) * itemsize
  return q + o + ring + CONSUMERS * ROWS_PER_WG * 4 + 1024  # + barriers and alignment


def _smem(shape, dtype):
  """A shared-memory buffer in the 128-byte swizzled, (8, 64)-tiled layout wgmma reads."""
  elems = 128 // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)),
                                               plgpu.SwizzleTransform(128)))


def accumulate(acc, a, b, interpret: bool):
  """acc + a @ b on the tensor cores (a: registers or shared memory, b: shared memory)."""
  if interpret:
    # The interpreter supports neither run_state nor register A operands: same product in jnp.
    a_val = a if isinstance(a, jax.Array) else a[...]
    return acc + jnp.dot(a_val, b[...], preferred_element_type=jnp.float32)

  def product_into(ref):
    plgpu.wgmma(ref, a, b)
  return pl.run_state(product_into)(plgpu.ACC.init(acc))


def accumulate_then(acc, a, b, interpret: bool, then):
  """accumulate(acc, a, b) with `then()` run while the product is in flight, so a barrier wait
  hides behind the tensor cores. The interpreter runs `then` after the product."""
  if interpret:
    acc = accumulate(acc, a, b, True)
    then()
    return acc

  def product_into(ref):
    plgpu.wgmma(ref, a, b)
    then()
  return pl.run_state(product_into)(plgpu.ACC.init(acc))


def products_together(first, second, interpret: bool):
  """Two independent tensor-core products issued back to back and awaited once. Each of
  `first` / `second` is (acc, a, b) -> acc + a @ b, or (None, a, b, shape) for a fresh float32
  product."""
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
  """keep[i, j] of a tile from per-token vectors: queries along dimension q_dim (0: rows, layout
  _ROW, as in the forward and dq kernels; 1: columns, _COL, as in the dk/dv kernel's S^T) and
  kv tokens along the other."""
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
  """(masked, block): the walk of a table row: the masked blocks [lower, full_lower) and
  [full_upper, upper) as ONE loop (traced once), then the full ones. `masked`: their count;
  block(n): the n-th block visited, also the producer's load order. Needs lower <= full_lower <=
  full_upper <= upper."""
  before = full_lower - lower
  masked = before + (upper - full_upper)

  def block(n):
    return jnp.where(n < before, lower + n,
                     jnp.where(n < masked, full_upper + (n - before), full_lower + (n - masked)))
  return masked, block


def released_for_tma(interpret: bool) -> None:
  """After waiting on a ring slot's `free` barrier, before the TMA load that overwrites it.
  Nothing on the GPU (the barrier orders it, as in CUTLASS's TMA pipelines); in the interpreter
  a proxy fence so its race detector sees that ordering (docs/kernels.md)."""
  if interpret:
    plgpu.commit_smem()


def produce_kv_ring(k_rows, v_rows, k_smem, v_smem, k_ready, v_ready, k_free, v_free, count,
                    block, block_kv: int, stages: int, interpret: bool = False, ids=None,
                    base=0, drain: bool = True):
  """The producer's loop: TMA-load kv blocks block(0) .. block(count - 1) of one kv head
  (k_rows / v_rows: [Skv, D] views) into a ring of `stages` slots, the n-th into slot n % stages
  once released. ids: None or (pos_rows, seg_rows, pos_smem, seg_smem), loaded with K. base: the
  ring position of the first block (a persistent kernel's earlier items); drain: wait for the
  consumers' release of the last blocks at the end."""

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
  """Observe the consumers' release of a ring's last loads (`total` blocks so far), so every
  barrier phase is waited on once, as the interpreter checks."""

  @pl.loop(lax.max(0, total - stages), total)
  def _(n):
    slot = lax.rem(n, stages)
    plgpu.barrier_wait(k_free.at[slot])
    plgpu.barrier_wait(v_free.at[slot])


def forward_call(cfg: FwdConfig, q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks, lower, upper,
                 full_lower, full_upper):
  """out [B, Sq, H, Dv] (q.dtype), lse [B, H, Sq] float32.

  Shapes must already be padded: Sq a multiple of cfg.table_q, Skv of cfg.table_kv, head dims
  multiples of 64; q_seg with padding rows rewritten to NO_SEGMENT; tables int32 [B, rows].
  """
  b, sq, h, dk = q.shape
  kh, dv = k.shape[2], v.shape[3]
  group = h // kh
  bk, stages = cfg.block_kv, cfg.stages
  rq = cfg.table_q // TILE_Q
  rk = cfg.table_kv // bk
  dtype = q.dtype
  n_tiles = sq // TILE_Q
  n_work = b * n_tiles * h  # work items (batch, query tile, head)
  q_buffers = 2 if cfg.num_ctas else 1
  union = dv != dk and o_in_q(dk, dv, q_buffers)  # O staged in Q's memory (RefUnion)

  def kernel(q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kvpos_ref, kvseg_ref, sinks_ref,
             lo_ref, up_ref, flo_ref, fup_ref, out_ref, lse_ref,
             q_smem, o_smem, k_smem, v_smem, lse_smem,
             q_ready, k_ready, v_ready, k_free, v_free, turn, q_dead=None, order_ref=None):
    wg = lax.axis_index("wg")
    if cfg.num_ctas:
      # Persistent: the items (heads fastest, tiles longest first) dealt to cfg.num_ctas CTAs as
      # a snake draft; this CTA takes its full rounds and maybe one item of the last.
      sm = lax.axis_index("sm")
      full, part = divmod(n_work, cfg.num_ctas)
      slot = sm if full % 2 == 0 else cfg.num_ctas - 1 - sm
      n_items = full + (slot < part).astype(jnp.int32)
    else:
      n_items = 1

    def coords(i):
      """(batch, head, query tile) of this CTA's i-th work item."""
      if not cfg.num_ctas:
        head, bi, t = (lax.axis_index(n) for n in ("heads", "batch", "q_tiles"))
      else:
        sm = lax.axis_index("sm")
        sm = jnp.where(lax.rem(i, 2) == 0, sm, cfg.num_ctas - 1 - sm)  # odd rounds mirrored
        w = sm + i * cfg.num_ctas
        bi, r = lax.div(w, n_tiles * h), lax.rem(w, n_tiles * h)
        t, head = lax.div(r, h), lax.rem(r, h)
      if order_ref is not None:  # persistent: the longest-first order of longest_first
        tile = order_ref[bi, t]
      elif cfg.causal:
        # Last tiles first: under a causal mask they have the most work (shorter launch tail).
        tile = n_tiles - 1 - t
      else:
        tile = t
      return bi, head, tile

    def item_table(bi, tile):
      """(count, masked_count, block, full_lower) of a query tile's table row."""
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
      """Start the TMA load of work item i's query rows of this consumer into Q buffer buf."""
      bi, head, tile = coords(i)
      rows = pl.ds(tile * TILE_Q + wg * ROWS_PER_WG, ROWS_PER_WG)
      plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, head], q_smem.at[buf, wg],
                              q_ready.at[buf * CONSUMERS + wg])

    def consume_item(i, base):
      """Work item i with the kv ring at position `base` (blocks consumed before it)."""
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
        # The next item's Q into the other buffer, behind this item's work.
        pl.when(i + 1 < n_items)(lambda: load_q(i + 1, 1 - buf))
      # The first block's K is awaited here, every later one behind the previous P V product.

      @pl.when(count > 0)
      def _():
        plgpu.barrier_wait(k_ready.at[lax.rem(base, stages)])

      def kv_ids(ki, masked: bool):
        """The kv block's positions and segment ids (masked steps only), loaded before the
        step's product so that their global-memory latency hides behind it."""
        if not masked:
          return None
        cols = pl.ds(ki * bk, bk)
        return (plgpu.load(kvpos_ref.at[bi, cols], layout=_COL, optimized=False),
                plgpu.load(kvseg_ref.at[bi, cols], layout=_COL, optimized=False))

      def softmax(qk, m_i, l_i, ids):
        """One block's online-softmax update from its raw logits qk [64, bk] float32:
        (P in float32, the new running max, the new row sum, alpha = the factor that
        brings the old sums to the new max). ids: the block's kv ids when it is masked."""
        if cfg.soft_cap == 0.0 and cfg.scale > 0.0:
          # max(scale * qk) = scale * max(qk): the scale folds into one FMA inside exp2.
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
        """Issue S = Q K^T of the block in ring slot `slot` into the accumulator ref."""
        plgpu.wgmma(ref, my_q, k_smem.at[slot].T)

      def logits(slot, then=lambda: None):
        """S = Q K^T [64, bk] float32 of the block in ring slot `slot`, `then()` run while the
        product is in flight."""
        def product(ref):
          issue_logits(ref, slot)
          then()
          return ref[...]
        return pl.run_scoped(product, plgpu.ACC((ROWS_PER_WG, bk), jnp.float32))

      def step(n, ki, carry, masked: bool):
        """The n-th visited block, kv block ki: S, softmax, then P V (the ping-pong schedule)."""
        acc, m_i, l_i = carry
        slot = lax.rem(base + n, stages)
        ids = kv_ids(ki, masked)

        qk = logits(slot, then=take_turn)
        plgpu.barrier_arrive(k_free.at[slot])
        p, m_new, l_i, alpha = softmax(qk, m_i, l_i, ids)
        acc = rescaled(acc, alpha)
        p16 = p.astype(dtype)
        plgpu.barrier_arrive(turn)  # softmax done: the other consumer may use the tensor cores
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_wait(turn)
        if not cfg.interpret:
          def pv_then_next_k(ref):
            plgpu.wgmma(ref, p16, v_smem.at[slot])
            await_next_k(n)
          acc = pl.run_state(pv_then_next_k)(plgpu.ACC.init(acc))
        else:
          acc = accumulate(acc, p16, v_smem.at[slot], cfg.interpret)
          await_next_k(n)  # interpreter: same order of waits, after the product
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i

      # The overlapped schedule: step n issues S_n = Q K_n^T then O += P_{n-1} V_{n-1}, and
      # computes S_n's softmax while P V runs; no schedule barrier. Block 0 only issues S_0, the
      # last P V runs after the loop. Nothing between a step's first product and its last wait
      # writes a register a product reads (else ptxas serializes them, C7513). Same sums in the
      # same order as `step`: bitwise the ping-pong's output.
      def first_block(m_i, l_i):
        slot = lax.rem(base, stages)
        ids = kv_ids(block(0), True)  # a full block 0 keeps every pair: the mask is a no-op

        qk = logits(slot)
        plgpu.barrier_arrive(k_free.at[slot])
        p, m_new, l_new, _ = softmax(qk, m_i, l_i, ids)  # O is 0: no rescale
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
              qk = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_n, not P V
              plgpu.barrier_arrive(k_free.at[slot])
              p, m_new, l_new, alpha = softmax(qk, m_ref[...], l_ref[...], ids)
              p_ref[...] = p
              m_ref[...] = m_new
              l_ref[...] = l_new
              a_ref[...] = alpha
              await_next_k(n)
            p_init = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, bk), jnp.float32),
                                       plgpu.Layout.WGMMA)  # overwritten: only its type counts
            # (the alpha ref starts from m_i: any [64] float32 in the row layout will do)
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

      def overlapped_blocks():  # count > 0
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
        # Both consumers take the same branch (one table row, one count), so the ping-pong's
        # schedule barrier stays in step.
        acc, m_i, l_i = lax.cond(count >= cfg.overlap_min_blocks, overlapped_blocks,
                                 ping_pong_blocks)
      else:
        acc, m_i, l_i = ping_pong_blocks()

      # NaN / inf (README, "NaN and inf"): a row is empty iff l == 0; empty rows are 0 with lse
      # +inf; the sink joins after the loop; an overflowing log-sum-exp stores NaN, never +inf.
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
        # O and Q share memory in no agreed layout (RefUnion): both consumers must be past
        # their last Q K^T product (awaited in their loops) before either writes O.
        plgpu.barrier_arrive(q_dead)
        plgpu.barrier_wait(q_dead)
      my_o = my_q if o_smem is None else o_smem.at[wg]
      my_o[...] = out.astype(dtype)
      lse_smem.at[wg][...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_o, out_ref.at[bi, rows, head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[bi, head, rows])
      # Wait until the stores have READ shared memory (the next item reuses the staging), not
      # until their writes land: the SM can start its next CTA sooner.
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
        # One ring across the CTA's items: the next item's first blocks load as soon as the
        # consumers release slots of this one; drained once, after the last item.
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
        plgpu.Barrier(num_arrivals=CONSUMERS) if union else None,  # q_dead
    )
    order_ref = None
    if cfg.num_ctas:  # the order is the last input: take it out of the kernel's positional refs
      order_ref, refs = refs[n_in - 1], refs[:n_in - 1] + refs[n_in:]
    def scoped(q_or_union, o_smem, *rest):
      q_smem, o_smem = q_or_union if union else (q_or_union, o_smem)
      kernel(*refs, q_smem, o_smem, *rest, order_ref=order_ref)
    pl.run_scoped(scoped, *scratch, *barriers, collective_axes="wg")

  params = dict(interpret=plgpu.InterpretGPUParams()) if cfg.interpret else dict(
      compiler_params=plgpu.CompilerParams(approx_math=True))
  inputs = (q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks, lower, upper, full_lower, full_upper)
  if cfg.num_ctas:  # the snake deal walks the tiles longest first
    inputs += (longest_first(lower, upper, rq, sq // TILE_Q),)
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
