"""The custom VJP shared by the backends with their own backward kernels: residuals, zero
cotangents for the integer inputs and the mask, the sinks' gradient. Inside
`capture_kernel_parts()` a backend's public function returns its `KernelParts` instead of
running (for split_kv_attention).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

# The residuals' (out, lse) name, MaxText's for the attention output: a remat policy saving it
# (e.g. minimal_with_context) spares the backward a second forward kernel.
RESIDUAL_NAME = "context"


def saved_residuals(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The forward kernel's (out, lse) as residuals: named RESIDUAL_NAME, behind an optimization
  barrier. Without it, when a remat policy saves them inside a scan, XLA's dynamic-slice fusion
  clones the kernel into the stacking update and the forward runs twice per layer
  (tests/gpu/test_remat_gpu.py)."""
  out, lse = jax.lax.optimization_barrier((out, lse))
  return checkpoint_name(out, RESIDUAL_NAME), checkpoint_name(lse, RESIDUAL_NAME)


def as_stored(x: jax.Array, dtype=jnp.float32) -> jax.Array:
  """x widened to `dtype`, holding exactly the values of x's own float type. x.astype(dtype) may
  not: XLA (xla_allow_excess_precision) can skip a narrowing that is widened again, so d_out
  would read pre-rounding values and delta would not match the kernels' dP = dO V."""
  wide = x.astype(dtype)
  narrow, target = jnp.finfo(x.dtype), jnp.finfo(dtype)
  if narrow.nmant >= target.nmant and narrow.nexp >= target.nexp:
    return wide
  return jax.lax.reduce_precision(wide, exponent_bits=narrow.nexp, mantissa_bits=narrow.nmant)


def softmax_delta(d_out: jax.Array, out: jax.Array) -> jax.Array:
  """delta [B, H, Sq] float32 = rowsum(dO * O), from d_out / out [B, Sq, H, Dv] as the kernels
  read them (as_stored)."""
  return jnp.einsum("bshd,bshd->bhs", as_stored(d_out), as_stored(out))


def sinks_gradient(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
  """d loss / d sinks [H] = -sum over rows of exp(sink_h - lse) * delta, from lse and delta
  [B, H, Sq] (float32, natural log); rows with lse +inf contribute 0."""
  p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
  return (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)


class KernelParts(NamedTuple):
  """One backend's kernels for attention calls of one configuration, without sinks.

  forward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask) -> (out [B, Sq, H, Dv], lse [B, H, Sq]):
    lse float32 (or wider) natural-log, +inf for rows with nothing attended (out 0 there).
  backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse, d_out) -> (dq, dk, dv) of the
    pairs the mask keeps, for any (out, lse) the softmax is normalised by.
  """

  forward: Callable[..., tuple[Any, Any]]
  backward: Callable[..., tuple[Any, Any, Any]]


_CAPTURE_PARTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvax_plugin_capture_kernel_parts", default=False)


@contextlib.contextmanager
def capture_kernel_parts() -> Iterator[None]:
  """Inside this context a backend's public function returns its KernelParts (no sinks)."""
  token = _CAPTURE_PARTS.set(True)
  try:
    yield
  finally:
    _CAPTURE_PARTS.reset(token)


def capturing_kernel_parts() -> bool:
  return _CAPTURE_PARTS.get()


def _int_zero_cotangent(x):
  return None if x is None else np.zeros(x.shape, dtype=jax.dtypes.float0)


def kernel_attention(forward: Callable, backward: Callable) -> Callable:
  """attention(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask) -> out, differentiable in
  q, k, v and sinks: forward(...) -> (out, lse); backward(..., out, lse, d_out) -> (dq, dk, dv,
  dsinks). cfg is static; ids and the mask get zero cotangents."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attention(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask):
    out, _ = forward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask)
    return out

  def attention_fwd(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask):
    out, lse = forward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask)
    out, lse = saved_residuals(out, lse)
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

  def call(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask):
    if not _CAPTURE_PARTS.get():
      return attention(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask)
    if getattr(cfg, "has_sinks", False):
      raise ValueError("kernel parts are built without sinks (the caller merging the parts adds "
                       "them): call the backend with sinks=None inside capture_kernel_parts()")

    # The parts run inside the caller's traces, so they must not close over `sinks` (a tracer of
    # this call's trace would leak into theirs).
    sinks_shape, sinks_dtype = np.shape(sinks), getattr(sinks, "dtype", jnp.float32)
    no_sinks = lambda: jnp.zeros(sinks_shape, sinks_dtype)

    def part_forward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask):
      return forward(cfg, q, k, v, no_sinks(), q_pos, q_seg, kv_pos, kv_seg, mask)

    def part_backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse, d_out):
      dq, dk, dv, _ = backward(cfg, q, k, v, no_sinks(), q_pos, q_seg, kv_pos, kv_seg, mask,
                               out, lse, d_out)
      return dq, dk, dv

    return KernelParts(part_forward, part_backward)

  return call
