"""backend="jax": blockwise FlashAttention-2 in pure JAX (CPU, TPU, any GPU).

Walks the same block tables as the other backends (online softmax; custom VJP recomputing
probabilities from the saved lse), so no [Sq x Skv] array is stored. float32 arithmetic
(float64 for float64 inputs). Query blocks are [bq, K, G, D] with H = K * G. A row is empty iff
l == 0 (never `l > 0`, which would read NaN as empty); the sink joins after the loop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention.block_mask import AttentionMask, BlockTable, num_blocks, token_keep
from kvax_plugin.attention.kernels.capabilities import Capabilities
from kvax_plugin.attention.kernels.custom_vjp import (KernelParts, as_stored,
                                                      capturing_kernel_parts, saved_residuals)
from kvax_plugin.attention.params import PADDING_SEGMENT_ID

CAPABILITIES = Capabilities(dtypes=("float32", "bfloat16", "float16", "float64"))

# Outer blocks vectorised per lax.map step: more is faster, costs memory.
_OUTER_BLOCKS_PER_STEP = 8


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  soft_cap: float | None
  has_sinks: bool
  causal: bool
  window: int | None
  compute_dtype: np.dtype = np.dtype(np.float32)


def _pad_seq(x: jax.Array, block: int, fill) -> jax.Array:
  extra = num_blocks(x.shape[1], block) * block - x.shape[1]
  if extra == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, extra)
  return jnp.pad(x, pad, constant_values=fill)


def _pair_mask(cfg: _Static, q_pos, q_seg, kv_pos, kv_seg) -> jax.Array:
  return token_keep(q_pos[:, None], q_seg[:, None], kv_pos[None, :], kv_seg[None, :],
                    causal=cfg.causal, sliding_window=cfg.window)


def _logits(cfg: _Static, q_blk, k_blk):
  """Scaled (and soft-capped) logits [K, G, bq, bk], plus tanh for the soft-cap gradient."""
  s = jnp.einsum("qkgd,tkd->kgqt", q_blk, k_blk) * cfg.scale
  if cfg.soft_cap is None:
    return s, None
  t = jnp.tanh(s / cfg.soft_cap)
  return cfg.soft_cap * t, t


def _block_mask(cfg, is_full, q_pos, q_seg, kv_pos, kv_seg):

  return is_full | _pair_mask(cfg, q_pos, q_seg, kv_pos, kv_seg)


def _slice_block(x: jax.Array, batch, index, block: int) -> jax.Array:
  """x[batch, index * block : (index + 1) * block] for x [B, S, ...] (no copy of x[batch])."""
  # int32 start indices: under JAX_ENABLE_X64 a Python 0 would be int64.
  i32 = lambda i: jnp.asarray(i, jnp.int32)
  start = [i32(batch), i32(index) * block] + [i32(0)] * (x.ndim - 2)
  return jax.lax.dynamic_slice(x, start, (1, block) + x.shape[2:])[0]


def _blocks(x: jax.Array, block: int) -> jax.Array:
  return x.reshape((x.shape[0] * (x.shape[1] // block), block) + x.shape[2:])


def _table_rows(table: BlockTable):
  return tuple(x.reshape(-1) for x in table)


def _forward(cfg: _Static, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, table: BlockTable,
             bq: int, bk: int):
  """out [B, Sq, K, G, Dv] and lse [B, Sq, K, G] (+inf: empty row) in the compute dtype."""
  b, sq, kh, g, _ = q.shape
  ct = cfg.compute_dtype
  qp = _pad_seq(q.astype(ct), bq, 0)
  kp = _pad_seq(k.astype(ct), bk, 0)
  vp = _pad_seq(v.astype(ct), bk, 0)
  kv_pos_p = _pad_seq(kv_pos, bk, 0)
  kv_seg_p = _pad_seq(kv_seg, bk, PADDING_SEGMENT_ID)
  nq = qp.shape[1] // bq
  batch_index = jnp.repeat(jnp.arange(b, dtype=jnp.int32), nq)
  lower, upper, full_lower, full_upper = _table_rows(table)
  sink = sinks.astype(ct).reshape(kh, g, 1)

  def one_query_block(args):
    bi, q_blk, q_pos_blk, q_seg_blk, lo, hi, flo, fhi = args

    def body(carry):
      j, m, l, acc = carry
      s, _ = _logits(cfg, q_blk, _slice_block(kp, bi, j, bk))
      keep = _block_mask(cfg, (j >= flo) & (j < fhi), q_pos_blk, q_seg_blk,
                         _slice_block(kv_pos_p, bi, j, bk), _slice_block(kv_seg_p, bi, j, bk))
      s = jnp.where(keep, s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      l = alpha * l + jnp.sum(p, axis=-1)
      acc = alpha[..., None] * acc + jnp.einsum("kgqt,tkd->kgqd", p, _slice_block(vp, bi, j, bk))
      return j + 1, m_new, l, acc

    m0 = jnp.full((kh, g, bq), -jnp.inf, ct)
    l0 = jnp.zeros((kh, g, bq), ct)
    acc0 = jnp.zeros((kh, g, bq, vp.shape[-1]), ct)
    _, m, l, acc = jax.lax.while_loop(lambda c: c[0] < hi, body, (lo, m0, l0, acc0))

    nonempty = l != 0
    if cfg.has_sinks:
      # The sink is one more logit in the denominator: merged as one more block.
      m_all = jnp.maximum(m, sink)
      m_all_safe = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
      alpha = jnp.exp(m - m_all_safe)
      l = alpha * l + jnp.exp(sink - m_all_safe)
      acc = alpha[..., None] * acc
      m = m_all
    l_safe = jnp.where(nonempty, l, 1.0)
    out = jnp.where(nonempty[..., None], acc / l_safe[..., None], 0.0)
    # lse +inf marks an empty row; a +inf log-sum-exp of a non-empty row becomes NaN.
    lse = m + jnp.log(l_safe)
    lse = jnp.where(nonempty, jnp.where(lse == jnp.inf, jnp.nan, lse), jnp.inf)
    return jnp.moveaxis(out, 2, 0), jnp.moveaxis(lse, 2, 0)

  xs = (batch_index, _blocks(qp, bq), _blocks(_pad_seq(q_pos, bq, 0), bq),
        _blocks(_pad_seq(q_seg, bq, PADDING_SEGMENT_ID), bq), lower, upper, full_lower,
        full_upper)
  out, lse = jax.lax.map(one_query_block, xs, batch_size=_OUTER_BLOCKS_PER_STEP)
  out = out.reshape(b, nq * bq, kh, g, -1)[:, :sq]
  lse = lse.reshape(b, nq * bq, kh, g)[:, :sq]
  return out, lse


def _backward_dq(cfg, q, k, v, do, lse, delta, q_pos, q_seg, kv_pos, kv_seg, table, bq, bk):
  b, sq, kh, g, _ = q.shape
  qp = _pad_seq(q, bq, 0)
  dop = _pad_seq(do, bq, 0)
  lsep = _pad_seq(lse, bq, jnp.inf)
  deltap = _pad_seq(delta, bq, 0)
  kp, vp = _pad_seq(k, bk, 0), _pad_seq(v, bk, 0)
  kv_pos_p, kv_seg_p = _pad_seq(kv_pos, bk, 0), _pad_seq(kv_seg, bk, PADDING_SEGMENT_ID)
  nq = qp.shape[1] // bq
  batch_index = jnp.repeat(jnp.arange(b, dtype=jnp.int32), nq)

  def one_query_block(args):
    bi, q_blk, do_blk, lse_blk, delta_blk, q_pos_blk, q_seg_blk, lo, hi, flo, fhi = args
    lse_t = jnp.moveaxis(lse_blk, 0, 2)[..., None]
    delta_t = jnp.moveaxis(delta_blk, 0, 2)[..., None]

    def body(carry):
      j, dq = carry
      k_blk, v_blk = _slice_block(kp, bi, j, bk), _slice_block(vp, bi, j, bk)
      s, t = _logits(cfg, q_blk, k_blk)
      keep = _block_mask(cfg, (j >= flo) & (j < fhi), q_pos_blk, q_seg_blk,
                         _slice_block(kv_pos_p, bi, j, bk), _slice_block(kv_seg_p, bi, j, bk))
      p = jnp.where(keep, jnp.exp(s - lse_t), 0.0)
      dp = jnp.einsum("qkgd,tkd->kgqt", do_blk, v_blk)
      ds = p * (dp - delta_t)
      if t is not None:
        ds = ds * (1.0 - t * t)
      return j + 1, dq + jnp.einsum("kgqt,tkd->qkgd", ds, k_blk) * cfg.scale

    _, dq = jax.lax.while_loop(lambda c: c[0] < hi, body, (lo, jnp.zeros_like(q_blk)))
    # An empty row gets exactly 0, also through 0 * NaN.
    return jnp.where((lse_blk == jnp.inf)[..., None], 0.0, dq)

  lower, upper, full_lower, full_upper = _table_rows(table)
  xs = (batch_index, _blocks(qp, bq), _blocks(dop, bq), _blocks(lsep, bq), _blocks(deltap, bq),
        _blocks(_pad_seq(q_pos, bq, 0), bq),
        _blocks(_pad_seq(q_seg, bq, PADDING_SEGMENT_ID), bq),
        lower, upper, full_lower, full_upper)
  dq = jax.lax.map(one_query_block, xs, batch_size=_OUTER_BLOCKS_PER_STEP)
  return dq.reshape(b, nq * bq, kh, g, -1)[:, :sq]


def _backward_dkv(cfg, q, k, v, do, lse, delta, q_pos, q_seg, kv_pos, kv_seg, table, bq, bk):
  b, skv, kh, _ = k.shape
  qp, dop = _pad_seq(q, bq, 0), _pad_seq(do, bq, 0)
  lsep, deltap = _pad_seq(lse, bq, jnp.inf), _pad_seq(delta, bq, 0)
  q_pos_p, q_seg_p = _pad_seq(q_pos, bq, 0), _pad_seq(q_seg, bq, PADDING_SEGMENT_ID)
  kp, vp = _pad_seq(k, bk, 0), _pad_seq(v, bk, 0)
  nk = kp.shape[1] // bk
  batch_index = jnp.repeat(jnp.arange(b, dtype=jnp.int32), nk)

  def one_kv_block(args):
    bi, k_blk, v_blk, kv_pos_blk, kv_seg_blk, lo, hi, flo, fhi = args

    def body(carry):
      i, dk, dv = carry
      q_blk, do_blk = _slice_block(qp, bi, i, bq), _slice_block(dop, bi, i, bq)
      lse_t = jnp.moveaxis(_slice_block(lsep, bi, i, bq), 0, 2)[..., None]
      delta_t = jnp.moveaxis(_slice_block(deltap, bi, i, bq), 0, 2)[..., None]
      s, t = _logits(cfg, q_blk, k_blk)
      keep = _block_mask(cfg, (i >= flo) & (i < fhi), _slice_block(q_pos_p, bi, i, bq),
                         _slice_block(q_seg_p, bi, i, bq), kv_pos_blk, kv_seg_blk)
      p = jnp.where(keep, jnp.exp(s - lse_t), 0.0)
      dv = dv + jnp.einsum("kgqt,qkgd->tkd", p, do_blk)
      dp = jnp.einsum("qkgd,tkd->kgqt", do_blk, v_blk)
      ds = p * (dp - delta_t)
      if t is not None:
        ds = ds * (1.0 - t * t)
      dk = dk + jnp.einsum("kgqt,qkgd->tkd", ds, q_blk) * cfg.scale
      return i + 1, dk, dv

    _, dk, dv = jax.lax.while_loop(lambda c: c[0] < hi, body,
                                   (lo, jnp.zeros_like(k_blk), jnp.zeros_like(v_blk)))
    return dk, dv

  lower, upper, full_lower, full_upper = _table_rows(table)
  xs = (batch_index, _blocks(kp, bk), _blocks(vp, bk), _blocks(_pad_seq(kv_pos, bk, 0), bk),
        _blocks(_pad_seq(kv_seg, bk, PADDING_SEGMENT_ID), bk),
        lower, upper, full_lower, full_upper)
  dk, dv = jax.lax.map(one_kv_block, xs, batch_size=_OUTER_BLOCKS_PER_STEP)
  return dk.reshape(b, nk * bk, kh, -1)[:, :skv], dv.reshape(b, nk * bk, kh, -1)[:, :skv]


def _int_zero_cotangent(x):
  return None if x is None else np.zeros(x.shape, dtype=jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask):
  out, _ = _attention_fwd(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask)
  return out


def _attention_fwd(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask):
  p = mask.spec.fwd_params
  out, lse = _forward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask.fwd,
                      p.query_block_size, p.kv_block_size)
  out = out.astype(q.dtype)
  out, lse = saved_residuals(out, lse)
  return out, (q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse)


def _attention_bwd(cfg, res, d_out):
  q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse = res
  if not mask.has_backward:
    raise ValueError("mask has no backward tables: build it with "
                     "create_attention_mask(..., calc_bwd_mask=True) to take gradients")
  p = mask.spec.bwd_params
  bq, bk = p.query_block_size, p.kv_block_size
  f32 = lambda x: x.astype(cfg.compute_dtype)
  # dP and delta must read the same dO values (custom_vjp.as_stored).
  do = as_stored(d_out, cfg.compute_dtype)
  delta = jnp.sum(do * as_stored(out, cfg.compute_dtype), axis=-1)
  args = (cfg, f32(q), f32(k), f32(v), do, lse, delta, q_pos, q_seg, kv_pos, kv_seg)
  dq = _backward_dq(*args, mask.dq, bq, bk)
  dk, dv = _backward_dkv(*args, mask.dkv, bq, bk)
  if cfg.has_sinks:

    kh, g = q.shape[2], q.shape[3]
    p_sink = jnp.exp(f32(sinks).reshape(1, 1, kh, g) - lse)
    dsinks = (-jnp.sum(p_sink * delta, axis=(0, 1))).reshape(-1).astype(sinks.dtype)
  else:
    dsinks = jnp.zeros_like(sinks)
  int_zero = lambda tree: jax.tree.map(_int_zero_cotangent, tree)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks,
          *map(_int_zero_cotangent, (q_pos, q_seg, kv_pos, kv_seg)), int_zero(mask))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _kernel_parts(cfg: _Static, kh: int) -> KernelParts:
  """The forward and backward in the KernelParts convention, in the compute dtype."""

  def split_heads(q):
    b, sq, h, d = q.shape
    return q.reshape(b, sq, kh, h // kh, d)

  def forward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask):
    p = mask.spec.fwd_params
    b, sq, h, _ = q.shape
    sinks = jnp.zeros((h,), cfg.compute_dtype)
    out, lse = _forward(cfg, split_heads(q), k, v, sinks, q_pos, q_seg, kv_pos, kv_seg,
                        mask.fwd, p.query_block_size, p.kv_block_size)
    return out.reshape(b, sq, h, -1), jnp.moveaxis(lse.reshape(b, sq, h), 1, 2)

  def backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse, d_out):
    p = mask.spec.bwd_params
    b, sq, h, _ = q.shape
    f32 = lambda x: x.astype(cfg.compute_dtype)
    do = as_stored(split_heads(d_out), cfg.compute_dtype)
    lse5 = jnp.moveaxis(lse, 1, 2).reshape(b, sq, kh, h // kh).astype(cfg.compute_dtype)
    delta = jnp.sum(do * as_stored(split_heads(out), cfg.compute_dtype), axis=-1)
    args = (cfg, f32(split_heads(q)), f32(k), f32(v), do, lse5, delta, q_pos, q_seg, kv_pos,
            kv_seg)
    dq = _backward_dq(*args, mask.dq, p.query_block_size, p.kv_block_size)
    dk, dv = _backward_dkv(*args, mask.dkv, p.query_block_size, p.kv_block_size)
    return dq.reshape(q.shape), dk, dv

  return KernelParts(forward, backward)


def flash_attention_jax(query, key, value, query_positions, query_segment_ids, kv_positions,
                        kv_segment_ids, mask: AttentionMask, *, scale: float,
                        logits_soft_cap: float | None, sinks: jax.Array | None) -> jax.Array:
  """Blockwise attention over validated inputs; shapes as `kvax_plugin.flash_attention`."""
  b, sq, h, dqk = query.shape
  kh = key.shape[2]
  cfg = _Static(scale=float(scale), soft_cap=None if logits_soft_cap is None
                else float(logits_soft_cap), has_sinks=sinks is not None,
                causal=mask.spec.causal, window=mask.spec.sliding_window,
                compute_dtype=np.dtype(jnp.promote_types(query.dtype, jnp.float32)))
  if capturing_kernel_parts():
    if sinks is not None:
      raise ValueError("kernel parts are built without sinks: pass sinks=None")
    return _kernel_parts(cfg, kh)
  sinks_arr = (jnp.zeros((h,), jnp.float32) if sinks is None else sinks)
  q5 = query.reshape(b, sq, kh, h // kh, dqk)
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  out = _attention(cfg, q5, key, value, sinks_arr, *ints, mask)
  return out.reshape(b, sq, h, -1)
