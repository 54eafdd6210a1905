"""backend="hopper": the Mosaic GPU forward with the CUDA C++ fused backward (Hopper only).

Not a leaf: it composes two leaves, the Mosaic backend's forward kernel (kernels/mosaic) and the
5-product fused backward written in CUDA C++ (kernels/cuda_sm90), under the shared custom VJP
(kernels/custom_vjp). tests/test_layering.py places it above the leaves and below the registry.

Why a backend of its own: the fused backward is faster than the Mosaic backward on plain causal
attention (H200, backward alone, session 20's S20A: 16k 11.08 ms against 12.38, cuDNN 10.93;
64k 169.4 against 187.3, cuDNN 163.5; benchmarks/NOTES.md) and slower on short packed documents
(16k: 2.82 against 2.70 ms), and it covers fewer cases: bfloat16, head dim 128 for query, key
and value, query and key lengths multiples of 128, causal or not, segment ids, GQA / MQA; no
soft cap, sliding window or sinks. Its backward reduce-adds dq in float32 in no fixed order (not
bitwise reproducible), where "mosaic"'s default backward is. So "auto" does not take it
(AUTO_ORDER); users ask for it by name, and a call it does not cover raises
(BackendUnavailableError from the registry, ValueError here) instead of running another
backward.

The shared object is built from source (python -m kvax_plugin.attention.kernels.cuda_sm90.build,
nvcc >= 13 from PyPI); until it is, device_supported says so and an explicit backend="hopper"
raises with that reason.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from kvax_plugin.attention.block_mask import AttentionMask
from kvax_plugin.attention.kernels.capabilities import Capabilities
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as cuda_bwd
from kvax_plugin.attention.kernels.custom_vjp import kernel_attention
from kvax_plugin.attention.kernels.mosaic import backend as mosaic

HEAD_DIM = cuda_bwd.HEAD_DIM
VARIANT = cuda_bwd.DEFAULT_VARIANT  # the fused backward's feature set (VARIANTS there)
# Benchmarking hook: another of VARIANTS, read while tracing (measured ones that lose are
# removed from VARIANTS, and then this errors).
VARIANT_ENV = "KVAX_HOPPER_BWD_VARIANT"


def _variant() -> str:
  name = os.environ.get(VARIANT_ENV, "") or VARIANT
  if name not in cuda_bwd.VARIANTS:
    raise ValueError(f"environment variable {VARIANT_ENV}={name!r}: expected one of "
                     f"{sorted(cuda_bwd.VARIANTS)}")
  return name


CAPABILITIES = Capabilities(dtypes=("bfloat16",), min_head_dim=HEAD_DIM, max_head_dim=HEAD_DIM,
                            head_dim_multiple=HEAD_DIM,
                            features=frozenset({"causal", "gqa", "backward"}))


def device_supported(device) -> tuple[bool, str]:
  """(ok, reason): a Hopper GPU (the Mosaic forward, wgmma / TMA) and the built shared object."""
  ok, why = mosaic.device_supported(device)
  if not ok:
    return ok, why
  if not cuda_bwd.LIB.exists():
    return False, (f"{cuda_bwd.LIB} is not built: run python -m kvax_plugin.attention.kernels."
                   "cuda_sm90.build (any machine with Python; it needs nvcc >= 13: python3 -m "
                   "pip install 'nvidia-cuda-nvcc>=13' nvidia-cuda-cccl, or kvax-plugin[hopper])")
  return True, ""


def supports_mask(mask: AttentionMask) -> tuple[bool, str]:
  """(ok, reason): the Mosaic forward's block rule, backward tables with kv blocks of 128 and
  query blocks a multiple of 64 (the fused backward's tile), no sliding window."""
  ok, why = mosaic.supports_mask(mask)
  if not ok:
    return ok, why
  if mask.spec.sliding_window is not None:
    return False, "a sliding-window mask is not supported by the fused backward"
  params = mask.spec.bwd_params
  if params is not None and (params.kv_block_size != cuda_bwd.KV_TILE
                             or params.query_block_size % cuda_bwd.Q_BLOCK):
    return False, (f"the mask's backward blocks {params.query_block_size}x"
                   f"{params.kv_block_size}: the fused backward needs kv blocks of "
                   f"{cuda_bwd.KV_TILE} and query blocks a multiple of {cuda_bwd.Q_BLOCK} (the "
                   "default FlashAttentionParamsConfig)")
  return True, ""


@dataclasses.dataclass(frozen=True)
class _Static(mosaic.Static):
  """The Mosaic forward's static configuration, plus the fused backward's variant."""
  variant: str = VARIANT


def _backward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask, out, lse,
              d_out):
  # delta = rowsum(dO * O): what softmax's Jacobian subtracts
  delta = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
  dq, dk, dv = cuda_bwd.fused_backward(q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg,
                                       cuda_bwd.tile_bounds(mask), scale=cfg.scale,
                                       causal=cfg.causal, variant=cfg.variant)
  # Rows with nothing to attend (lse +inf) get exactly 0, as from the other backends: their
  # probabilities are 0, but a non-finite key would reach them through 0 * NaN in dS K.
  dq = jnp.where((lse == jnp.inf).transpose(0, 2, 1)[..., None], jnp.zeros_like(dq), dq)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), jnp.zeros_like(sinks)


