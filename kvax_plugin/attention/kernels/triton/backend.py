"""backend="triton": this package's FlashAttention-2 kernels through jax-triton.

Forward: one launch writes the output and lse. Backward (custom VJP): delta, then dq over the
`dq` table and dk / dv over the `dkv` table; no atomics, so bitwise reproducible. A mask built
with the library defaults gets the tuned per-GPU tiles (`_TUNED`), one built with explicit
params runs exactly those. Triton and jax-triton are imported lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from kvax_plugin.attention.block_mask import AttentionMask, BlockTable
from kvax_plugin.attention.kernels.capabilities import Capabilities
from kvax_plugin.attention.kernels.custom_vjp import kernel_attention, sinks_gradient
from kvax_plugin.attention.kernels.triton import compat
from kvax_plugin.attention.options import (KernelOptions, TritonOptions, backend_config,
                                           triton_tile_parts)
from kvax_plugin.attention.params import (DEFAULT_BWD_PARAMS, DEFAULT_FWD_PARAMS,
                                          FlashAttentionParamsConfig)

# float32 needs float32-accurate products, impractical above head dim 128 on Hopper
# (docs/performance.md); bf16 / fp16 run at every head dim.
FLOAT32_MAX_HEAD_DIM = 128

CAPABILITIES = Capabilities(float32_max_head_dim=FLOAT32_MAX_HEAD_DIM)


def _compute_capability(device) -> tuple[int, int] | None:
  cc = getattr(device, "compute_capability", None)
  if cc is None:
    return None
  try:
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)
  except ValueError:
    return None


def device_supported(device) -> tuple[bool, str]:
  """(supported, reason) for running the Triton kernels on `device` (a jax.Device)."""
  if getattr(device, "platform", None) != "gpu":
    return False, f"device {device} is not a GPU"
  kind = getattr(device, "device_kind", "unknown GPU")
  cc = _compute_capability(device)
  if cc is None:
    return False, (f"{kind}: no CUDA compute capability reported (ROCm and other GPUs are not "
                   "supported by these kernels)")
  if cc < (8, 0):
    return False, f"{kind} has compute capability {cc[0]}.{cc[1]}; the kernels need sm80 or newer"
  try:
    compat.check()
    _kernels()
  except ImportError as e:
    return False, str(e)
  return True, f"{kind} (sm{cc[0]}{cc[1]}) with Triton kernels"


@functools.lru_cache(maxsize=None)
def _kernels():
  from kvax_plugin.attention.kernels.triton import backward, forward
  return forward, backward


def _gpu_family(device_kind: str) -> str:
  kind = device_kind.upper()
  if "H200" in kind:
    return "h200"
  if "H100" in kind or "H800" in kind or "GH200" in kind:
    return "h100"
  return "fallback"


@dataclasses.dataclass(frozen=True)
class _Tiles:
  block_m: int
  block_n: int
  num_warps: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class _Launch:
  fwd: _Tiles
  dq: _Tiles
  dkv: _Tiles


def _tuned(family: str, head_dim: int) -> _Launch:
  """Tuned tiles per GPU family and (largest) head dim (sweeps: docs/performance.md). 8 warps
  only where each warpgroup gets 64 rows of a product."""
  if family in ("h100", "h200"):
    if head_dim <= 64:
      return _Launch(fwd=_Tiles(128, 64, 4, 4), dq=_Tiles(64, 64, 4, 4),
                     dkv=_Tiles(64, 128, 8, 3))
    if head_dim <= 128:
      return _Launch(fwd=_Tiles(128, 128, 8, 3), dq=_Tiles(128, 64, 8, 3),
                     dkv=_Tiles(64, 128, 8, 3))
    return _Launch(fwd=_Tiles(128, 64, 8, 2), dq=_Tiles(128, 32, 8, 2), dkv=_Tiles(64, 64, 8, 2))
  # A100-class fallback (164 KB shared memory, no wgmma): untuned.
  if head_dim > 128:
    return _Launch(fwd=_Tiles(64, 64, 4, 2), dq=_Tiles(64, 32, 4, 2), dkv=_Tiles(32, 64, 4, 2))
  return _Launch(fwd=_Tiles(128, 64, 4, 3), dq=_Tiles(64, 64, 4, 2), dkv=_Tiles(64, 64, 4, 2))


_SM_COUNT = {"h100": 132, "h200": 132, "fallback": 108}


def gqa_inplace(memory_optimized: bool, batch: int, kv_heads: int, group: int, kv_tiles: int,
                sm_count: int) -> bool:
  """Whether the dk/dv launch accumulates a GQA group in place (one program per kv head): no
  float32 per-head buffers and faster, unless too few programs per SM remain. memory_optimized
  forces in place; sm_count 0 (the CPU interpreter) keeps the caller's choice."""
  if memory_optimized or group == 1:
    return True
  if sm_count <= 0:
    return False
  return batch * kv_heads * kv_tiles >= 4 * sm_count


