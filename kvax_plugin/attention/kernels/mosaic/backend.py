"""The Mosaic GPU (Hopper) kernel backend: pads validated inputs (lengths to the table blocks,
head dims to multiples of 64), picks the launch from the shared-memory budget, and wires the
kernels into one differentiable function. Padded kv tokens carry the padding id and padded
query rows an id no kv token has, so the kernels need no bounds checks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention.block_mask import AttentionMask
from kvax_plugin.attention.kernels.capabilities import Capabilities
from kvax_plugin.attention.kernels.custom_vjp import (kernel_attention, sinks_gradient,
                                                     softmax_delta)
from kvax_plugin.attention.kernels.mosaic import backward as bwd_kernels
from kvax_plugin.attention.kernels.mosaic import forward as fwd_kernels
from kvax_plugin.attention.options import MosaicOptions, backend_config
from kvax_plugin.attention.params import PADDING_SEGMENT_ID

SMEM_BUDGET = 227 * 1024
HEAD_DIM_MULTIPLE = 64  # one 128-byte swizzle row of 16-bit elements
DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
# Up to this many padded kv rows the forward grid is persistent (mosaic_forward_grid): its deal
# of query tiles longest first pays where rows are short; on longer rows one CTA per (query
# tile, head) is as fast or faster, causal rows most.
PERSISTENT_MAX_KV = 32768

# 16-bit only; head dims are zero-padded to multiples of 64 inside.
CAPABILITIES = Capabilities(dtypes=("bfloat16", "float16"), min_head_dim=16, max_head_dim=256,
                            head_dim_multiple=16)


def device_supported(device) -> tuple[bool, str]:
  """(ok, reason): wgmma and TMA need compute capability 9.0."""
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
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return False, (f"dtype {jnp.dtype(dtype).name} is not supported by the Mosaic GPU kernels "
                   "(bfloat16 / float16 only: wgmma has no float32 inputs)")
  if max(qk_head_dim, v_head_dim) > MAX_HEAD_DIM:
    return False, (f"head dims ({qk_head_dim}, {v_head_dim}) above {MAX_HEAD_DIM} are not "
                   "supported by the Mosaic GPU kernels")
  return True, ""


# "auto" takes these kernels up to this head dim (above it Triton trains faster,
# docs/performance.md).
AUTO_MAX_HEAD_DIM = 128


def auto_prefers(dtype, qk_head_dim: int, v_head_dim: int, features=()) -> tuple[bool, str]:
  """(ok, reason): whether "auto" picks these kernels: up to AUTO_MAX_HEAD_DIM and for MLA
  (query / key <= 192, value <= 128). `features` changes nothing."""
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
  """SMs of the first GPU (132 when unknown)."""
  try:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
  except RuntimeError:
    gpus = []
  return int(getattr(gpus[0], "core_count", 0) or 132) if gpus else 132


def forward_launch(table_kv: int, dk: int, dv: int, itemsize: int,
                   q_buffers: int = 1) -> tuple[int, int] | None:
  """(kv tile, stages): the largest kv tile, then the deepest ring, that fits with q_buffers Q
  buffers (2: persistent); None if nothing fits."""
  for bk in (128, 64):
    if table_kv % bk:
      continue
    # A third 128-row slot at head dim 128 overshoots shared memory by 120 bytes.
    for stages in (2,):
      if fwd_kernels.smem_bytes(bk, stages, dk, dv, itemsize, q_buffers=q_buffers) <= SMEM_BUDGET:
        return bk, stages
  return None


@dataclasses.dataclass(frozen=True)
class Static:
  scale: float
  soft_cap: float
  has_sinks: bool
  causal: bool
  window: int
  deterministic: bool
  interpret: bool
  options: MosaicOptions = MosaicOptions()  # the tuning options (attention/options.py)


def _pad_axis(x, axis: int, size: int, value):
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


class _Padded:

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


# The forward's overlap threshold where the option is None: every row overlaps (1) only where
# that was timed faster than 16, head dims 128 / 128 without a soft cap, window or sinks; other
# calls up to v head dim 128 overlap rows of 16 blocks or more (docs/tuning-history.md).
EVERY_ROW_HEAD_DIMS = (128, 128)
OVERLAP_BLOCKS = 16


def overlap_min_blocks(option: int | None, dk: int, dv: int, plain: bool) -> int:
  """The forward's FwdConfig.overlap_min_blocks for KernelOptions.mosaic_forward_overlap_blocks
  `option` at padded head dims dk / dv; plain: no soft cap, window or sinks. Above v head dim
  128 the overlap's registers (O, S, P twice) do not fit: 0, the ping-pong."""
  if dv > 128:
    return 0
  if option is not None:
    return option
  return 1 if (dk, dv) == EVERY_ROW_HEAD_DIMS and plain else OVERLAP_BLOCKS


