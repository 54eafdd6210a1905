"""Pieces shared by the forward and backward kernels: logits and the token-level mask. Sizes and
strides are tl.constexpr (static shapes let Triton prove alignment); logits in base 2, lse in
natural log.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
PADDING = -1


@triton.jit
def tanh_f32(x):
  # tanh from exp2: saturates correctly and needs no libdevice (the interpreter runs it).
  return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def scaled_logits(qk, SCALE: tl.constexpr, SOFT_CAP: tl.constexpr):
  """(base-2 logits, tanh) of raw dot products qk (float32); tanh is 0 without a soft cap."""
  if SOFT_CAP > 0:
    t = tanh_f32(qk * (SCALE / SOFT_CAP))
    return t * (SOFT_CAP * 1.4426950408889634), t
  else:
    return qk * (SCALE * 1.4426950408889634), qk * 0.0


@triton.jit
def pair_mask(q_pos, q_seg, kv_pos, kv_seg, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
  """keep [M, N] for q tokens (q_pos, q_seg are [M, 1]) and kv tokens ([1, N]); any orientation."""
  keep = (q_seg == kv_seg) & (q_seg != -1)
  if CAUSAL:
    keep = keep & (kv_pos <= q_pos)
  if WINDOW > 0:
    keep = keep & diff_below(q_pos, kv_pos, WINDOW)
    if not CAUSAL:
      keep = keep & diff_below(kv_pos, q_pos, WINDOW)
  return keep


@triton.jit
def diff_below(a, b, W: tl.constexpr):
  """a - b < W exactly for int32 a, b and 1 <= W < 2**32 (as block_mask.diff_below)."""
  d = a.to(tl.uint32, bitcast=True) - b.to(tl.uint32, bitcast=True)
  return (a < b) | (d < W)


@triton.jit
def load_tile(ptrs, rows_ok, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr,
              ROW_MASK: tl.constexpr):
  """Load a [rows, BLOCK_D] tile, masking rows and columns only where needed."""
  if ROW_MASK:
    return tl.load(ptrs, mask=rows_ok[:, None] & (offs_d[None, :] < D), other=0.0)
  elif BLOCK_D != D:
    return tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
  else:
    return tl.load(ptrs)