def _fit(tile: int, table_block: int) -> int:
  """Largest power of two <= tile that divides the table block (both powers of two)."""
  return min(tile, table_block)


def shared_memory_limit(device_kind: str) -> int:
  """Bytes of shared memory one Triton program may use."""
  kind = device_kind.upper()
  if _gpu_family(device_kind) in ("h100", "h200"):
    return 232448
  if "A100" in kind or "A800" in kind:
    return 166912
  return 101376


def shared_memory_bytes(kernel: str, t: _Tiles, itemsize: int, dk: int, dv: int) -> int:
  """Conservative shared-memory estimate of one program of `kernel` ("fwd", "dq" or "dkv")."""
  dk, dv = _pow2(dk), _pow2(dv)
  bm, bn = t.block_m, t.block_n
  if kernel == "fwd":
    once, streamed, staging = bm * dk, bn * (dk + dv), 1
  elif kernel == "dq":
    once, streamed, staging = bm * (dk + dv), bn * (dk + dv), 1
  elif kernel == "dkv":
    once, streamed, staging = bn * (dk + dv), bm * (dk + dv), 2
  else:
    raise ValueError(f"kernel must be 'fwd', 'dq' or 'dkv', got {kernel!r}")
  extra = staging * bm * bn if itemsize >= 4 else 0
  return itemsize * (once + t.num_stages * streamed + extra)


