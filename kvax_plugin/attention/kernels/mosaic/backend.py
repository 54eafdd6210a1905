"""The Mosaic GPU (Hopper) kernel backend: padding, launch choices and the custom VJP.

Inputs are validated by the public op; this module pads them to what the kernels need
(sequence lengths to the table blocks, head dims to multiples of 64), picks the launch
(kv tile, pipeline depth) from the shared-memory budget, and wires forward and backward kernels
into one differentiable function. Padded kv tokens carry the padding segment id and padded query
rows a segment id no kv token has, so the kernels need no bounds checks.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention.block_mask import AttentionMask
from kvax_plugin.attention.kernels.capabilities import Capabilities
from kvax_plugin.attention.kernels.custom_vjp import kernel_attention, sinks_gradient
from kvax_plugin.attention.kernels.mosaic import backward as bwd_kernels
from kvax_plugin.attention.kernels.mosaic import forward as fwd_kernels
from kvax_plugin.attention.params import PADDING_SEGMENT_ID

SMEM_BUDGET = 227 * 1024  # sm90: 227 KiB of shared memory per CTA
HEAD_DIM_MULTIPLE = 64  # one 128-byte swizzle row of 16-bit elements (smaller dims are padded)
DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
# The persistent forward is the default up to this many (padded) kv rows; above, one CTA per
# (batch, query tile, head) (Static.fwd_persistent: measured 13% faster at 128k causal).
PERSISTENT_MAX_KV = 65536

# wgmma takes 16-bit inputs here (no float32: auto routes float32 to Triton / JAX); head dims
# are zero-padded to multiples of 64 inside, so any multiple of 16 up to 256 runs.
CAPABILITIES = Capabilities(dtypes=("bfloat16", "float16"), min_head_dim=16, max_head_dim=256,
                            head_dim_multiple=16)


def device_supported(device) -> tuple[bool, str]:
  """(ok, reason): Mosaic GPU kernels use wgmma and TMA, so they need compute capability 9.0."""
  if device is None or device.platform != "gpu":
    return False, "no GPU visible to JAX"
  cc = getattr(device, "compute_capability", None)
  if cc is None:
    return False, f"unknown compute capability of {device.device_kind}"
  if str(cc).split(".")[0] != "9":
    return False, (f"{device.device_kind} has compute capability {cc}; the Mosaic GPU kernels "
                   "need Hopper (9.0: H100 / H200)")
  return True, ""


def supports_inputs(dtype, qk_head_dim: int, v_head_dim: int) -> tuple[bool, str]:
  """(ok, reason) for inputs of this dtype and head dims."""
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return False, (f"dtype {jnp.dtype(dtype).name} is not supported by the Mosaic GPU kernels "
                   "(bfloat16 / float16 only: wgmma has no float32 inputs)")
  if max(qk_head_dim, v_head_dim) > MAX_HEAD_DIM:
    return False, (f"head dims ({qk_head_dim}, {v_head_dim}) above {MAX_HEAD_DIM} are not "
                   "supported by the Mosaic GPU kernels")
  return True, ""


# "auto" takes these kernels up to this head dim. Above it the dk/dv kernel runs a one-stage
# ring and the dq kernel 64-row kv steps, and the Triton kernels train faster: 16k, one H200,
# head dim 256, forward+backward causal 112.2 ms (Mosaic, session 7) vs 53.8 (Triton, session
# 2), documents 22.4 vs 10.8, with cuDNN within 5% in both runs (35.2 / 36.9 causal);
# benchmarks/results/mosaic/s7_bench_16k_dims.*, benchmarks/results/bench_16k_dims.*.
AUTO_MAX_HEAD_DIM = 128


def auto_prefers(dtype, qk_head_dim: int, v_head_dim: int) -> tuple[bool, str]:
  """(ok, reason): whether backend="auto" should pick these kernels. They run up to head dim
  256; auto takes them up to AUTO_MAX_HEAD_DIM and for MLA (query / key <= 192, value <= 128:
  16k causal forward+backward 33.7 vs Triton 44.2 ms, documents 7.9 vs 8.3, same run on an
  H200, before session 10's MLA changes took Mosaic to 25.2 / 6.0). At head dim 256 the Triton
  kernels were measured ~2x faster forward+backward; dk = dv = 192 is not measured."""
  if max(qk_head_dim, v_head_dim) <= AUTO_MAX_HEAD_DIM:
    return True, ""
  if qk_head_dim <= 192 and v_head_dim <= AUTO_MAX_HEAD_DIM:
    return True, ""
  return False, (f"head dims ({qk_head_dim}, {v_head_dim}): above {AUTO_MAX_HEAD_DIM} (other than "
                 f"MLA's 192 / 128) the Triton kernels train faster or are not measured against "
                 'these (H200); pass backend="mosaic" to use these anyway')


def supports_mask(mask: AttentionMask) -> tuple[bool, str]:
  """(ok, reason): the kernels' tiles must divide the mask's table blocks."""
  fq, fk = mask.spec.fwd_params.query_block_size, mask.spec.fwd_params.kv_block_size
  if fq % fwd_kernels.TILE_Q or fk % 64:
    return False, (f"the mask's forward blocks {fq}x{fk} must be multiples of "
                   f"{fwd_kernels.TILE_Q}x64 for the Mosaic GPU kernels (build the mask with "
                   "the default FlashAttentionParamsConfig or larger blocks)")
  if mask.spec.bwd_params is not None:
    bq, bk = mask.spec.bwd_params.query_block_size, mask.spec.bwd_params.kv_block_size
    if bq % bwd_kernels.TILE_Q or bk % bwd_kernels.TILE_KV:
      return False, (f"the mask's backward blocks {bq}x{bk} must be multiples of "
                     f"{bwd_kernels.TILE_Q}x{bwd_kernels.TILE_KV} for the Mosaic GPU kernels")
  return True, ""


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _sm_count() -> int:
  """Streaming multiprocessors of the first GPU (132 on an H100 / H200 SXM when unknown)."""
  try:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
  except RuntimeError:
    gpus = []
  return int(getattr(gpus[0], "core_count", 0) or 132) if gpus else 132


def forward_launch(table_kv: int, dk: int, dv: int, itemsize: int,
                   q_buffers: int = 1) -> tuple[int, int] | None:
  """(kv tile, stages): the largest kv tile, then the deepest ring, that fits shared memory with
  q_buffers Q buffers (2: the persistent kernel); None if nothing fits."""
  for bk in (128, 64):
    if table_kv % bk:
      continue
    # Two slots: a third 128-row slot at head dim 128 overshoots shared memory by the barriers'
    # 120 bytes (232568 > 232448, lowered for CUDA).
    for stages in (2,):
      if fwd_kernels.smem_bytes(bk, stages, dk, dv, itemsize, q_buffers=q_buffers) <= SMEM_BUDGET:
        return bk, stages
  return None


@dataclasses.dataclass(frozen=True)
class Static:
  scale: float
  soft_cap: float  # 0: none
  has_sinks: bool
  causal: bool
  window: int  # 0: none
  deterministic: bool
  interpret: bool
  paired: bool = True  # benchmarking hook: KVAX_MOSAIC_UNPAIRED=1 awaits every product alone
  dq_split: bool = True  # benchmarking hook: KVAX_MOSAIC_DQ_WHOLE=1 (see BwdConfig.dq_split)
  consumer_regs: int = 232  # benchmarking hook: KVAX_MOSAIC_BWD_REGS (BwdConfig.consumer_regs)
  dq_kv_tile: int = 0  # benchmarking hook: KVAX_MOSAIC_DQ_KV_TILE (BwdConfig.dq_kv_tile)
  fwd_opt_barrier: bool = False  # benchmarking hook: KVAX_MOSAIC_FWD_OPT_BARRIER=1 (FwdConfig)
  # The next K awaited behind the P V product: on by default (64k causal forward on an H200,
  # session 7: 57.3 vs 62.5 ms interleaved, 57.9 vs 60.0 alone); KVAX_MOSAIC_FWD_PREWAIT=0 off.
  fwd_prewait_k: bool = True
  fwd_ids_tma: bool = False  # benchmarking hook: KVAX_MOSAIC_FWD_IDS_TMA=1 (FwdConfig.ids_tma)
  bwd_ids_tma: bool = False  # benchmarking hook: KVAX_MOSAIC_BWD_IDS_TMA=1 (BwdConfig.ids_tma)
  lpt: bool = False  # benchmarking hook: KVAX_MOSAIC_LPT=1, longest-first launch order (all kernels)
  # CTAs exit once their output stores have read shared memory (FwdConfig.exit_after_read): on
  # by default since session 9 (16k documents forward 0.829 vs 0.850 ms interleaved, 0.799 vs
  # 0.818 alone; nothing else moved beyond the noise); KVAX_MOSAIC_EXIT_AFTER_READ=0 turns it off.
  exit_after_read: bool = True
  # A persistent forward kernel with one CTA per SM (FwdConfig.num_ctas; in the interpreter 3
  # CTAs, so each takes several work items) or one CTA per (batch, query tile, head).
  # "auto" (the default): persistent up to PERSISTENT_MAX_KV padded kv rows, per-tile above.
  # Measured on an H200 (interleaved, benchmarks/NOTES.md sessions 9-10), persistent vs
  # per-tile: documents forward 16k 0.778 vs 0.835 ms, 64k 9.64 vs 9.83, 128k 28.9 vs 29.7;
  # causal 16k 3.80 vs 3.81, 64k within the noise (59.6 vs 63.1 interleaved, 65.0 vs 57.8
  # alone), 128k 268.4 vs 236.6 (the per-tile grid 13% faster). KVAX_MOSAIC_FWD_PERSISTENT=1
  # / =0 forces one or the other.
  fwd_persistent: str = "auto"
  dq_after_dkv: bool = False  # benchmarking hook: KVAX_MOSAIC_DQ_AFTER_DKV=1 (BwdConfig)
  # The deterministic dk/dv step's products in two pairs (BwdConfig.dkv_early_dp): on by
  # default since session 12 (H200, interleaved, fwd+bwd: 16k causal 16.05 vs 16.33 ms, docs
  # 3.78 vs 3.85; 64k causal 257.6 vs 262.4, docs 41.4 vs 42.7; faster in every row, alone too);
  # KVAX_MOSAIC_DKV_EARLY_DP=0 turns it off.
  dkv_early_dp: bool = True
  # lse / delta folded into the dk/dv products' accumulators (BwdConfig.dkv_fold, with the
  # numbers): on by default since session 15; KVAX_MOSAIC_DKV_FOLD=0 turns it off.
  dkv_fold: bool = True
  # The backward kernels' launch order over (head, tile) pairs, longest first (BwdConfig.
  # head_lpt): on by default since session 15 (H100, fwd+bwd interleaved: 16k documents 3.27 vs
  # 3.75 ms, 64k documents 40.3 vs 41.9; causal within the noise, 16k 15.82 vs 15.90, 64k 261.5
  # vs 259.5); KVAX_MOSAIC_HEAD_LPT=0 turns it off, and KVAX_MOSAIC_LPT=1 (per-head order in
  # every kernel) replaces it.
  head_lpt: bool = True
  # The persistent forward deals its (tile, head) items like a snake draft: tiles in
  # longest-first order (forward.longest_first; FwdConfig.lpt), CTA c taking item c of every even
  # round of G items and item G - 1 - c of every odd one (FwdConfig.zigzag). The round robin
  # before it gave the CTAs that start each round the longest item of every round, so a few
  # long tiles ran alone at the end: benchmarks/launch_order_model.py put the 16k documents
  # forward's tail at 6.7% with it and 1.2% with the snake deal. On by default since session 16
  # (H100, interleaved: 16k documents forward 0.736 vs 0.789 ms, faster in every round, alone
  # 0.702 vs 0.736; tokamax Mosaic 0.782; 64k documents 9.39 vs 9.53; causal within the noise,
  # 16k 3.68 vs 3.70). The per-tile grid (above PERSISTENT_MAX_KV) keeps its order.
  # KVAX_MOSAIC_FWD_SNAKE=0 gives the round robin.
  fwd_snake: bool = True


def _pad_axis(x, axis: int, size: int, value):
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


class _Padded:
  """Inputs padded for the kernels (sequence to table blocks, head dims to 64)."""

  def __init__(self, mask: AttentionMask, q, k, v, q_pos, q_seg, kv_pos, kv_seg):
    spec = mask.spec
    blocks_q = [spec.fwd_params.query_block_size]
    blocks_kv = [spec.fwd_params.kv_block_size]
    if spec.bwd_params is not None:
      blocks_q.append(spec.bwd_params.query_block_size)
      blocks_kv.append(spec.bwd_params.kv_block_size)
    self.sq, self.skv = q.shape[1], k.shape[1]
    self.dk, self.dv = q.shape[3], v.shape[3]
    sq_p = _round_up(self.sq, int(np.lcm.reduce(blocks_q)))
    skv_p = _round_up(self.skv, int(np.lcm.reduce(blocks_kv)))
    dk_p = _round_up(self.dk, HEAD_DIM_MULTIPLE)
    dv_p = _round_up(self.dv, HEAD_DIM_MULTIPLE)
    self.q = _pad_axis(_pad_axis(q, 1, sq_p, 0), 3, dk_p, 0)
    self.k = _pad_axis(_pad_axis(k, 1, skv_p, 0), 3, dk_p, 0)
    self.v = _pad_axis(_pad_axis(v, 1, skv_p, 0), 3, dv_p, 0)
    self.q_pos = _pad_axis(q_pos, 1, sq_p, 0)
    q_seg = jnp.where(q_seg == PADDING_SEGMENT_ID, fwd_kernels.NO_SEGMENT, q_seg)
    self.q_seg = _pad_axis(q_seg, 1, sq_p, fwd_kernels.NO_SEGMENT)
    self.kv_pos = _pad_axis(kv_pos, 1, skv_p, 0)
    self.kv_seg = _pad_axis(kv_seg, 1, skv_p, PADDING_SEGMENT_ID)

  def unpad_q(self, x, d):
    return x[:, :self.sq, :, :d]

  def unpad_kv(self, x, d):
    return x[:, :self.skv, :, :d]


def _forward(cfg: Static, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask):
  """out [B, Sq, H, Dv] (q.dtype), lse [B, H, Sq] float32 natural-log (+inf: nothing attended)."""
  p = _Padded(mask, q, k, v, q_pos, q_seg, kv_pos, kv_seg)
  spec = mask.spec
  dims = (spec.fwd_params.kv_block_size, p.q.shape[3], p.v.shape[3], jnp.dtype(q.dtype).itemsize)
  persistent = (cfg.fwd_persistent == "1" or
                (cfg.fwd_persistent == "auto" and p.k.shape[1] <= PERSISTENT_MAX_KV))
  # The persistent kernel needs a second Q buffer (and O apart from Q when Dv != Dk): where that
  # does not fit (head dim 256), the per-tile grid; an explicit request for it is refused.
  launch = forward_launch(*dims, q_buffers=2) if persistent else None
  per_tile = forward_launch(*dims)
  if (cfg.fwd_persistent == "auto" and launch is not None and per_tile is not None
      and launch[0] < per_tile[0]):
    # Not when the second Q buffer costs the kv tile (MLA 192 / 128: 64 rows persistent, 128
    # per-tile): 64k causal forward 88.4 vs 70.9 ms, 16k documents 1.127 vs 0.940 (session 10).
    launch = None
  if launch is None and cfg.fwd_persistent == "1":
    raise ValueError(f"KVAX_MOSAIC_FWD_PERSISTENT=1: head dims ({p.q.shape[3]}, "
                     f"{p.v.shape[3]}) do not fit the persistent forward's shared memory; "
                     "unset it (auto) or set 0")
  if launch is not None:
    bk, stages = launch
    # One CTA per SM (the interpreter: 3, so that each CTA takes several work items).
    num_ctas = 3 if cfg.interpret else _sm_count()
  elif per_tile is not None:
    bk, stages = per_tile
    num_ctas = 0
  else:
    raise ValueError(f"head dims ({p.q.shape[3]}, {p.v.shape[3]}) do not fit the Mosaic GPU "
                     "forward kernel's shared memory")
  snake = cfg.fwd_snake and num_ctas > 0  # Static.fwd_snake: the persistent kernel only
  fcfg = fwd_kernels.FwdConfig(
      block_kv=bk, stages=stages, num_ctas=num_ctas, table_q=spec.fwd_params.query_block_size,
      table_kv=spec.fwd_params.kv_block_size, scale=cfg.scale, soft_cap=cfg.soft_cap,
      has_sinks=cfg.has_sinks, causal=cfg.causal, window=cfg.window, interpret=cfg.interpret,
      opt_barrier=cfg.fwd_opt_barrier, prewait_k=cfg.fwd_prewait_k, ids_tma=cfg.fwd_ids_tma,
      lpt=cfg.lpt or snake, exit_after_read=cfg.exit_after_read, zigzag=snake)
  out, lse = fwd_kernels.forward_call(fcfg, p.q, p.k, p.v, p.q_pos, p.q_seg, p.kv_pos, p.kv_seg,
                                      sinks, *mask.fwd)
  return p.unpad_q(out, p.dv), lse[:, :, :p.sq]


def _backward(cfg: Static, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask,
              out, lse, d_out):
  d_out = d_out.astype(q.dtype)
  # delta = rowsum(dO * O): what softmax's Jacobian subtracts (FlashAttention-2, eq. in sec. 3.1)
  delta = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
  p = _Padded(mask, q, k, v, q_pos, q_seg, kv_pos, kv_seg)
  d_out_p = _pad_axis(_pad_axis(d_out, 1, p.q.shape[1], 0), 3, p.v.shape[3], 0)
  # Padded query rows: lse +inf makes their probabilities 0 whatever their logits.
  lse_p = _pad_axis(lse, 2, p.q.shape[1], jnp.inf)
  delta_p = _pad_axis(delta, 2, p.q.shape[1], 0.0)
  spec = mask.spec
  bcfg = bwd_kernels.BwdConfig(
      table_q=spec.bwd_params.query_block_size, table_kv=spec.bwd_params.kv_block_size,
      scale=cfg.scale, soft_cap=cfg.soft_cap, causal=cfg.causal, window=cfg.window,
      with_dq=not cfg.deterministic, interpret=cfg.interpret, paired=cfg.paired,
      dq_split=cfg.dq_split, consumer_regs=cfg.consumer_regs, dq_kv_tile=cfg.dq_kv_tile,
      lpt=cfg.lpt,
      exit_after_read=cfg.exit_after_read,
      dq_after_dkv=cfg.dq_after_dkv, ids_tma=cfg.bwd_ids_tma, dkv_early_dp=cfg.dkv_early_dp,
      dkv_fold=cfg.dkv_fold, head_lpt=cfg.head_lpt)
  dq, dk, dv = bwd_kernels.backward_call(
      bcfg, p.q, p.k, p.v, d_out_p, lse_p, delta_p, p.q_pos, p.q_seg, p.kv_pos, p.kv_seg,
      mask.dkv, mask.dq)
  dq = p.unpad_q(dq, p.dk)
  if dq.dtype == jnp.float32:
    # The fused path's float32 sum: rows with nothing to attend get exactly 0 (a non-finite
    # key may reach them through 0 * NaN in dS K); the dq kernel does this itself.
    dq = jnp.where((lse == jnp.inf).transpose(0, 2, 1)[..., None], 0.0, dq)
  dq = dq.astype(q.dtype)
  dk = p.unpad_kv(dk, p.dk).astype(k.dtype)
  dv = p.unpad_kv(dv, p.dv).astype(v.dtype)
  dsinks = sinks_gradient(sinks, lse, delta) if cfg.has_sinks else jnp.zeros_like(sinks)
  return dq, dk, dv, dsinks


_attention = kernel_attention(_forward, _backward)


# Benchmarking hooks that were removed: measured slower or no faster (sessions 6-18, on an
# H200 unless said), or folded into a default (session 16); the numbers are in benchmarks/NOTES.md. Setting
# one is an error, not a silent no-op.
_SLOWER = "measured slower: "
_NO_GAIN = "measured no faster: "
REMOVED_HOOKS = {
    "KVAX_MOSAIC_GROUPED_ORDER": (_NO_GAIN + "launch orders grouped by kv head from 64k streamed "
                                  "rows (session 18, H100, Nsight at locked base clocks, 64k "
                                  "causal: DRAM reads forward 49.5 -> 2.9 GB, dq 17.8 -> 3.4, "
                                  "dk/dv 22.7 -> 6.2, yet 59.97 -> 59.11 / 78.93 -> 78.82 / "
                                  "115.03 -> 115.94 ms; documents 2-4% slower per kernel)"),
    "KVAX_MOSAIC_FWD_LATE_STORE_WAIT": (_NO_GAIN + "the persistent forward awaiting an item's "
                                        "output stores at its next item's start (session 17, "
                                        "H100: 16k documents forward 0.765 vs 0.765 ms "
                                        "interleaved, 64k 9.31 vs 9.25, alone 9.61 vs 9.54)"),
    "KVAX_MOSAIC_DQ_WG": (_SLOWER + "the fused backward's dQ = dS K in a fourth warpgroup "
                          "(session 17, H100, 16k causal fwd+bwd: 42.5 ms at 216 / 56 "
                          "registers, where ptxas ignores every setmaxnreg, 20.4 at 208 / 72, "
                          "where wgmma is serialized; deterministic 14.9-15.8, fused 19.2-19.4: "
                          "the consumers need 224 and the dq warpgroup 64, 536 > 512)"),
    "KVAX_MOSAIC_FWD_HALF_SKIP": (_SLOWER + "masked forward steps on one 64-row half of the kv "
                                  "block (session 17, H100: 16k documents forward 0.961 vs 0.773 "
                                  "ms interleaved, 0.919 vs 0.742 alone; 64k 10.41 vs 9.52)"),
    "KVAX_MOSAIC_DQ_HALF_SKIP": (_SLOWER + "the dq kernel's masked steps on one 64-row kv half "
                                 "(session 17, H100: 16k documents fwd+bwd 3.525 vs 3.482 ms "
                                 "with the forward's hook alone, 3.395 with neither)"),
    "KVAX_MOSAIC_FUSED_PAIRS": (_SLOWER + "the fused backward's step as two product groups "
                                "(session 15, H100: 16k fwd+bwd 19.22 vs 16.79 ms deterministic, "
                                "16.92 at 240 registers; 64k 289.5 vs 251.3)"),
    "KVAX_MOSAIC_DKV_PIPELINE": (_SLOWER + "software-pipelined dk/dv step (session 13: 16k "
                                 "fwd+bwd 18.34 vs 15.52 ms, docs 4.30 vs 3.70)"),
    "KVAX_MOSAIC_DQ_PIPELINE": (_SLOWER + "software-pipelined dq step (session 13: 16k fwd+bwd "
                                "16.89 vs 15.52 ms, docs 3.97 vs 3.70)"),
    "KVAX_MOSAIC_BWD_SMALL": (_SLOWER + "small-CTA backward (session 12: 16k fwd+bwd 18.2 vs "
                              "15.7 ms)"),
    "KVAX_MOSAIC_DQ_ATOMIC": _SLOWER + "fused dq by register atomics (session 12: 26.7 vs 18.0 ms)",
    "KVAX_MOSAIC_DKV_TILE_Q": _SLOWER + "128-query dk/dv steps (session 9: 64k 335.8 vs 249.2 ms)",
    "KVAX_MOSAIC_DKV_P16": _SLOWER + "dS^T from the 16-bit P^T (session 9: 252.8 vs 245.4 ms)",
    "KVAX_MOSAIC_DKV_K_REGS": _SLOWER + "K in registers (session 9: 280.8 vs 245.4 ms)",
    "KVAX_MOSAIC_BWD_PREWAIT": (_SLOWER + "backward next-slot waits (session 7: dk/dv 122.5 vs "
                                "112.2 ms)"),
    "KVAX_MOSAIC_DKV_STAGES": _SLOWER + "a 4-deep dk/dv ring (session 7: no change)",
    "KVAX_MOSAIC_DQ_BUFFERS": (_SLOWER + "two fused dq buffers (session 6: fused 258.1 vs "
                               "deterministic 245.8 ms)"),
    "KVAX_MOSAIC_FWD_ZIGZAG": ("part of the snake deal, the persistent forward's default since "
                               "session 16 (alone, without the longest-first order, it measured "
                               "slower in session 10); KVAX_MOSAIC_FWD_SNAKE=0 gives the round "
                               "robin"),
    "KVAX_MOSAIC_FWD_LPT": ("part of the snake deal, the persistent forward's default since "
                            "session 16; KVAX_MOSAIC_FWD_SNAKE=0 gives the round robin"),
}


def _check_removed_hooks() -> None:
  for name, what in REMOVED_HOOKS.items():
    if os.environ.get(name):
      raise ValueError(f"environment variable {name}: this benchmarking hook was removed "
                       f"({what}; benchmarks/NOTES.md); unset it")


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
  """A benchmarking hook with a few allowed values (the first: unset), or an error naming it."""
  raw = os.environ.get(name, "") or choices[0]
  if raw not in choices:
    raise ValueError(f"environment variable {name}={raw!r}: expected one of {choices}")
  return raw


def _env_int(name: str, default: int) -> int:
  """An integer benchmarking hook from the environment, with an error that names it."""
  raw = os.environ.get(name, "")
  if not raw:
    return default
  try:
    return int(raw)
  except ValueError:
    raise ValueError(f"environment variable {name}={raw!r}: expected an integer") from None


def flash_attention_mosaic(query, key, value, query_positions, query_segment_ids, kv_positions,
                           kv_segment_ids, mask: AttentionMask, *, scale: float,
                           logits_soft_cap: float | None, sinks: jax.Array | None,
                           deterministic_backward: bool | None = True,
                           interpret: bool = False) -> jax.Array:
  """Attention over validated inputs with the Mosaic GPU kernels (Hopper; or the CPU
  interpreter with interpret=True, for tests).

  query [B, Sq, H, Dqk], key [B, Skv, K, Dqk], value [B, Skv, K, Dv] (bf16 / fp16), positions /
  segment ids int32 [B, S], mask from create_attention_mask with blocks the kernels' tiles divide
  (the defaults do). Returns [B, Sq, H, Dv] in query.dtype; differentiable in query, key, value
  and sinks. deterministic_backward True (default; None, the public op's "backend's own", means
  the same): dq from its own kernel (7 matrix products per tile pair, bitwise reproducible);
  False: dq bulk-reduce-added into a float32 buffer by the dk/dv kernel (5 products,
  order-dependent rounding). Measured on an H200 the deterministic
  way is also the faster (64k causal forward+backward 245 vs 268 ms; benchmarks/NOTES.md), so
  it is the default.
  """
  _check_removed_hooks()
  ok, why = supports_inputs(query.dtype, query.shape[3], value.shape[3])
  if not ok:
    raise ValueError(f"query: {why}")
  ok, why = supports_mask(mask)
  if not ok:
    raise ValueError(f"mask: {why}")
  h = query.shape[2]
  cfg = Static(scale=float(scale),
               soft_cap=0.0 if logits_soft_cap is None else float(logits_soft_cap),
               has_sinks=sinks is not None, causal=bool(mask.spec.causal),
               window=0 if mask.spec.sliding_window is None else int(mask.spec.sliding_window),
               deterministic=deterministic_backward is None or bool(deterministic_backward),
               interpret=bool(interpret),
               paired=os.environ.get("KVAX_MOSAIC_UNPAIRED", "") != "1",
               dq_split=os.environ.get("KVAX_MOSAIC_DQ_WHOLE", "") != "1",
               consumer_regs=_env_int("KVAX_MOSAIC_BWD_REGS", 232),
               dq_kv_tile=_env_int("KVAX_MOSAIC_DQ_KV_TILE", 0),
               fwd_opt_barrier=os.environ.get("KVAX_MOSAIC_FWD_OPT_BARRIER", "") == "1",
               fwd_prewait_k=os.environ.get("KVAX_MOSAIC_FWD_PREWAIT", "") != "0",
               fwd_ids_tma=os.environ.get("KVAX_MOSAIC_FWD_IDS_TMA", "") == "1",
               bwd_ids_tma=os.environ.get("KVAX_MOSAIC_BWD_IDS_TMA", "") == "1",
               lpt=os.environ.get("KVAX_MOSAIC_LPT", "") == "1",
               exit_after_read=os.environ.get("KVAX_MOSAIC_EXIT_AFTER_READ", "") != "0",
               fwd_persistent=_env_choice("KVAX_MOSAIC_FWD_PERSISTENT", ("auto", "1", "0")),
               dq_after_dkv=os.environ.get("KVAX_MOSAIC_DQ_AFTER_DKV", "") == "1",
               dkv_early_dp=_env_choice("KVAX_MOSAIC_DKV_EARLY_DP", ("1", "0")) == "1",
               dkv_fold=_env_choice("KVAX_MOSAIC_DKV_FOLD", ("1", "0")) == "1",
               fwd_snake=_env_choice("KVAX_MOSAIC_FWD_SNAKE", ("1", "0")) == "1",
               head_lpt=(_env_choice("KVAX_MOSAIC_HEAD_LPT", ("1", "0")) == "1"
                         and os.environ.get("KVAX_MOSAIC_LPT", "") != "1"))
  sinks_arr = jnp.zeros((h,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  out = _attention(cfg, query, key, value, sinks_arr, *ints, mask)
  return out
