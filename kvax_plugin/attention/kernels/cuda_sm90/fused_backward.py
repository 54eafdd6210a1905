"""JAX side of fused_backward.cu: find or build the shared object (build.py), register its FFI
target, call it; the backward of backend="hopper". A leaf: imports no other kernel backend.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention.block_mask import documents_longest_first_over_heads, longest_first
from kvax_plugin.attention.kernels.cuda_sm90 import build

PREBUILT = build.OUTPUT
TARGET = "kvax_sm90_fused_backward"
DQ_TARGET = "kvax_sm90_dq_from_accum"  # dq from the kernel's dq_accum (dq_from_accum_kernel)
HEAD_DIM = 128
# (q / k, v / d_out) head dims built; 256 and MLA's 192 / 128 in wide kernels (64-row kv tiles).
HEAD_DIMS = ((128, 128), (64, 64), (256, 256), (192, 128))
# The main layout's head dims; the wide kernels have no DECOUPLE / MASK_IN_LOOP and store
# dq_accum in the vector order.
MAIN_LAYOUT_HEAD_DIMS = (64, 128)
KV_TILE = 128
Q_BLOCK = 64


# fused_backward.cu's KvaxSm90AbiVersion: bump both together when the interface changes.
ABI_VERSION = 16

_LOADED: list[ctypes.CDLL] = []
_FAILED: list[tuple[type, str]] = []
_LOCK = threading.Lock()


def library_status(cache_dir: str | os.PathLike | None = None) -> tuple[bool, str]:
  """(ok, reason) without building or loading: ok when the library is loaded, prebuilt with a
  matching key, cached, or buildable here (nvcc found)."""
  if _LOADED:
    return True, ""
  if _FAILED:
    return False, _FAILED[0][1]
  if build.cached_library(cache_dir, prebuilt=PREBUILT) is not None:
    return True, ""
  try:
    build.find_nvcc()
  except build.ToolchainMissing as e:
    return False, str(e)
  return True, ""


def prepare(cache_dir: str | os.PathLike | None = None,
            nvcc: str | os.PathLike | None = None) -> tuple[bool, str]:
  """(ok, reason) of load(cache_dir=..., nvcc=...), building first if needed; a failure is
  tried once per process."""
  try:
    load(cache_dir=cache_dir, nvcc=nvcc)
  except (OSError, RuntimeError) as e:
    return False, str(e)
  return True, ""


def load(path: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
         nvcc: str | os.PathLike | None = None) -> ctypes.CDLL:
  """Load the shared object and register its FFI target, once per process (later calls return
  the first library). path: a library to load as it is (no key check); None: the prebuilt one if
  its key matches, else the cache, else build it there (cache_dir: default
  $XDG_CACHE_HOME/kvax_plugin/sm90; nvcc: default the nvidia-cuda-nvcc wheel's, then PATH).
  Raises build.ToolchainMissing or RuntimeError; with path=None a failure is raised again at once.
  """
  with _LOCK:
    if _LOADED:
      return _LOADED[0]
    if path is not None:
      # absolute: dlopen looks a bare file name up in the library path
      lib_path = Path(path).resolve()
      if not lib_path.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no such library (expected a "
                                f"{build.LIB_NAME} built by python -m kvax_plugin.attention."
                                "kernels.cuda_sm90.build, or None to find or build it)")
      lib = ctypes.cdll.LoadLibrary(str(lib_path))
      check_abi(lib, lib_path)
    else:
      if _FAILED:
        kind, message = _FAILED[0]
        raise kind(message)
      try:
        lib_path = build.ensure_library(cache_dir, nvcc, prebuilt=PREBUILT)
        lib = ctypes.cdll.LoadLibrary(str(lib_path))
        check_abi(lib, lib_path)
      except build.ToolchainMissing as e:
        _FAILED.append((build.ToolchainMissing, str(e)))
        raise
      except (OSError, RuntimeError) as e:
        _FAILED.append((RuntimeError, f"{build.LIB_NAME} could not be built or loaded: {e}"))
        raise RuntimeError(_FAILED[0][1]) from e
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.KvaxSm90FusedBackward),
                                platform="CUDA")
    jax.ffi.register_ffi_target(DQ_TARGET, jax.ffi.pycapsule(lib.KvaxSm90DqFromAccum),
                                platform="CUDA")
    _LOADED.append(lib)
    return lib


def check_abi(lib, lib_path) -> None:
  """Refuse a library built from another version of fused_backward.cu."""
  version = getattr(lib, "KvaxSm90AbiVersion", None)
  got = version() if version is not None else None
  if got != ABI_VERSION:
    raise RuntimeError(f"{lib_path}: built from another fused_backward.cu (interface version "
                       f"{got}, this module needs {ABI_VERSION}); rebuild it with "
                       "python -m kvax_plugin.attention.kernels.cuda_sm90.build")


def tile_bounds(mask) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(lower, upper, full_lower, full_upper) int32 [B, Skv / 128]: each 128-row kv tile's
  visited and full query blocks (64 rows), from the mask's dk/dv table."""
  bq = mask.spec.bwd_params.query_block_size
  bkv = mask.spec.bwd_params.kv_block_size
  if bkv != KV_TILE or bq % Q_BLOCK:
    raise ValueError(f"mask: backward blocks {bq} x {bkv}; this kernel needs kv blocks of "
                     f"{KV_TILE} and query blocks a multiple of {Q_BLOCK}")
  f = bq // Q_BLOCK
  return tuple((x * f).astype(jnp.int32) for x in mask.dkv)


# Layout feature bits (fused_backward.cu): STM stmatrix .trans, FRAG fragment-order dQ,
# EXP ex2.approx.ftz, DECOUPLE consumers hand dS by arrive / sync, dQ one step late.
STM, FRAG, EXP, DECOUPLE = 2, 4, 16, 32
# Per-call attention features (each variant is built with none, either and both).
SOFTCAP, WINDOW = 1024, 2048
# The mask in the exponentials' loop instead of a pass setting -inf: needed when scale <= 0
# (-inf times it is +inf or NaN). Head dims 128 / 64 only (the others always mask in the loop).
MASK_IN_LOOP = 64
DTYPES = (jnp.bfloat16, jnp.float16)
MAX_WINDOW = 2**31 - 1
# The one feature set built (KVAX_SM90_VARIANTS); removed ones: docs/tuning-history.md.
VARIANTS = {"v7": STM | FRAG | EXP | DECOUPLE}
DEFAULT_VARIANT = "v7"


def unpermute_fragment_order(accum):
  """[..., 4096] in the FRAG staging order -> [..., 64, 64] row-major (fused_backward.cu)."""
  lead = accum.shape[:-1]
  x = accum.reshape(*lead, 8, 2, 4, 8, 4, 2)
  n = len(lead)
  x = x.transpose(*range(n), n + 2, n + 1, n + 3, n + 0, n + 4, n + 5)
  return x.reshape(*lead, 64, 64)


def unpermute_vector_order(accum):
  """[..., 4096] in the wide kernels' order (red_add_part) -> [..., 64, 64] row-major."""
  lead = accum.shape[:-1]
  x = accum.reshape(*lead, 8, 4, 8, 4, 2, 2)
  n = len(lead)
  x = x.transpose(*range(n), n + 1, n + 4, n + 2, n + 0, n + 3, n + 5)
  return x.reshape(*lead, 64, 64)


# An `order` entry codes its (kv head, kv tile) pair as (kv head << ORDER_TILE_BITS) | tile
# (fused_backward.cu's cta_tile / cta_kv_head).
ORDER_TILE_BITS = 20
MAX_ORDER_TILES = 1 << ORDER_TILE_BITS
MAX_ORDER_KV_HEADS = 1 << (31 - ORDER_TILE_BITS)
# launch_order's layouts, and the one each kernel takes (layout_for).
LAYOUTS = ("documents", "heads_slowest", "heads_fastest")


def layout_for(head_dim: int, window: int) -> str:
  """The launch layout of the kernel for head_dim (q / k) with or without a sliding window.

  "documents" (head dim 128 without a window): the tiles by documents, most work first
  (block_mask.documents_longest_first_over_heads); a document with more pairs than the GPU runs
  at once goes head by head, so the pairs in flight are one head's neighbouring tiles, which
  read the same query blocks (on one causal document: each head's tiles in sequence, the heads
  slowest); a smaller one runs each tile's heads together.
  "heads_slowest" (a window; head dims 256 and 192 / 128): each head's tiles longest first, the
  heads one after another, so the pairs in flight share one head's query rows (a window's tiles
  all walk equally far). "heads_fastest" (head dim 64): the tiles longest first, each tile's
  heads together (docs/status.md has the measurements behind each)."""
  if head_dim == 128 and not window:
    return "documents"
  return "heads_fastest" if head_dim == 64 and not window else "heads_slowest"


def pack_order(heads, tiles):
  """int32 entries of the kernel's `order` from kv heads and kv tiles (same shapes)."""
  return (heads.astype(jnp.int32) << ORDER_TILE_BITS) | tiles.astype(jnp.int32)


def gpu_wave() -> int:
  """The CTAs of this kernel the first GPU runs at once: one per SM (its core count), or an
  H100 / H200's 132 where the device does not say."""
  gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  count = getattr(gpus[0], "core_count", None) if gpus else None
  return count if isinstance(count, int) and count > 0 else 132


def launch_order(bounds, n_tiles: int, kv_heads: int, layout: str, wave: int | None = None):
  """int32 [B, kv_heads * n_tiles]: the (kv head, kv tile) pair each launch position runs, the
  kernel's `order` input (pack_order's code); layout one of LAYOUTS (layout_for).

  bounds: tile_bounds(mask); n_tiles: the kernel's kv tiles per row (twice the table's rows for
  the wide kernels' 64-row tiles); wave: the CTAs the GPU runs at once ("documents"; default
  gpu_wave())."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
  if n_tiles > MAX_ORDER_TILES or kv_heads > MAX_ORDER_KV_HEADS:
    raise ValueError(f"{n_tiles} kv tiles, {kv_heads} kv heads: the launch order codes a pair "
                     f"in 32 bits, at most {MAX_ORDER_TILES} tiles and {MAX_ORDER_KV_HEADS} "
                     "kv heads")
  lower, upper = (x.astype(jnp.int32) for x in bounds[:2])
  b, tiles_per_row = lower.shape[0], n_tiles // lower.shape[1]
  if layout == "documents":
    codes = documents_longest_first_over_heads(lower, upper, tiles_per_row, n_tiles, kv_heads,
                                               gpu_wave() if wave is None else wave)
    return pack_order(codes // n_tiles, codes % n_tiles)
  tiles = longest_first(lower, upper, tiles_per_row, n_tiles)  # [B, n_tiles]
  heads = jnp.arange(kv_heads, dtype=jnp.int32)
  if layout == "heads_slowest":
    return pack_order(jnp.broadcast_to(jnp.repeat(heads, n_tiles), (b, kv_heads * n_tiles)),
                      jnp.tile(tiles, (1, kv_heads)))
  return pack_order(jnp.broadcast_to(jnp.tile(heads, n_tiles), (b, kv_heads * n_tiles)),
                    jnp.repeat(tiles, kv_heads, axis=1))


def fused_backward(q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg, bounds, *,
                   scale: float, causal: bool, variant: str = DEFAULT_VARIANT,
                   soft_cap: float = 0.0, window: int = 0):
  """q [B, Sq, H, D], k [B, Skv, KH, D], v [B, Skv, KH, Dv], d_out [B, Sq, H, Dv] ((D, Dv) one
  of HEAD_DIMS; Sq, Skv multiples of 128), q bf16 or fp16 (the others are cast to it); lse, delta
  [B, H, Sq] float32; ids int32; bounds from tile_bounds; soft_cap / window 0 for none. Returns
  dq [B, Sq, H, D] (exactly 0 on the rows whose lse is +inf), dk [B, Skv, KH, D],
  dv [B, Skv, KH, Dv] in q's type."""
  b, s, h, d = q.shape
  skv, kh = k.shape[1], k.shape[2]
  dv_dim = v.shape[3] if v.ndim == 4 else -1
  if ((d, dv_dim) not in HEAD_DIMS or k.shape[3] != d or k.shape[0] != b or s % KV_TILE
      or skv % KV_TILE or h % kh):
    raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected head dims (q / k, v) "
                     f"one of {HEAD_DIMS}, one batch size, Sq and Skv multiples of {KV_TILE}, "
                     "query heads a multiple of kv heads")
  if variant not in VARIANTS:
    raise ValueError(f"variant={variant!r}: expected one of {sorted(VARIANTS)}")
  dtype = jnp.dtype(q.dtype)
  if dtype not in DTYPES:
    raise ValueError(f"q: {dtype}; expected bfloat16 or float16")
  if not soft_cap >= 0.0 or not window >= 0:
    raise ValueError(f"soft_cap={soft_cap}, window={window}: expected 0 (none) or positive")
  # The kernel checks nothing: a wrong shape would read past a buffer.
  expected = {"v": k.shape[:3] + (dv_dim,), "d_out": (b, s, h, dv_dim), "lse": (b, h, s),
              "delta": (b, h, s),
              "q_pos": (b, s), "q_seg": (b, s), "kv_pos": (b, skv), "kv_seg": (b, skv)}
  given = {"v": v, "d_out": d_out, "lse": lse, "delta": delta, "q_pos": q_pos, "q_seg": q_seg,
           "kv_pos": kv_pos, "kv_seg": kv_seg}
  for name, x in given.items():
    if x.shape != expected[name]:
      raise ValueError(f"{name}: shape {x.shape}, expected {expected[name]}")
  if len(bounds) != 4 or any(x.shape != (b, skv // KV_TILE) for x in bounds):
    raise ValueError(f"bounds: expected tile_bounds(mask), 4 arrays of shape "
                     f"{(b, skv // KV_TILE)}; got {[getattr(x, 'shape', x) for x in bounds]}")
  load()
  cast = lambda x: x.astype(dtype)
  i32 = lambda x: x.astype(jnp.int32)
  bits = VARIANTS[variant] | (SOFTCAP if soft_cap else 0) | (WINDOW if window else 0)
  if not scale > 0 and not soft_cap:
    bits |= MASK_IN_LOOP
  if d not in MAIN_LAYOUT_HEAD_DIMS:
    bits &= ~(DECOUPLE | MASK_IN_LOOP)
  # The wide kernels run 64-row kv tiles, two per table row.
  cta_tile = KV_TILE if d in MAIN_LAYOUT_HEAD_DIMS else KV_TILE // 2
  order = launch_order(bounds, skv // cta_tile, kh, layout_for(d, window))
  dk, dv, dq_accum = jax.ffi.ffi_call(
      TARGET,
      (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype),
       jax.ShapeDtypeStruct((b, h, d // 64, s // Q_BLOCK, Q_BLOCK * 64), jnp.float32)),
  )(q, cast(k), cast(v), cast(d_out), lse.astype(jnp.float32),
    delta.astype(jnp.float32), i32(q_pos), i32(q_seg), i32(kv_pos), i32(kv_seg),
    *map(i32, bounds), order, scale=np.float32(scale), causal=np.int32(bool(causal)),
    variant=np.int32(bits), soft_cap=np.float32(soft_cap),
    window=np.int32(min(int(window), MAX_WINDOW)))
  # dq_from_accum below, in one pass on the GPU (every built variant stages dq in FRAG's order
  # at head dims 64 / 128, the vector order above), with the +inf-lse rows set to 0.
  dq, = jax.ffi.ffi_call(DQ_TARGET, (jax.ShapeDtypeStruct(q.shape, dtype),))(
      dq_accum, lse.astype(jnp.float32), scale=np.float32(scale),
      vector_order=np.int32(d not in MAIN_LAYOUT_HEAD_DIMS))
  return dq, dk, dv


def dq_from_accum(dq_accum, variant: str, scale: float, dtype):
  """dq [B, Sq, H, D] from the kernel's float32 dq_accum [B, H, D / 64, Sq / 64, 4096] (dS K
  unscaled, per 64-column part and 64-row block, in the layout's order): the definition of
  fused_backward.cu's dq_from_accum_kernel (which also zeroes the +inf-lse rows), in jnp."""
  b, h, parts, blocks, _ = dq_accum.shape
  if parts * 64 not in MAIN_LAYOUT_HEAD_DIMS:
    block = unpermute_vector_order(dq_accum)
  elif VARIANTS[variant] & FRAG:
    block = unpermute_fragment_order(dq_accum)
  else:
    block = dq_accum.reshape(b, h, parts, blocks, Q_BLOCK, 64)
  dq = block.transpose(0, 3, 4, 1, 2, 5).reshape(b, blocks * Q_BLOCK, h, parts * 64)
  return (dq * scale).astype(dtype)