def fit_shared_memory(kernel: str, t: _Tiles, itemsize: int, dk: int, dv: int,
                      limit: int) -> _Tiles:
  """`t` with fewer stages, then smaller tiles, until it fits `limit`; the tiles still divide
  the mask's blocks."""
  loop_dim = "block_m" if kernel == "dkv" else "block_n"
  other_dim = "block_n" if kernel == "dkv" else "block_m"
  while shared_memory_bytes(kernel, t, itemsize, dk, dv) > limit:
    if t.num_stages > 1:
      t = dataclasses.replace(t, num_stages=t.num_stages - 1)
    elif getattr(t, loop_dim) > 16:
      t = dataclasses.replace(t, **{loop_dim: getattr(t, loop_dim) // 2})
    elif getattr(t, other_dim) > 16:
      t = dataclasses.replace(t, **{other_dim: getattr(t, other_dim) // 2})
    else:
      raise ValueError(
          f"head dims ({dk}, {dv}) with {itemsize}-byte inputs need "
          f"{shared_memory_bytes(kernel, t, itemsize, dk, dv)} B of shared memory in the "
          f"{kernel} kernel even at 16x16 tiles, above this GPU's {limit} B")
  rows = t.block_n if kernel == "dkv" else t.block_m
  if t.num_warps > 4 and rows < 64:
    t = dataclasses.replace(t, num_warps=4)
  return t


def _launch_for(spec, device_kind: str, dk: int, dv: int, override: str = "",
                itemsize: int = 2) -> _Launch:
  """Tiles of the three kernels for a mask's spec, fitted to the GPU's shared memory; an
  override (KernelOptions.triton_tiles) is taken exactly as given."""
  tuned = _tuned(_gpu_family(device_kind), max(dk, dv))
  f = spec.fwd_params
  if f == DEFAULT_FWD_PARAMS:
    fwd = _Tiles(_fit(tuned.fwd.block_m, f.query_block_size),
                 _fit(tuned.fwd.block_n, f.kv_block_size), tuned.fwd.num_warps,
                 tuned.fwd.num_stages)
  else:
    fwd = _Tiles(f.query_block_size, f.kv_block_size, f.num_warps, f.num_stages)
  bp = spec.bwd_params
  if bp is None:
    dq = dkv = fwd
  elif bp == DEFAULT_BWD_PARAMS or bp == _bwd_table_params(tuned):

    dq = _Tiles(_fit(tuned.dq.block_m, bp.query_block_size),
                _fit(tuned.dq.block_n, bp.kv_block_size), tuned.dq.num_warps,
                tuned.dq.num_stages)
    dkv = _Tiles(_fit(tuned.dkv.block_m, bp.query_block_size),
                 _fit(tuned.dkv.block_n, bp.kv_block_size), tuned.dkv.num_warps,
                 tuned.dkv.num_stages)
  else:
    dq = dkv = _Tiles(bp.query_block_size, bp.kv_block_size, bp.num_warps, bp.num_stages)
  parts = triton_tile_parts(override)
  if parts.keys() & {"fwd", "dq", "dkv"}:
    # KernelOptions.triton_tiles, e.g. "fwd=128,64,8,3;dq=...;dkv=..." (any subset).
    pick = lambda name, cur: _Tiles(*map(int, parts[name].split(","))) if name in parts else cur
    return _Launch(pick("fwd", fwd), pick("dq", dq), pick("dkv", dkv))
  if device_kind == "cpu":
    return _Launch(fwd, dq, dkv)
  limit = shared_memory_limit(device_kind)
  fitted = _Launch(*(fit_shared_memory(name, t, itemsize, dk, dv, limit)
                     for name, t in (("fwd", fwd), ("dq", dq), ("dkv", dkv))))
  if fitted != _Launch(fwd, dq, dkv):
    _log_refit(_Launch(fwd, dq, dkv), fitted, itemsize, dk, dv, device_kind)
  return fitted


@functools.lru_cache(maxsize=None)
def _log_refit(asked: _Launch, used: _Launch, itemsize: int, dk: int, dv: int,
               device_kind: str) -> None:
  # Once per distinct case, not every trace.
  logging.getLogger(__name__).info(
      "kvax triton: %d-byte inputs at head dims (%d, %d) on %s need less shared memory than "
      "the tiles %s; using %s (same result, launch detail only)", itemsize, dk, dv, device_kind,
      asked, used)


def _bwd_table_params(t: _Launch) -> FlashAttentionParamsConfig:
  """Backward table blocks both backward kernels' tuned tiles divide."""
  return FlashAttentionParamsConfig(query_block_size=max(t.dq.block_m, t.dkv.block_m),
                                    kv_block_size=max(t.dq.block_n, t.dkv.block_n),
                                    num_warps=t.dkv.num_warps, num_stages=t.dkv.num_stages)


def _as_params(t: _Tiles) -> FlashAttentionParamsConfig:
  return FlashAttentionParamsConfig(query_block_size=t.block_m, kv_block_size=t.block_n,
                                    num_warps=t.num_warps, num_stages=t.num_stages)


def default_params(device_kind: str, head_dim: int
                   ) -> tuple[FlashAttentionParamsConfig, FlashAttentionParamsConfig]:
  """(fwd, bwd) launch params tuned for a GPU (jax.Device.device_kind, e.g. "NVIDIA H200")."""
  t = _tuned(_gpu_family(device_kind), head_dim)
  return _as_params(t.fwd), _bwd_table_params(t)


def autotune_tiles(query, key, value, query_positions, query_segment_ids, kv_positions,
                   kv_segment_ids, mask: AttentionMask, *, scale: float = 1.0,
                   logits_soft_cap: float | None = None, sinks=None, backward: bool = True,
                   candidates: list[str] | None = None, rounds: int = 5
                   ) -> tuple[str, dict[str, float]]:
  """Opt-in autotune: time tile candidates on these inputs; return (best, {candidate: ms}).

  Candidates use the KernelOptions.triton_tiles format ("": the built-in choice) and must divide
  the mask's blocks; each runs as a fresh jitted forward (+ backward when `backward`), timed as
  the median of `rounds` calls. Apply the winner with `KernelOptions(triton_tiles=best)`.
  """
  import statistics
  import time

  spec = mask.spec
  if candidates is None:
    candidates = [""]
    fq, fk = spec.fwd_params.query_block_size, spec.fwd_params.kv_block_size
    for bm, bn, w, st in ((128, 128, 8, 3), (128, 64, 4, 4), (128, 64, 8, 3), (64, 64, 4, 3)):
      if fq % bm == 0 and fk % bn == 0:
        candidates.append(f"fwd={bm},{bn},{w},{st}")
    if backward and spec.bwd_params is not None:
      bq, bk = spec.bwd_params.query_block_size, spec.bwd_params.kv_block_size
      for dq_t, dkv_t in (((128, 64, 8, 3), (64, 128, 8, 3)), ((64, 64, 4, 2), (64, 128, 8, 3)),
                          ((64, 64, 4, 4), (64, 128, 8, 2)), ((64, 64, 4, 2), (64, 64, 8, 2))):
        if bq % dq_t[0] == 0 and bk % dq_t[1] == 0 and bq % dkv_t[0] == 0 and bk % dkv_t[1] == 0:
          candidates.append("dq=%d,%d,%d,%d;dkv=%d,%d,%d,%d" % (dq_t + dkv_t))
  ints = (query_positions, query_segment_ids, kv_positions, kv_segment_ids)

  timings = {}
  for cand in candidates:
    options = KernelOptions(triton_tiles=cand)

    def forward(q, k, v, options=options):
      return flash_attention_triton(q, k, v, *ints, mask, scale=scale,
                                    logits_soft_cap=logits_soft_cap, sinks=sinks,
                                    kernel_options=options)

    def loss(q, k, v, forward=forward):
      return jnp.sum(forward(q, k, v).astype(jnp.float32))

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)) if backward else forward)
    try:
      jax.block_until_ready(fn(query, key, value))
      times = []
      for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(query, key, value))
        times.append((time.perf_counter() - t0) * 1e3)
      timings[cand] = statistics.median(times)
    except Exception:  # noqa: BLE001 - a candidate that fails to compile simply loses
      timings[cand] = float("inf")
  best = min(timings, key=timings.get)
  return best, timings


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  soft_cap: float  # 0: none
  has_sinks: bool
  causal: bool
  window: int  # 0: none
  gqa_inplace: bool
  device_kind: str
  sm_count: int
  tiles_override: str
  dq_after_dkv: bool = False


