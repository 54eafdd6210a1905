"""The custom VJP shared by the kernel backends with their own backward kernels (Triton, Mosaic
GPU): residuals, zero cotangents for the integer inputs and the mask, the sinks' gradient.

It also hands out a backend's kernels as `KernelParts` (forward returning out and lse, backward
taking them) for callers merging several attention calls (split_kv_attention): a backend's
public function called inside `capture_kernel_parts()` returns its parts instead of running.
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

# The name the forward's residuals (the output and the log-sum-exp) carry: MaxText's name for
# the attention output and its lse. A rematerialization policy that saves it (MaxText's
# remat_policy minimal_with_context / save_dot_with_context_except_mlp, or
# jax.checkpoint_policies.save_only_these_names("context")) keeps them from the forward pass,
# so the backward does not run the forward kernel again; policies that do not name it
# (MaxText's default "full") recompute it as before.
RESIDUAL_NAME = "context"


def saved_residuals(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The forward kernel's (out, lse) as residuals: named RESIDUAL_NAME, behind an optimization
  barrier.

  Why the barrier: when a remat policy saves them inside a scan over layers (MaxText's
  minimal_with_context), JAX stacks them with a dynamic-update-slice per layer, and XLA's GPU
  dynamic-slice fusion then builds a fusion of "kernel custom call + that update" so the kernel
  writes straight into the stacked buffer. The custom call also feeds the rest of the layer, so
  XLA keeps it there as well and CLONES it into the fusion: the forward kernel runs twice per
  layer. The barrier stands between the kernel and the update, so the pattern no longer matches
  and the update is an ordinary copy of out (benchmarks/tools/remat_clone_check.py,
  tests/gpu/test_remat_gpu.py).
  """
  out, lse = jax.lax.optimization_barrier((out, lse))
  return checkpoint_name(out, RESIDUAL_NAME), checkpoint_name(lse, RESIDUAL_NAME)


def as_stored(x: jax.Array, dtype=jnp.float32) -> jax.Array:
  """x widened to `dtype`, holding exactly the values of x's own (narrower) float type.

  Why not just x.astype(dtype): XLA may skip a narrowing conversion whose result is widened
  again (its xla_allow_excess_precision, on by default). The backward's cotangent d_out is such
  a narrowing (the float32 gradient rounded to the output's bf16 / fp16), so d_out.astype(float32)
  can read the float32 values from before the rounding, while the kernels read the rounded
  d_out. delta = rowsum(dO * O) then no longer matches the kernels' dP = dO V: on a row that
  sees one key dS = P (dP - delta) is 0 in exact arithmetic and would hold bf16's rounding of
  dO V instead (a constant cotangent is rounded at compile time and hides this).
  Rounding to x's format again is idempotent on x's values and survives that rewrite.
  """
  wide = x.astype(dtype)
  narrow, target = jnp.finfo(x.dtype), jnp.finfo(dtype)
  if narrow.nmant >= target.nmant and narrow.nexp >= target.nexp:
    return wide
  return jax.lax.reduce_precision(wide, exponent_bits=narrow.nexp, mantissa_bits=narrow.nmant)


def softmax_delta(d_out: jax.Array, out: jax.Array) -> jax.Array:
  """delta [B, H, Sq] float32 = rowsum(dO * O), what softmax's Jacobian subtracts
  (FlashAttention-2, sec. 3.1), from d_out / out [B, Sq, H, Dv] as the kernels read them
  (as_stored: not from values XLA kept wider)."""
  return jnp.einsum("bshd,bshd->bhs", as_stored(d_out), as_stored(out))


def sinks_gradient(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
  """d loss / d sinks [H] from lse and delta [B, H, Sq] (float32, natural log).

  A sink h adds exp(sink_h) to every row's softmax denominator, so its gradient is
  -sum over rows of exp(sink_h - lse) * delta: the sink's probability times what the softmax
  Jacobian subtracts (delta = rowsum(dO * O)). Rows with nothing attended have lse +inf: 0.
  """
  p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
  return (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)


class KernelParts(NamedTuple):
  """One backend's kernels for attention calls of one configuration, without sinks.

  forward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask) -> (out [B, Sq, H, Dv], lse [B, H, Sq]):
    out in the input dtype or wider, lse float32 (or wider) natural-log softmax denominators,
    +inf for rows with nothing attended (out 0 there).
  backward(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse, d_out) -> (dq, dk, dv): the
    gradients of the pairs this call's mask keeps, given any (out, lse) the softmax is
    normalised by (delta = rowsum(d_out * out), P = exp(s - lse)); dtypes the input's or wider.
  Shapes as the backend's public function (q [B, Sq, H, Dqk], k / v [B, Skv, K, D]).
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
  """True inside capture_kernel_parts() (backends without kernel_attention check it)."""
  return _CAPTURE_PARTS.get()


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

    # The parts run later, inside the caller's own traces (its custom_vjp's forward and
    # backward), so they must not close over `sinks`: the backend made it (zeros, unused with
    # has_sinks False) in the trace of THIS call, and a tracer captured from there leaks into
    # theirs ("No constant handler for type: DynamicJaxprTracer" under jit on the GPU).
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
