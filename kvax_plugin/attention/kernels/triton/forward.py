"""Forward kernel: FlashAttention-2 (Dao 2023, Algorithm 1) over the block table.

One program per (query tile, head) walks its `fwd` table row, masking only outside
[full_lower, full_upper). Online softmax in base 2 from the lowest finite float32, so an empty
row keeps l = 0 (output 0, lse +inf); a NaN l is not empty, and NaN reaches l through p, never
through max() (GPU max drops NaN).
"""

import triton
import triton.language as tl

from kvax_plugin.attention.kernels.triton.common import load_tile, pair_mask, scaled_logits


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, K_head, V_head, KVPOS_b, KVSEG_b, q_pos, q_seg, tile,
              offs_n, offs_dk, offs_dv,
              SKV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              K_ROW: tl.constexpr, V_ROW: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
              SCALE: tl.constexpr, SOFT_CAP: tl.constexpr, CAUSAL: tl.constexpr,
              WINDOW: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
  start = tile * BLOCK_N
  kn = start + offs_n
  k_ptrs = K_head + start.to(tl.int64) * K_ROW + offs_n[:, None] * K_ROW + offs_dk[None, :]
  v_ptrs = V_head + start.to(tl.int64) * V_ROW + offs_n[:, None] * V_ROW + offs_dv[None, :]
  in_kv = kn < SKV
  k = load_tile(k_ptrs, in_kv, offs_dk, DK, BLOCK_DK, MASKED)
  qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
  if MASKED:
    kv_pos = tl.load(KVPOS_b + kn, mask=in_kv, other=0)
    kv_seg = tl.load(KVSEG_b + kn, mask=in_kv, other=-1)
    keep = pair_mask(q_pos[:, None], q_seg[:, None], kv_pos[None, :], kv_seg[None, :],
                     CAUSAL, WINDOW)
  if SOFT_CAP == 0 and SCALE > 0:
    # The scale folds into one FMA inside exp2.
    C: tl.constexpr = SCALE * 1.4426950408889634
    if MASKED:
      qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * C)
    p = tl.exp2(qk * C - m_new[:, None])
  else:
    s, _ = scaled_logits(qk, SCALE, SOFT_CAP)
    if MASKED:
      s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
  alpha = tl.exp2(m_i - m_new)
  l_i = l_i * alpha + tl.sum(p, 1)
  acc = acc * alpha[:, None]
  v = load_tile(v_ptrs, in_kv, offs_dv, DV, BLOCK_DV, MASKED)
  acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
  return acc, m_new, l_i


@triton.jit
def attn_fwd_kernel(Q, K, V, QPOS, QSEG, KVPOS, KVSEG, SINKS,
                    LOWER, UPPER, FULL_LOWER, FULL_UPPER,
                    O, LSE,
                    SQ: tl.constexpr, SKV: tl.constexpr, H: tl.constexpr, KH: tl.constexpr,
                    DK: tl.constexpr, DV: tl.constexpr,
                    SCALE: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                    TABLE_M: tl.constexpr, TABLE_N: tl.constexpr, TABLE_ROWS: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
  """Grid (B * H, cdiv(SQ, BLOCK_M)): heads fastest (kv tiles reused from L2), last query tiles
  first (most causal work). Writes O [B, SQ, H, DV] and LSE [B, H, SQ] (float32)."""
  pid_bh = tl.program_id(0)
  pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
  b = pid_bh // H
  h = pid_bh % H
  kh = h // (H // KH)
  Q_ROW: tl.constexpr = H * DK
  K_ROW: tl.constexpr = KH * DK
  V_ROW: tl.constexpr = KH * DV
  O_ROW: tl.constexpr = H * DV

  row = b * TABLE_ROWS + (pid_m * BLOCK_M) // TABLE_M
  R: tl.constexpr = TABLE_N // BLOCK_N
  lower = tl.load(LOWER + row) * R
  upper = tl.load(UPPER + row) * R
  full_lower = tl.load(FULL_LOWER + row) * R
  full_upper = tl.load(FULL_UPPER + row) * R

  offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
  offs_n = tl.arange(0, BLOCK_N)
  offs_dk = tl.arange(0, BLOCK_DK)
  offs_dv = tl.arange(0, BLOCK_DV)
  in_q = offs_m < SQ
  b64 = b.to(tl.int64)
  q_ptrs = Q + b64 * SQ * Q_ROW + h * DK + offs_m[:, None] * Q_ROW + offs_dk[None, :]
  q = tl.load(q_ptrs, mask=in_q[:, None] & (offs_dk[None, :] < DK), other=0.0)
  q_pos = tl.load(QPOS + b64 * SQ + offs_m, mask=in_q, other=0)
  q_seg = tl.load(QSEG + b64 * SQ + offs_m, mask=in_q, other=-1)
  K_head = K + b64 * SKV * K_ROW + kh * DK
  V_head = V + b64 * SKV * V_ROW + kh * DV
  KVPOS_b = KVPOS + b64 * SKV
  KVSEG_b = KVSEG + b64 * SKV

  m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 3.4028234663852886e38
  l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
  acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

  for tile in range(lower, full_lower):
    acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K_head, V_head, KVPOS_b, KVSEG_b, q_pos, q_seg,
                              tile, offs_n, offs_dk, offs_dv, SKV, DK, DV, K_ROW, V_ROW, BLOCK_N,
                              BLOCK_DK, BLOCK_DV, SCALE, SOFT_CAP, CAUSAL, WINDOW, True,
                              DOT_PRECISION)
  for tile in range(full_lower, full_upper):
    acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K_head, V_head, KVPOS_b, KVSEG_b, q_pos, q_seg,
                              tile, offs_n, offs_dk, offs_dv, SKV, DK, DV, K_ROW, V_ROW, BLOCK_N,
                              BLOCK_DK, BLOCK_DV, SCALE, SOFT_CAP, CAUSAL, WINDOW, False,
                              DOT_PRECISION)
  for tile in range(full_upper, upper):
    acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K_head, V_head, KVPOS_b, KVSEG_b, q_pos, q_seg,
                              tile, offs_n, offs_dk, offs_dv, SKV, DK, DV, K_ROW, V_ROW, BLOCK_N,
                              BLOCK_DK, BLOCK_DV, SCALE, SOFT_CAP, CAUSAL, WINDOW, True,
                              DOT_PRECISION)

  nonempty = l_i != 0.0
  if HAS_SINKS:
    # The sink is one more logit in the denominator: merged as a last tile.
    sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
    m_all = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_all)
    l_i = l_i * alpha + tl.exp2(sink - m_all)
    acc = acc * alpha[:, None]
    m_i = m_all
  l_safe = tl.where(nonempty, l_i, 1.0)
  # Empty rows are 0 even through 0 * NaN.
  out = tl.where(nonempty[:, None], acc / l_safe[:, None], 0.0)
  # A non-empty row whose log-sum-exp is +inf stores NaN, so its gradients are NaN, not 0.
  lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
  lse = tl.where(nonempty, tl.where(lse == float("inf"), float("nan"), lse), float("inf"))
  o_ptrs = O + b64 * SQ * O_ROW + h * DV + offs_m[:, None] * O_ROW + offs_dv[None, :]
  tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=in_q[:, None] & (offs_dv[None, :] < DV))
  tl.store(LSE + (b64 * H + h) * SQ + offs_m, lse, mask=in_q)