def _pow2(n: int) -> int:
  return 1 << (int(n) - 1).bit_length()


def _dot_precision(dtype) -> str:
  # float32 inputs: exact products (tf32 would cost ~3e-4 relative error).
  return "ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32"


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _table_args(table: BlockTable):
  return (table.lower, table.upper, table.full_lower, table.full_upper)


def _check_tiles(name: str, tiles: _Tiles, table_m: int, table_n: int) -> None:
  if table_m % tiles.block_m or table_n % tiles.block_n:
    raise ValueError(f"{name} tiles {tiles.block_m}x{tiles.block_n} must divide the mask's "
                     f"blocks {table_m}x{table_n}")


def _forward(cfg: _Static, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask):
  """out [B, Sq, H, Dv] (q.dtype), lse [B, H, Sq] float32 (+inf for rows with nothing)."""
  fwd_kernel, _ = _kernels()
  b, sq, h, dk = q.shape
  skv, kh, dv = k.shape[1], k.shape[2], v.shape[3]
  spec = mask.spec
  tiles = _launch_for(spec, cfg.device_kind, dk, dv, cfg.tiles_override,
                      jnp.dtype(q.dtype).itemsize).fwd
  tm, tn = spec.fwd_params.query_block_size, spec.fwd_params.kv_block_size
  _check_tiles("forward", tiles, tm, tn)
  out, lse = compat.triton_call(
      q, k, v, q_pos, q_seg, kv_pos, kv_seg, sinks, *_table_args(mask.fwd),
      kernel=fwd_kernel.attn_fwd_kernel,
      out_shape=[jax.ShapeDtypeStruct((b, sq, h, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, h, sq), jnp.float32)],
      grid=(b * h, _cdiv(sq, tiles.block_m)), num_warps=tiles.num_warps,
      num_stages=tiles.num_stages,
      SQ=sq, SKV=skv, H=h, KH=kh, DK=dk, DV=dv, SCALE=cfg.scale, SOFT_CAP=cfg.soft_cap,
      HAS_SINKS=cfg.has_sinks, CAUSAL=cfg.causal, WINDOW=cfg.window,
      BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_DK=_pow2(dk), BLOCK_DV=_pow2(dv),
      TABLE_M=tm, TABLE_N=tn, TABLE_ROWS=mask.fwd.lower.shape[1],
      DOT_PRECISION=_dot_precision(q.dtype))
  return out, lse