_attention = kernel_attention(mosaic._forward, _backward)


def flash_attention_hopper(query, key, value, query_positions, query_segment_ids, kv_positions,
                           kv_segment_ids, mask: AttentionMask, *, scale: float,
                           logits_soft_cap: float | None, sinks: jax.Array | None,
                           deterministic_backward: bool | None = None) -> jax.Array:
  """Attention over validated inputs: the Mosaic forward, the CUDA C++ fused backward.

  query [B, Sq, H, 128], key / value [B, Skv, K, 128] bfloat16 (H a multiple of K), positions /
  segment ids int32 [B, Sq] and [B, Skv] (Sq, Skv multiples of 128), mask from
  create_attention_mask with the backward tables (calc_bwd_mask=True) and default block sizes.
  Returns [B, Sq, H, 128] bfloat16; differentiable in query, key and value. The backward
  reduce-adds dq in float32 from many thread blocks, in no fixed order: not bitwise
  reproducible, so deterministic_backward=True is refused (None and False run).
  """
  if logits_soft_cap:
    raise ValueError(f"logits_soft_cap={logits_soft_cap}: not supported by the hopper backend "
                     "(the fused backward has no soft cap); use backend=\"mosaic\"")
  if sinks is not None:
    raise ValueError("sinks: not supported by the hopper backend; use backend=\"mosaic\"")
  if deterministic_backward:
    raise ValueError("deterministic_backward=True: the hopper backend's backward reduce-adds dq "
                     "in float32 in no fixed order (not bitwise reproducible); use "
                     "backend=\"mosaic\" for a deterministic backward, or leave it None")
  b, sq, h, d = query.shape
  skv = key.shape[1]
  if sq % cuda_bwd.KV_TILE or skv % cuda_bwd.KV_TILE:
    raise ValueError(f"query length {sq}, key length {skv}: the hopper backend needs both a "
                     f"multiple of {cuda_bwd.KV_TILE}; use backend=\"mosaic\"")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.dtype != jnp.bfloat16 or x.shape[3] != HEAD_DIM:
      raise ValueError(f"{name}: {x.dtype} with head dim {x.shape[3]}; the hopper backend "
                       f"needs bfloat16 and head dim {HEAD_DIM}")
  ok, why = supports_mask(mask)
  if not ok:
    raise ValueError(f"mask: {why}")
  cfg = _Static(scale=float(scale), soft_cap=0.0, has_sinks=False,
                causal=bool(mask.spec.causal), window=0, deterministic=True, interpret=False,
                variant=_variant())
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  return _attention(cfg, query, key, value, jnp.zeros((h,), jnp.float32), *ints, mask)
