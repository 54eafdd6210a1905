"""Backward kernels: FlashAttention-2 (Dao 2023, Algorithm 2) in three launches: delta =
rowsum(dO * O); dq per (query tile, head) over the `dq` table; dk/dv per (kv tile, head) over
the `dkv` table. Each program owns its output tile: no atomics, bitwise reproducible. GQA dk/dv:
per query head (float32 buffers the caller reduces) or, with GQA_INPLACE, per kv head.
"""

import triton
import triton.language as tl

from kvax_plugin.attention.kernels.triton.common import load_tile, pair_mask, scaled_logits


@triton.jit
def attn_bwd_delta_kernel(O, DO, DELTA, SQ: tl.constexpr, H: tl.constexpr, DV: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
  """Grid (cdiv(SQ, BLOCK_M), B * H). DELTA [B, H, SQ] float32."""
  pid_m = tl.program_id(0)
  pid_bh = tl.program_id(1)
  b = (pid_bh // H).to(tl.int64)
  h = pid_bh % H
  offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
  offs_d = tl.arange(0, BLOCK_DV)
  in_q = offs_m < SQ
  mask = in_q[:, None] & (offs_d[None, :] < DV)
  ptrs = b * SQ * H * DV + h * DV + offs_m[:, None] * (H * DV) + offs_d[None, :]
  o = tl.load(O + ptrs, mask=mask, other=0.0).to(tl.float32)
  do = tl.load(DO + ptrs, mask=mask, other=0.0).to(tl.float32)
  tl.store(DELTA + (b * H + h) * SQ + offs_m, tl.sum(o * do, 1), mask=in_q)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, q_pos, q_seg, K_head, V_head, KVPOS_b, KVSEG_b, tile,
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
  v = load_tile(v_ptrs, in_kv, offs_dv, DV, BLOCK_DV, MASKED)
  qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
  s2, t = scaled_logits(qk, SCALE, SOFT_CAP)
  if SOFT_CAP == 0:
    p = tl.exp2(qk * (SCALE * 1.4426950408889634) - lse2[:, None])
  else:
    p = tl.exp2(s2 - lse2[:, None])
  if MASKED:
    kv_pos = tl.load(KVPOS_b + kn, mask=in_kv, other=0)
    kv_seg = tl.load(KVSEG_b + kn, mask=in_kv, other=-1)
    keep = pair_mask(q_pos[:, None], q_seg[:, None], kv_pos[None, :], kv_seg[None, :],
                     CAUSAL, WINDOW)
    p = tl.where(keep, p, 0.0)
  dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
  ds = p * (dp - delta[:, None])
  if SOFT_CAP > 0:
    ds = ds * (1.0 - t * t)
  return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, QPOS, QSEG, KVPOS, KVSEG,
                       LOWER, UPPER, FULL_LOWER, FULL_UPPER,
                       DQ,
                       SQ: tl.constexpr, SKV: tl.constexpr, H: tl.constexpr, KH: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr,
                       SCALE: tl.constexpr, SOFT_CAP: tl.constexpr,
                       CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                       TABLE_M: tl.constexpr, TABLE_N: tl.constexpr, TABLE_ROWS: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
  """Grid (B * H, cdiv(SQ, BLOCK_M)), heads fastest, last query tiles first. DQ [B, SQ, H, DK]."""
  pid_bh = tl.program_id(0)
  pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
  b = pid_bh // H
  h = pid_bh % H
  kh = h // (H // KH)
  Q_ROW: tl.constexpr = H * DK
  K_ROW: tl.constexpr = KH * DK
  V_ROW: tl.constexpr = KH * DV
  DO_ROW: tl.constexpr = H * DV

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
  do_ptrs = DO + b64 * SQ * DO_ROW + h * DV + offs_m[:, None] * DO_ROW + offs_dv[None, :]
  do = tl.load(do_ptrs, mask=in_q[:, None] & (offs_dv[None, :] < DV), other=0.0)
  lse2 = tl.load(LSE + (b64 * H + h) * SQ + offs_m, mask=in_q, other=float("inf"))
  lse2 = lse2 * 1.4426950408889634
  delta = tl.load(DELTA + (b64 * H + h) * SQ + offs_m, mask=in_q, other=0.0)
  q_pos = tl.load(QPOS + b64 * SQ + offs_m, mask=in_q, other=0)
  q_seg = tl.load(QSEG + b64 * SQ + offs_m, mask=in_q, other=-1)
  K_head = K + b64 * SKV * K_ROW + kh * DK
  V_head = V + b64 * SKV * V_ROW + kh * DV
  KVPOS_b = KVPOS + b64 * SKV
  KVSEG_b = KVSEG + b64 * SKV

  dq = tl.zeros([BLOCK_M, BLOCK_DK], dtype=tl.float32)
  for tile in range(lower, full_lower):
    dq = _dq_tile(dq, q, do, lse2, delta, q_pos, q_seg, K_head, V_head, KVPOS_b, KVSEG_b, tile,
                  offs_n, offs_dk, offs_dv, SKV, DK, DV, K_ROW, V_ROW, BLOCK_N, BLOCK_DK,
                  BLOCK_DV, SCALE, SOFT_CAP, CAUSAL, WINDOW, True, DOT_PRECISION)
  for tile in range(full_lower, full_upper):
    dq = _dq_tile(dq, q, do, lse2, delta, q_pos, q_seg, K_head, V_head, KVPOS_b, KVSEG_b, tile,
                  offs_n, offs_dk, offs_dv, SKV, DK, DV, K_ROW, V_ROW, BLOCK_N, BLOCK_DK,
                  BLOCK_DV, SCALE, SOFT_CAP, CAUSAL, WINDOW, False, DOT_PRECISION)
  for tile in range(full_upper, upper):
    dq = _dq_tile(dq, q, do, lse2, delta, q_pos, q_seg, K_head, V_head, KVPOS_b, KVSEG_b, tile,
                  offs_n, offs_dk, offs_dv, SKV, DK, DV, K_ROW, V_ROW, BLOCK_N, BLOCK_DK,
                  BLOCK_DV, SCALE, SOFT_CAP, CAUSAL, WINDOW, True, DOT_PRECISION)
  # An empty row (lse = +inf) gets exactly 0, also through 0 * NaN.
  dq = tl.where((lse2 == float("inf"))[:, None], 0.0, dq * SCALE)
  dq_ptrs = DQ + b64 * SQ * Q_ROW + h * DK + offs_m[:, None] * Q_ROW + offs_dk[None, :]
  tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=in_q[:, None] & (offs_dk[None, :] < DK))


@triton.jit
def _dkv_tile(dk, dv, k, v, kv_pos, kv_seg, Q_head, DO_head, LSE_h, DELTA_h, QPOS_b, QSEG_b,
              tile, offs_m, offs_dk, offs_dv,
              SQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              Q_ROW: tl.constexpr, DO_ROW: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SCALE: tl.constexpr,
              SOFT_CAP: tl.constexpr, CAUSAL: tl.constexpr,
              WINDOW: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
  # Transposed tiles ([kv, q]): dk and dv come out of plain row-major dots.
  start = tile * BLOCK_M
  qm = start + offs_m
  q_ptrs = Q_head + start.to(tl.int64) * Q_ROW + offs_m[:, None] * Q_ROW + offs_dk[None, :]
  do_ptrs = DO_head + start.to(tl.int64) * DO_ROW + offs_m[:, None] * DO_ROW + offs_dv[None, :]
  in_q = qm < SQ
  q = load_tile(q_ptrs, in_q, offs_dk, DK, BLOCK_DK, MASKED)
  do = load_tile(do_ptrs, in_q, offs_dv, DV, BLOCK_DV, MASKED)
  if MASKED:
    lse2 = tl.load(LSE_h + qm, mask=in_q, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA_h + qm, mask=in_q, other=0.0)
  else:
    lse2 = tl.load(LSE_h + qm) * 1.4426950408889634
    delta = tl.load(DELTA_h + qm)
  qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
  s2_t, t_t = scaled_logits(qk_t, SCALE, SOFT_CAP)
  if SOFT_CAP == 0:
    p_t = tl.exp2(qk_t * (SCALE * 1.4426950408889634) - lse2[None, :])
  else:
    p_t = tl.exp2(s2_t - lse2[None, :])
  if MASKED:
    q_pos = tl.load(QPOS_b + qm, mask=in_q, other=0)
    q_seg = tl.load(QSEG_b + qm, mask=in_q, other=-1)
    keep = pair_mask(q_pos[None, :], q_seg[None, :], kv_pos[:, None], kv_seg[:, None],
                     CAUSAL, WINDOW)
    p_t = tl.where(keep, p_t, 0.0)
  dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
  dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
  ds_t = p_t * (dp_t - delta[None, :])
  if SOFT_CAP > 0:
    ds_t = ds_t * (1.0 - t_t * t_t)
  dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
  return dk, dv


@triton.jit
def attn_bwd_dkv_kernel(Q, K, V, DO, LSE, DELTA, QPOS, QSEG, KVPOS, KVSEG,
                        LOWER, UPPER, FULL_LOWER, FULL_UPPER,
                        DK_OUT, DV_OUT,
                        SQ: tl.constexpr, SKV: tl.constexpr, H: tl.constexpr,
                        KH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        SCALE: tl.constexpr, SOFT_CAP: tl.constexpr,
                        CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                        TABLE_M: tl.constexpr, TABLE_N: tl.constexpr, TABLE_ROWS: tl.constexpr,
                        GQA_INPLACE: tl.constexpr, DOT_PRECISION: tl.constexpr):
  """Grid (B * (KH if GQA_INPLACE else H), cdiv(SKV, BLOCK_N)), heads fastest. DK_OUT / DV_OUT:
  [B, SKV, KH, D] with GQA_INPLACE (group summed in registers), else [B, SKV, H, D]."""
  pid_bh = tl.program_id(0)
  pid_n = tl.program_id(1)
  G: tl.constexpr = H // KH
  if GQA_INPLACE:
    OUT_HEADS: tl.constexpr = KH
    b = pid_bh // KH
    kh = pid_bh % KH
    out_head = kh
  else:
    OUT_HEADS: tl.constexpr = H
    b = pid_bh // H
    out_head = pid_bh % H
    kh = out_head // G
  Q_ROW: tl.constexpr = H * DK
  K_ROW: tl.constexpr = KH * DK
  V_ROW: tl.constexpr = KH * DV
  DO_ROW: tl.constexpr = H * DV

  row = b * TABLE_ROWS + (pid_n * BLOCK_N) // TABLE_N
  R: tl.constexpr = TABLE_M // BLOCK_M
  lower = tl.load(LOWER + row) * R
  upper = tl.load(UPPER + row) * R
  full_lower = tl.load(FULL_LOWER + row) * R
  full_upper = tl.load(FULL_UPPER + row) * R

  offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
  offs_m = tl.arange(0, BLOCK_M)
  offs_dk = tl.arange(0, BLOCK_DK)
  offs_dv = tl.arange(0, BLOCK_DV)
  in_kv = offs_n < SKV
  b64 = b.to(tl.int64)
  k_ptrs = K + b64 * SKV * K_ROW + kh * DK + offs_n[:, None] * K_ROW + offs_dk[None, :]
  v_ptrs = V + b64 * SKV * V_ROW + kh * DV + offs_n[:, None] * V_ROW + offs_dv[None, :]
  k = tl.load(k_ptrs, mask=in_kv[:, None] & (offs_dk[None, :] < DK), other=0.0)
  v = tl.load(v_ptrs, mask=in_kv[:, None] & (offs_dv[None, :] < DV), other=0.0)
  kv_pos = tl.load(KVPOS + b64 * SKV + offs_n, mask=in_kv, other=0)
  kv_seg = tl.load(KVSEG + b64 * SKV + offs_n, mask=in_kv, other=-1)
  QPOS_b = QPOS + b64 * SQ
  QSEG_b = QSEG + b64 * SQ

  dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
  dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
  if GQA_INPLACE:
    NUM_HEADS: tl.constexpr = G
  else:
    NUM_HEADS: tl.constexpr = 1
  for g in range(NUM_HEADS):
    if GQA_INPLACE:
      h = kh * G + g
    else:
      h = out_head
    Q_head = Q + b64 * SQ * Q_ROW + h * DK
    DO_head = DO + b64 * SQ * DO_ROW + h * DV
    LSE_h = LSE + (b64 * H + h) * SQ
    DELTA_h = DELTA + (b64 * H + h) * SQ
    for tile in range(lower, full_lower):
      dk, dv = _dkv_tile(dk, dv, k, v, kv_pos, kv_seg, Q_head, DO_head, LSE_h, DELTA_h, QPOS_b,
                         QSEG_b, tile, offs_m, offs_dk, offs_dv, SQ, DK, DV, Q_ROW, DO_ROW,
                         BLOCK_M, BLOCK_DK, BLOCK_DV, SCALE, SOFT_CAP, CAUSAL, WINDOW, True,
                         DOT_PRECISION)
    for tile in range(full_lower, full_upper):
      dk, dv = _dkv_tile(dk, dv, k, v, kv_pos, kv_seg, Q_head, DO_head, LSE_h, DELTA_h, QPOS_b,
                         QSEG_b, tile, offs_m, offs_dk, offs_dv, SQ, DK, DV, Q_ROW, DO_ROW,
                         BLOCK_M, BLOCK_DK, BLOCK_DV, SCALE, SOFT_CAP, CAUSAL, WINDOW, False,
                         DOT_PRECISION)
    for tile in range(full_upper, upper):
      dk, dv = _dkv_tile(dk, dv, k, v, kv_pos, kv_seg, Q_head, DO_head, LSE_h, DELTA_h, QPOS_b,
                         QSEG_b, tile, offs_m, offs_dk, offs_dv, SQ, DK, DV, Q_ROW, DO_ROW,
                         BLOCK_M, BLOCK_DK, BLOCK_DV, SCALE, SOFT_CAP, CAUSAL, WINDOW, True,
                         DOT_PRECISION)
  dk = dk * SCALE
  out_mask_k = in_kv[:, None] & (offs_dk[None, :] < DK)
  out_mask_v = in_kv[:, None] & (offs_dv[None, :] < DV)
  dk_ptrs = (DK_OUT + b64 * SKV * OUT_HEADS * DK + out_head * DK
             + offs_n[:, None] * (OUT_HEADS * DK) + offs_dk[None, :])
  dv_ptrs = (DV_OUT + b64 * SKV * OUT_HEADS * DV + out_head * DV
             + offs_n[:, None] * (OUT_HEADS * DV) + offs_dv[None, :])
  tl.store(dk_ptrs, dk.to(DK_OUT.dtype.element_ty), mask=out_mask_k)
  tl.store(dv_ptrs, dv.to(DV_OUT.dtype.element_ty), mask=out_mask_v)