def _forward(cfg: Static, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask):
  """out [B, Sq, H, Dv] (q.dtype), lse [B, H, Sq] float32 (+inf: nothing attended)."""
  p = _Padded(mask, q, k, v, q_pos, q_seg, kv_pos, kv_seg)
  spec = mask.spec
  dims = (spec.fwd_params.kv_block_size, p.q.shape[3], p.v.shape[3], jnp.dtype(q.dtype).itemsize)
  grid = cfg.options.forward_grid
  persistent = grid == "persistent" or (grid == "auto" and p.k.shape[1] <= PERSISTENT_MAX_KV)
  # Persistent needs a second Q buffer: where it does not fit (head dim 256), per-tile; an
  # explicit request is refused.
  launch = forward_launch(*dims, q_buffers=2) if persistent else None
  per_tile = forward_launch(*dims)
  if (grid == "auto" and launch is not None and per_tile is not None
      and launch[0] < per_tile[0]):
    # Not when the second Q buffer costs the kv tile (MLA 192 / 128).
    launch = None
  if launch is None and grid == "persistent":
    raise ValueError(f"MosaicOptions.forward_grid / KernelOptions.mosaic_forward_grid="
                     f"'persistent': head dims "
                     f"({p.q.shape[3]}, {p.v.shape[3]}) do not fit the persistent forward's "
                     "shared memory; use 'auto' or 'per_tile'")
  if launch is not None:
    bk, stages = launch
    # One CTA per SM (the interpreter: 3, so each takes several items).
    num_ctas = 3 if cfg.interpret else _sm_count()
  elif per_tile is not None:
    bk, stages = per_tile
    num_ctas = 0
  else:
    raise ValueError(f"head dims ({p.q.shape[3]}, {p.v.shape[3]}) do not fit the Mosaic GPU "
                     "forward kernel's shared memory")
  fcfg = fwd_kernels.FwdConfig(
      block_kv=bk, stages=stages, num_ctas=num_ctas, table_q=spec.fwd_params.query_block_size,
      table_kv=spec.fwd_params.kv_block_size, scale=cfg.scale, soft_cap=cfg.soft_cap,
      has_sinks=cfg.has_sinks, causal=cfg.causal, window=cfg.window, interpret=cfg.interpret,
      overlap_min_blocks=overlap_min_blocks(
          cfg.options.forward_overlap_blocks, p.q.shape[3], p.v.shape[3],
          plain=not (cfg.soft_cap or cfg.window or cfg.has_sinks)),
      consumer_registers=cfg.options.forward_registers)
  out, lse = fwd_kernels.forward_call(fcfg, p.q, p.k, p.v, p.q_pos, p.q_seg, p.kv_pos, p.kv_seg,
                                      sinks, *mask.fwd)
  return p.unpad_q(out, p.dv), lse[:, :, :p.sq]


def _backward(cfg: Static, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask,
              out, lse, d_out):
  d_out = d_out.astype(q.dtype)
  delta = softmax_delta(d_out, out)
  p = _Padded(mask, q, k, v, q_pos, q_seg, kv_pos, kv_seg)
  d_out_p = _pad_axis(_pad_axis(d_out, 1, p.q.shape[1], 0), 3, p.v.shape[3], 0)

  lse_p = _pad_axis(lse, 2, p.q.shape[1], jnp.inf)
  delta_p = _pad_axis(delta, 2, p.q.shape[1], 0.0)
  spec = mask.spec
  opts = cfg.options
  bcfg = bwd_kernels.BwdConfig(
      table_q=spec.bwd_params.query_block_size, table_kv=spec.bwd_params.kv_block_size,
      scale=cfg.scale, soft_cap=cfg.soft_cap, causal=cfg.causal, window=cfg.window,
      with_dq=not cfg.deterministic, interpret=cfg.interpret,
      paired=opts.paired_products, consumer_regs=opts.backward_registers,
      dq_after_dkv=opts.dq_after_dkv, ids_tma=opts.backward_id_rings)
  dq, dk, dv = bwd_kernels.backward_call(
      bcfg, p.q, p.k, p.v, d_out_p, lse_p, delta_p, p.q_pos, p.q_seg, p.kv_pos, p.kv_seg,
      mask.dkv, mask.dq)
  dq = p.unpad_q(dq, p.dk)
  if dq.dtype == jnp.float32:
    # Rows with nothing to attend get exactly 0 (the dq kernel does this itself).
    dq = jnp.where((lse == jnp.inf).transpose(0, 2, 1)[..., None], 0.0, dq)
  dq = dq.astype(q.dtype)
  dk = p.unpad_kv(dk, p.dk).astype(k.dtype)
  dv = p.unpad_kv(dv, p.dv).astype(v.dtype)
  dsinks = sinks_gradient(sinks, lse, delta) if cfg.has_sinks else jnp.zeros_like(sinks)
  return dq, dk, dv, dsinks


_attention = kernel_attention(_forward, _backward)


def flash_attention_mosaic(query, key, value, query_positions, query_segment_ids, kv_positions,
                           kv_segment_ids, mask: AttentionMask, *, scale: float,
                           logits_soft_cap: float | None, sinks: jax.Array | None,
                           deterministic_backward: bool | None = True,
                           kernel_options: MosaicOptions | None = None,
                           interpret: bool = False) -> jax.Array:
  """Attention over validated inputs with the Mosaic GPU kernels (Hopper; the CPU interpreter
  with interpret=True). Arguments and result as flash_attention (bf16 / fp16, mask blocks the
  tiles divide). deterministic_backward True or None (default): dq from its own kernel, bitwise
  reproducible, and faster on an H200; False: dq reduce-added in float32 by the dk/dv kernel.
  kernel_options: MosaicOptions (or a KernelOptions; None: the defaults).
  """
  kernel_options = backend_config(kernel_options, "mosaic")
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
               interpret=bool(interpret), options=kernel_options)
  sinks_arr = jnp.zeros((h,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  out = _attention(cfg, query, key, value, sinks_arr, *ints, mask)
  return out
