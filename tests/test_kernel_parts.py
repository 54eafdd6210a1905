"""The kernel backends' forward / backward kernels taken as parts (the context-parallel overlap's
path, kvax_plugin.attention.split_kv_attention) under jit and grad: the overlapped
context-parallel op with the Mosaic GPU kernels lowered for CUDA on simulated devices, and the
parts run in Pallas' interpreter against the float32 reference (tests/kernel_parts_case.py; the
Triton kernels run the same check in tests/test_triton_interpret.py).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kvax_plugin.attention import token_order
from kvax_plugin.attention.api import create_attention_mask, flash_attention
from kvax_plugin.attention.kernels.mosaic import backend as mosaic

import kernel_parts_case
import layouts

kernels = importlib.import_module("kvax_plugin.attention.kernels")


@pytest.mark.parametrize("overlap", [False, True])
def test_context_parallel_mosaic_lowers_for_cuda_under_jit_and_grad(overlap, monkeypatch):
  """A GPU lowering failure, checked without a GPU. With the k / v gather overlapped, the op
  takes the backend's kernels as parts; parts that close over a tracer of the call that captured
  them make jit + grad of the sharded op fail at lowering with "No constant handler for type:
  DynamicJaxprTracer" (the CPU tests run backend "jax", which has no parts to capture)."""
  if len(jax.devices("cpu")) < 2:
    pytest.skip("needs 2 CPU devices (tests/conftest.py)")
  # Lowering for CUDA needs no GPU, but the op refuses an explicit backend it cannot run.
  monkeypatch.setattr(kernels, "availability", lambda name: (True, "lowering only"))
  s_len, h, kh, d, cp = 1024, 4, 2, 128, 2
  pos, seg = layouts.packed_documents(np.random.default_rng(0), 1, s_len, num_docs=3,
                                      pad_tail=40)
  mesh = Mesh(np.array(jax.devices("cpu")[:cp]), ("context",))
  kw = dict(mesh=mesh, query_specs=(None, "context", None, None), kv_specs=(None,) * 4,
            token_order="balanced")
  tok = token_order.token_order(pos, seg, cp, order="balanced", block=128)
  pos, seg = token_order.apply_token_order((jnp.asarray(pos), jnp.asarray(seg)), tok)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True,
                               overlap_kv_gather=overlap, **kw)
  assert mask.layout.overlap_kv_gather == overlap

  def fwd_bwd(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(
        q, k, v, pos, seg, pos, seg, mask, scale=d ** -0.5, backend="mosaic", **kw), q, k, v)
    return out, vjp(out)

  q = jnp.zeros((1, s_len, h, d), jnp.bfloat16)
  k = jnp.zeros((1, s_len, kh, d), jnp.bfloat16)
  text = jax.jit(fwd_bwd).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
  # forward, dq and dk / dv kernels; twice over with the overlap (local and remote parts)
  assert text.count("mosaic_gpu") >= (6 if overlap else 3)


def test_mosaic_parts_in_interpreter_match_reference():
  """The parts' contract (forward -> out, lse; backward from any merged out, lse) holds for the
  Mosaic kernels: kv split in halves, merged by split_kv_attention, under jit and grad. GQA with
  two query heads over one kv head (each head is more interpreter work)."""
  errs = kernel_parts_case.check(mosaic.flash_attention_mosaic, s_len=256, h=2, kh=1, d=64,
                                 interpret=True)
  assert max(errs) < 1.5e-2, errs  # bf16 inputs, P and dS rounded to bf16


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_as_stored_widens_to_the_narrow_values_and_says_so_to_xla(dtype):
  """custom_vjp.as_stored: the values of the 16-bit array, widened; and an explicit rounding in
  the program (XLA on the GPU may drop a narrowing whose result is widened again; the CPU keeps
  it, so only the GPU test tests/gpu/test_cotangent_rounding_gpu.py shows the difference)."""
  from kvax_plugin.attention.kernels.custom_vjp import as_stored, softmax_delta
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 3, 8)), jnp.float32)
  widened = jax.jit(lambda x: as_stored(x.astype(dtype)))(x)
  assert widened.dtype == jnp.float32
  np.testing.assert_array_equal(widened, np.asarray(x.astype(dtype), np.float32))
  assert np.any(np.asarray(widened) != np.asarray(x))
  program = jax.jit(lambda d, o: softmax_delta(d.astype(dtype), o.astype(dtype))).lower(x, x)
  assert "reduce_precision" in program.as_text()
  # float32 to float32: nothing to round, no rounding in the program
  assert "reduce_precision" not in jax.jit(as_stored).lower(x).as_text()


@pytest.mark.parametrize("backend", ["mosaic", "jax"])
def test_the_backward_rounds_the_cotangent_before_delta(backend, monkeypatch):
  """The unrounded-cotangent guard where a CPU can see it: a bf16 call's backward rounds the
  cotangent explicitly (reduce_precision to bf16's e8m7) before delta = rowsum(dO * O) reads it,
  so XLA's excess precision on the GPU cannot hand delta the unrounded float32 gradient while
  the kernels read the rounded one (the GPU side: tests/gpu/test_cotangent_rounding_gpu.py).
  Mosaic is lowered for CUDA (no GPU needed), the JAX backend for the CPU."""
  monkeypatch.setattr(kernels, "availability", lambda name: (True, "lowering only"))
  s_len, h, kh, d = 256, 4, 2, 64
  pos, seg = layouts.packed_documents(np.random.default_rng(0), 1, s_len, num_docs=3)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)

  def grads(q, k, v, cot):  # the cotangent an argument, as a training step's gradient is
    loss = lambda q, k, v: jnp.sum(flash_attention(
        q, k, v, pos, seg, pos, seg, mask, backend=backend).astype(jnp.float32) * cot)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  q = jnp.zeros((1, s_len, h, d), jnp.bfloat16)
  k = jnp.zeros((1, s_len, kh, d), jnp.bfloat16)
  cot = jnp.zeros((1, s_len, h, d), jnp.float32)
  platform = "cuda" if backend == "mosaic" else "cpu"
  text = jax.jit(grads).trace(q, k, k, cot).lower(lowering_platforms=(platform,)).as_text()
  assert "reduce_precision" in text and "e8m7" in text