def _bwd_common(cfg: _Static, q, k, v, mask: AttentionMask):
  b, sq, h, dk = q.shape
  skv, kh, dv = k.shape[1], k.shape[2], v.shape[3]
  spec = mask.spec
  launch = _launch_for(spec, cfg.device_kind, dk, dv, cfg.tiles_override,
                       jnp.dtype(q.dtype).itemsize)
  tm, tn = spec.bwd_params.query_block_size, spec.bwd_params.kv_block_size
  _check_tiles("dq", launch.dq, tm, tn)
  _check_tiles("dk/dv", launch.dkv, tm, tn)
  common = dict(SQ=sq, SKV=skv, H=h, KH=kh, DK=dk, DV=dv, SCALE=cfg.scale,
                SOFT_CAP=cfg.soft_cap, CAUSAL=cfg.causal, WINDOW=cfg.window,
                BLOCK_DK=_pow2(dk), BLOCK_DV=_pow2(dv), TABLE_M=tm, TABLE_N=tn,
                DOT_PRECISION=_dot_precision(q.dtype))
  return launch, common


def _bwd_delta(out, d_out):
  """delta [B, H, Sq] float32 = rowsum(dO * O) per query and head."""
  _, bwd_kernel = _kernels()
  b, sq, h, dv = out.shape
  delta_block = 64
  (delta,) = compat.triton_call(
      out, d_out, kernel=bwd_kernel.attn_bwd_delta_kernel,
      out_shape=[jax.ShapeDtypeStruct((b, h, sq), jnp.float32)],
      grid=(_cdiv(sq, delta_block), b * h), num_warps=4, num_stages=1,
      SQ=sq, H=h, DV=dv, BLOCK_M=delta_block, BLOCK_DV=_pow2(dv))
  return delta


def _bwd_dq(cfg: _Static, q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask, lse,
            delta, d_out):
  """dq [B, Sq, H, Dqk] in q.dtype (d_out already in q.dtype)."""
  _, bwd_kernel = _kernels()
  launch, common = _bwd_common(cfg, q, k, v, mask)
  b, sq, h, _ = q.shape
  t = launch.dq
  (dq,) = compat.triton_call(
      q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg, *_table_args(mask.dq),
      kernel=bwd_kernel.attn_bwd_dq_kernel,
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
      grid=(b * h, _cdiv(sq, t.block_m)), num_warps=t.num_warps, num_stages=t.num_stages,
      BLOCK_M=t.block_m, BLOCK_N=t.block_n, TABLE_ROWS=mask.dq.lower.shape[1], **common)
  return dq


def _bwd_dkv(cfg: _Static, q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask, lse,
             delta, d_out):
  """(dk [B, Skv, K, Dqk], dv [B, Skv, K, Dv]) in k.dtype / v.dtype."""
  _, bwd_kernel = _kernels()
  launch, common = _bwd_common(cfg, q, k, v, mask)
  b, _, h, dk = q.shape
  skv, kh, dv = k.shape[1], k.shape[2], v.shape[3]
  g = h // kh
  t = launch.dkv
  inplace = gqa_inplace(cfg.gqa_inplace, b, kh, g, _cdiv(skv, t.block_n), cfg.sm_count)

  forced = triton_tile_parts(cfg.tiles_override).get("gqa")
  if forced is not None:
    inplace = forced == "inplace" or g == 1
  out_heads = kh if inplace else h
  acc_dtype = k.dtype if inplace else jnp.float32
  dk_buf, dv_buf = compat.triton_call(
      q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg, *_table_args(mask.dkv),
      kernel=bwd_kernel.attn_bwd_dkv_kernel,
      out_shape=[jax.ShapeDtypeStruct((b, skv, out_heads, dk), acc_dtype),
                 jax.ShapeDtypeStruct((b, skv, out_heads, dv), acc_dtype)],
      grid=(b * out_heads, _cdiv(skv, t.block_n)), num_warps=t.num_warps,
      num_stages=t.num_stages, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
      TABLE_ROWS=mask.dkv.lower.shape[1], GQA_INPLACE=inplace, **common)
  if inplace:
    return dk_buf, dv_buf
  # Per-query-head partial gradients, summed over each GQA group in a fixed order.
  dk_out = dk_buf.reshape(b, skv, kh, g, dk).sum(axis=3).astype(k.dtype)
  dv_out = dv_buf.reshape(b, skv, kh, g, dv).sum(axis=3).astype(v.dtype)
  return dk_out, dv_out


