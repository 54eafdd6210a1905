"""backend="hopper": the Mosaic GPU forward with the CUDA C++ fused backward (Hopper only).

Head dims 64, 128, 256 and MLA's 192 / 128, bf16 / fp16, any lengths (padded to 128-row tiles);
"auto" takes it where measured fastest (auto_prefers). Its dq reduce-add has no fixed order, so
deterministic_backward=True routes "auto" to "mosaic" and raises with backend="hopper". The
shared object is built on first use (cuda_sm90/build.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from kvax_plugin.attention import block_mask
from kvax_plugin.attention.block_mask import AttentionMask
from kvax_plugin.attention.kernels.capabilities import Capabilities
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as cuda_bwd
from kvax_plugin.attention.kernels.custom_vjp import (kernel_attention, sinks_gradient,
                                                     softmax_delta)
from kvax_plugin.attention.kernels.mosaic import backend as mosaic
from kvax_plugin.attention.options import backend_config
from kvax_plugin.attention.params import PADDING_SEGMENT_ID

HEAD_DIMS = cuda_bwd.HEAD_DIMS
VARIANT = cuda_bwd.DEFAULT_VARIANT

CAPABILITIES = Capabilities(dtypes=("bfloat16", "float16"),
                            min_head_dim=min(min(pair) for pair in HEAD_DIMS),
                            max_head_dim=max(max(pair) for pair in HEAD_DIMS),
                            head_dim_multiple=64, head_dims=HEAD_DIMS,
                            features=frozenset({"causal", "sliding_window", "logits_soft_cap",
                                                "sinks", "gqa", "distinct_v_head_dim",
                                                "backward"}))


def device_supported(device) -> tuple[bool, str]:
  """(ok, reason): a Hopper GPU and the fused backward's library loaded; the first ask finds or
  builds it (about a minute, once per source and jaxlib), so "auto" never takes a hopper whose
  backward cannot load. The reason names what to install when nvcc is missing."""
  ok, why = mosaic.device_supported(device)
  if not ok:
    return ok, why
  return cuda_bwd.prepare()


def supports_mask(mask: AttentionMask) -> tuple[bool, str]:
  """(ok, reason): the Mosaic forward's block rule, backward tables with kv blocks of 128 and
  query blocks a multiple of 64. Lengths are free (padded)."""
  ok, why = mosaic.supports_mask(mask)
  if not ok:
    return ok, why
  params = mask.spec.bwd_params
  if params is not None and (params.kv_block_size != cuda_bwd.KV_TILE
                             or params.query_block_size % cuda_bwd.Q_BLOCK):
    return False, (f"the mask's backward blocks {params.query_block_size}x"
                   f"{params.kv_block_size}: the fused backward needs kv blocks of "
                   f"{cuda_bwd.KV_TILE} and query blocks a multiple of {cuda_bwd.Q_BLOCK} "
                   "(e.g. the default FlashAttentionParamsConfig)")
  return True, ""


# Head dims 128 / 64 cases where "mosaic" is faster (docs/performance.md).
AUTO_NOT_PREFERRED = (("sliding_window", "logits_soft_cap"),)


def auto_prefers(dtype, qk_head_dim: int, v_head_dim: int, features=()) -> tuple[bool, str]:
  """(ok, reason): whether "auto" picks hopper for a call it supports, where docs/performance.md
  measured it faster: head dims 128 and 64 except AUTO_NOT_PREFERRED, 256 always, MLA's
  (192, 128) never."""
  del dtype
  dims = (qk_head_dim, v_head_dim)
  if dims == (256, 256):
    return True, ""
  if dims in ((128, 128), (64, 64)):
    slower = [" with ".join(c) for c in AUTO_NOT_PREFERRED if set(c) <= set(features)]
  else:
    slower = [f"head dims ({qk_head_dim}, {v_head_dim})"]
  if slower:
    return False, (f"{', '.join(slower)}: the Mosaic backward was measured faster (H200, "
                   'docs/performance.md); pass backend="hopper" to use this '
                   "one anyway")
  return True, ""


# Where "by_mask" runs the Mosaic backward instead (benchmarks/backward_choice.py writes it).
BACKWARD_CHOICE = Path(__file__).with_name("backward_choice.json")


@functools.cache
def _backward_rules() -> dict[tuple, float]:
  data = json.loads(BACKWARD_CHOICE.read_text(encoding="utf-8"))
  return {(rule["dtype"], tuple(rule["head_dims"]), tuple(sorted(rule["features"]))):
          float(rule["mosaic_from_partial_share"]) for rule in data["rules"]}


def mosaic_backward_from(dtype, qk_head_dim: int, v_head_dim: int, features=()) -> float | None:
  """The share of partly kept blocks (block_mask.partial_share of the mask's dkv table) from
  which "by_mask" runs the Mosaic backward for these inputs; None: always the CUDA one.
  features: the subset of "sliding_window", "logits_soft_cap", "sinks" the call uses."""
  key = (jnp.dtype(dtype).name, (qk_head_dim, v_head_dim), tuple(sorted(features)))
  return _backward_rules().get(key)


def auto_config(config):
  """The HopperOptions "auto" runs: the backward chosen by the mask unless `config` names one."""
  return config if config.backward is not None else dataclasses.replace(config, backward="by_mask")


@dataclasses.dataclass(frozen=True)
class _Static(mosaic.Static):
  """The Mosaic forward's configuration plus the fused backward's variant and, for "by_mask",
  the partial share from which the Mosaic backward runs (None: the CUDA backward always)."""
  variant: str = VARIANT
  mosaic_backward_from: float | None = None


_pad = mosaic._pad_axis


def padded_lengths(mask: AttentionMask, sq: int, skv: int) -> tuple[int, int]:
  """(Sq, Skv) padded as the fused backward runs them: to its 128-row tiles and the mask's
  blocks."""
  bq = mask.spec.bwd_params.query_block_size
  q_multiple = math.lcm(cuda_bwd.KV_TILE, bq)
  return -(-sq // q_multiple) * q_multiple, -(-skv // cuda_bwd.KV_TILE) * cuda_bwd.KV_TILE


def _backward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask, out, lse,
              d_out):
  args = (q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse, d_out)
  if cfg.mosaic_backward_from is None:
    return _cuda_backward(cfg, *args)
  # Both backwards read the same residuals (the forward is the Mosaic one); the choice is made
  # on the device, per call, from the mask's tables.
  use_mosaic = block_mask.partial_share(mask.dkv) >= cfg.mosaic_backward_from
  return jax.lax.cond(use_mosaic, lambda a: mosaic._backward(cfg, *a),
                      lambda a: _cuda_backward(cfg, *a), args)


def _cuda_backward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask: AttentionMask, out,
                   lse, d_out):
  delta = softmax_delta(d_out, out)
  # Pad both sides to whole 128-row tiles: padded kv rows carry the padding id, padded query
  # rows lse = +inf, so neither takes part; their gradients are sliced off below.
  sq, skv = q.shape[1], k.shape[1]
  sq_p, skv_p = padded_lengths(mask, sq, skv)
  q_p, d_out_p = (_pad(x, 1, sq_p, 0) for x in (q, d_out))
  k_p, v_p = (_pad(x, 1, skv_p, 0) for x in (k, v))
  lse_p, delta_p = _pad(lse, 2, sq_p, jnp.inf), _pad(delta, 2, sq_p, 0.0)
  q_pos_p, q_seg_p = _pad(q_pos, 1, sq_p, 0), _pad(q_seg, 1, sq_p, PADDING_SEGMENT_ID)
  kv_pos_p, kv_seg_p = _pad(kv_pos, 1, skv_p, 0), _pad(kv_seg, 1, skv_p, PADDING_SEGMENT_ID)
  dq, dk, dv = cuda_bwd.fused_backward(q_p, k_p, v_p, d_out_p, lse_p, delta_p,
                                       q_pos_p, q_seg_p, kv_pos_p, kv_seg_p,
                                       cuda_bwd.tile_bounds(mask), scale=cfg.scale,
                                       causal=cfg.causal, variant=cfg.variant,
                                       soft_cap=cfg.soft_cap, window=cfg.window)
  # Rows with nothing to attend (lse +inf) come back exactly 0 (fused_backward's dq).
  dq, dk, dv = dq[:, :sq], dk[:, :skv], dv[:, :skv]
  # The lse holds the sinks, so dq / dk / dv need nothing more.
  dsinks = sinks_gradient(sinks, lse, delta) if cfg.has_sinks else jnp.zeros_like(sinks)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), dsinks


_attention = kernel_attention(mosaic._forward, _backward)


def flash_attention_hopper(query, key, value, query_positions, query_segment_ids, kv_positions,
                           kv_segment_ids, mask: AttentionMask, *, scale: float,
                           logits_soft_cap: float | None, sinks: jax.Array | None,
                           deterministic_backward: bool | None = None,
                           kernel_options=None) -> jax.Array:
  """Attention over validated inputs: the Mosaic forward, the CUDA C++ fused backward.

  query / key [B, Sq or Skv, H or K, D], value [B, Skv, K, Dv], (D, Dv) one of HEAD_DIMS, one
  type, bfloat16 or float16; any Sq, Skv; mask backward tables with kv blocks of 128 and query
  blocks a multiple of 64. Returns [B, Sq, H, Dv]; differentiable in query, key, value, sinks.
  deterministic_backward True raises ValueError (dq is reduce-added in no fixed order).
  kernel_options: HopperOptions (or a KernelOptions): the Mosaic forward's fields and the
  backward ("cuda"; "by_mask": the CUDA or the Mosaic backward per call, from the mask).
  """
  if deterministic_backward:
    raise ValueError("deterministic_backward=True: the hopper backend's backward reduce-adds dq "
                     "in float32 in no fixed order (not bitwise reproducible); use "
                     "backend=\"mosaic\" (or backend=\"auto\", which takes it for True) for a "
                     "deterministic backward, or leave it None")
  h = query.shape[2]
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.dtype not in cuda_bwd.DTYPES or x.dtype != query.dtype:
      raise ValueError(f"{name}: {x.dtype}; the hopper backend needs bfloat16 or float16, the "
                       "same type for query, key and value")
  if key.shape[3] != query.shape[3] or (query.shape[3], value.shape[3]) not in HEAD_DIMS:
    raise ValueError(f"query / key / value: head dims {query.shape[3]} / {key.shape[3]} / "
                     f"{value.shape[3]}; the hopper backend runs (query and key, value) one of "
                     f"{HEAD_DIMS}")
  ok, why = supports_mask(mask)
  if not ok:
    raise ValueError(f"mask: {why}")
  window = mask.spec.sliding_window
  config = backend_config(kernel_options, "hopper")
  threshold = None
  if config.backward == "by_mask":
    features = [name for name, used in (("sliding_window", window is not None),
                                        ("logits_soft_cap", logits_soft_cap is not None),
                                        ("sinks", sinks is not None)) if used]
    threshold = mosaic_backward_from(query.dtype, query.shape[3], value.shape[3], features)
  cfg = _Static(scale=float(scale),
                soft_cap=0.0 if logits_soft_cap is None else float(logits_soft_cap),
                has_sinks=sinks is not None, causal=bool(mask.spec.causal),
                window=0 if window is None else int(window), deterministic=True,
                interpret=False, options=config.mosaic_forward(),
                mosaic_backward_from=threshold)
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  sinks_arr = jnp.zeros((h,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
  return _attention(cfg, query, key, value, sinks_arr, *ints, mask)
