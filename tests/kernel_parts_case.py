"""One check shared by the kernel backends' CPU tests: a backend's kernels taken as parts
(custom_vjp.capture_kernel_parts) and merged by split_kv_attention, under jit and grad, equal the
float32 reference over the whole key / value.

This is the path the overlapped context parallelism takes on a GPU (one part per kv half). It
fails at lowering ("No constant handler for type: DynamicJaxprTracer") if a part closes over a
tracer of the call that built it. Kept in a plain module so the Triton test can run
it in its interpreter subprocess.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention import split_kv_attention as split_kv
from kvax_plugin.attention.block_mask import create_attention_mask
from kvax_plugin.attention.kernels.custom_vjp import KernelParts, capture_kernel_parts
from kvax_plugin.attention.reference import reference_attention


def layout(s_len: int):
  """(pos, seg) int32 [1, s_len]: three documents, the second crossing the kv split at s_len / 2,
  the third cut by padding at the end."""
  seg = np.full((1, s_len), -1, np.int32)
  pos = np.zeros((1, s_len), np.int32)
  cuts = [0, s_len * 3 // 8, s_len * 3 // 4 - 5, s_len - 9]
  for d, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
    seg[0, a:b], pos[0, a:b] = 10 + d, np.arange(b - a)
  return jnp.asarray(pos), jnp.asarray(seg)


def split_attention(backend_fn, q, k, v, pos, seg, sinks, *, mask_kwargs=None, **opts):
  """Attention of q over k / v split into halves, each half one KernelParts of backend_fn."""
  half = k.shape[1] // 2
  mask_kwargs = mask_kwargs or {}
  masks = [create_attention_mask(pos, seg, pos[:, sl], seg[:, sl], calc_bwd_mask=True,
                                 **mask_kwargs)
           for sl in (slice(0, half), slice(half, None))]
  with capture_kernel_parts():
    parts = [backend_fn(q, k[:, sl], v[:, sl], pos, seg, pos[:, sl], seg[:, sl], m, sinks=None,
                        **opts)
             for sl, m in zip((slice(0, half), slice(half, None)), masks)]
  assert all(isinstance(p, KernelParts) for p in parts), parts
  kv = [split_kv.KvPart(k[:, sl], v[:, sl], pos[:, sl], seg[:, sl], m)
        for sl, m in zip((slice(0, half), slice(half, None)), masks)]
  return split_kv.split_kv_attention(parts[0], parts[1], q, pos, seg, kv[0], kv[1], sinks)


def outputs_and_grads(fn, q, k, v, sinks, cot):
  """(out, dq, dk, dv, dsinks) of sum(fn(q, k, v, sinks) * cot) in one forward."""
  out, vjp = jax.vjp(fn, q, k, v, sinks)
  return (out, *vjp(cot.astype(out.dtype)))


def check(backend_fn, *, s_len, h=4, kh=2, d=64, dtype=jnp.bfloat16, tol=1.5e-2, seed=0,
          **opts):
  """Split parts of backend_fn (jit + vjp) against the float32 reference; returns the relative
  L2 errors of out, dq, dk, dv, dsinks (asserted below tol)."""
  pos, seg = layout(s_len)
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (1, s_len, h, d)).astype(dtype)
  k = jax.random.normal(ks[1], (1, s_len, kh, d)).astype(dtype)
  v = jax.random.normal(ks[2], (1, s_len, kh, d)).astype(dtype)
  sinks = jax.random.normal(ks[3], (h,), jnp.float32)
  cot = jax.random.normal(ks[4], (1, s_len, h, d), jnp.float32)
  scale = d ** -0.5

  mine = jax.jit(lambda q, k, v, s: outputs_and_grads(
      lambda q, k, v, s: split_attention(backend_fn, q, k, v, pos, seg, s, scale=scale,
                                         logits_soft_cap=None, **opts),
      q, k, v, s, cot))(q, k, v, sinks)
  f32 = lambda x: x.astype(jnp.float32)
  # Jitted, with every array an argument: one compile instead of one per operation.
  theirs = jax.jit(lambda q, k, v, s, cot, pos, seg: outputs_and_grads(
      lambda q, k, v, s: reference_attention(q, k, v, pos, seg, pos, seg, causal=True,
                                             scale=scale, sinks=s),
      q, k, v, s, cot))(f32(q), f32(k), f32(v), sinks, cot, pos, seg)
  errs = []
  for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), mine, theirs):
    a, b = f32(a), f32(b)
    assert bool(jnp.all(jnp.isfinite(a))), (name, "not finite")
    errs.append(float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30)))
  assert max(errs) < tol, errs
  return errs
