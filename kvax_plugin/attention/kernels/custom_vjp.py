"""The custom VJP shared by the kernel backends that bring their own backward kernels (Triton,
Mosaic GPU): residuals, the missing-backward-tables error, zero cotangents for the integer
inputs and the mask, and the sinks' gradient, which needs no kernel.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def sinks_gradient(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
  """d loss / d sinks [H] from lse and delta [B, H, Sq] (float32, natural log).

  A sink h adds exp(sink_h) to every row's softmax denominator, so its gradient is
  -sum over rows of exp(sink_h - lse) * delta: the sink's probability times what the softmax
  Jacobian subtracts (delta = rowsum(dO * O)). Rows with nothing attended have lse +inf: 0.
  """
  p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
  return (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)


def _int_zero_cotangent(x):
  return None if x is None else np.zeros(x.shape, dtype=jax.dtypes.float0)


def kernel_attention(forward: Callable, backward: Callable) -> Callable:
  """attention(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask) -> out, differentiable in
  q, k, v and sinks through the backend's own kernels.

  forward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask) -> (out, lse);
  backward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse, d_out)
  -> (dq, dk, dv, dsinks). cfg is static (hashable); positions, segment ids and the mask get zero
  cotangents.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attention(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask):
    out, _ = forward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask)
    return out

  def attention_fwd(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask):
    out, lse = forward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask)
    return out, (q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse)

  def attention_bwd(cfg, res, d_out):
    q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse = res
    if not mask.has_backward:
      raise ValueError("mask has no backward tables: build it with "
                       "create_attention_mask(..., calc_bwd_mask=True) to take gradients")
    dq, dk, dv, dsinks = backward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask, out,
                                  lse, d_out)
    int_zero = lambda tree: jax.tree.map(_int_zero_cotangent, tree)
    return (dq, dk, dv, dsinks, *map(_int_zero_cotangent, (q_pos, q_seg, kv_pos, kv_seg)),
            int_zero(mask))

  attention.defvjp(attention_fwd, attention_bwd)
  return attention