def _backward(cfg: _Static, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask,
              out, lse, d_out):
  d_out = d_out.astype(q.dtype)
  delta = _bwd_delta(out, d_out)
  ints = (q_pos, q_seg, kv_pos, kv_seg)
  if cfg.dq_after_dkv:
    # dq last, so context parallelism's dk / dv reduce-scatter runs behind it.
    dk_out, dv_out = _bwd_dkv(cfg, q, k, v, *ints, mask, lse, delta, d_out)
    q, dk_out, dv_out = jax.lax.optimization_barrier((q, dk_out, dv_out))
    dq = _bwd_dq(cfg, q, k, v, *ints, mask, lse, delta, d_out)
  else:
    dq = _bwd_dq(cfg, q, k, v, *ints, mask, lse, delta, d_out)
    dk_out, dv_out = _bwd_dkv(cfg, q, k, v, *ints, mask, lse, delta, d_out)
  dsinks = sinks_gradient(sinks, lse, delta) if cfg.has_sinks else jnp.zeros_like(sinks)
  return dq, dk_out, dv_out, dsinks


_attention = kernel_attention(_forward, _backward)


def _gpu():
  try:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
  except RuntimeError:
    gpus = []
  return gpus[0] if gpus else None


def _device_kind() -> str:
  gpu = _gpu()
  return gpu.device_kind if gpu is not None else "cpu"


def _sm_count() -> int:
  gpu = _gpu()
  if gpu is None:
    return 0
  return int(getattr(gpu, "core_count", 0) or _SM_COUNT[_gpu_family(gpu.device_kind)])


def static_config(mask: AttentionMask, *, scale: float, logits_soft_cap: float | None,
                  has_sinks: bool, memory_optimized_gqa_backward: bool = False,
                  kernel_options: TritonOptions | KernelOptions | None = None) -> _Static:
  """The launch-time constants of one attention call (benchmarks/ use it too)."""
  opts = backend_config(kernel_options, "triton",
                        memory_optimized_gqa_backward=memory_optimized_gqa_backward)
  return _Static(scale=float(scale),
                 soft_cap=0.0 if logits_soft_cap is None else float(logits_soft_cap),
                 has_sinks=has_sinks, causal=bool(mask.spec.causal),
                 window=0 if mask.spec.sliding_window is None else int(mask.spec.sliding_window),
                 gqa_inplace=opts.memory_optimized_gqa_backward, device_kind=_device_kind(),
                 sm_count=_sm_count(), tiles_override=opts.tiles,
                 dq_after_dkv=opts.dq_after_dkv)


def flash_attention_triton(query, key, value, query_positions, query_segment_ids, kv_positions,
                           kv_segment_ids, mask: AttentionMask, *, scale: float,
                           logits_soft_cap: float | None, sinks: jax.Array | None,
                           memory_optimized_gqa_backward: bool = False,
                           kernel_options: TritonOptions | KernelOptions | None = None
                           ) -> jax.Array:
  """Attention over validated inputs with the Triton kernels: arguments and result as
  flash_attention; kernel_options: TritonOptions (or a KernelOptions; None: the defaults)."""
  compat.check()
  ok, why = CAPABILITIES.supports(query.dtype, query.shape[3], value.shape[3])
  if not ok:
    raise ValueError(f"query: {why} by the Triton kernels")
  h = query.shape[2]
  cfg = static_config(mask, scale=scale, logits_soft_cap=logits_soft_cap,
                      has_sinks=sinks is not None,
                      memory_optimized_gqa_backward=memory_optimized_gqa_backward,
                      kernel_options=kernel_options)
  sinks_arr = jnp.zeros((h,), jnp.float32) if sinks is None else sinks
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  return _attention(cfg, query, key, value, sinks_arr, *ints, mask)
