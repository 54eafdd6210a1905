"""GPU tests of backend="triton": forward and every gradient against the float32 reference.

Run on a GPU machine (see tests/gpu/RUNS.md for the recorded runs):
    python -m pytest -m gpu tests/gpu -v -s
Skipped, with the reason, where no supported GPU (or no Triton / jax-triton pair) is present.

Every case draws fresh random inputs; errors are relative L2 (||ours - ref|| / ||ref||) with the
reference run in float32 on the same (rounded) inputs. Tolerances per dtype: 16-bit inputs round
P and dS to 16 bits before the matrix products, so bf16 (8-bit mantissa) lands near 5e-3 and
fp16 (11-bit) near 1e-3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import layouts  # noqa: E402  (tests/layouts.py: the shared layout generators)

from kvax_plugin.attention.api import flash_attention  # noqa: E402
from kvax_plugin.attention.block_mask import create_attention_mask  # noqa: E402
from kvax_plugin.attention.params import FlashAttentionParamsConfig  # noqa: E402
from kvax_plugin.attention.kernels import availability  # noqa: E402
from kvax_plugin.attention.options import KernelOptions  # noqa: E402
from kvax_plugin.attention.reference import reference_attention  # noqa: E402

_OK, _WHY = availability("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"Triton backend: {_WHY}")]

TOL = {jnp.bfloat16: 1.5e-2, jnp.float16: 4e-3, jnp.float32: 1e-4}


def _inputs(seed, b, sq, skv, h, kh, dk, dv, dtype, sinks):
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(keys[0], (b, sq, h, dk), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, skv, kh, dk), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, skv, kh, dv), jnp.float32).astype(dtype)
  cot = jax.random.normal(keys[3], (b, sq, h, dv), jnp.float32)
  s = jax.random.normal(keys[4], (h,), jnp.float32) if sinks else None
  return q, k, v, cot, s


def _grads(fn, q, k, v, s, cot):
  """(out, dq, dk, dv, dsinks) of <fn(q, k, v, s), cot>."""
  def loss(q, k, v, s):
    return jnp.sum(fn(q, k, v, s).astype(jnp.float32) * cot)
  argnums = (0, 1, 2, 3) if s is not None else (0, 1, 2)
  out = fn(q, k, v, s)
  grads = jax.grad(loss, argnums=argnums)(q, k, v, s)
  return (out,) + tuple(grads)


def _rel(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def _check(name, mine, theirs, tol):
  names = ["out", "dq", "dk", "dv", "dsinks"]
  errs = {}
  for n, a, b in zip(names, mine, theirs):
    assert bool(jnp.all(jnp.isfinite(jnp.asarray(a, jnp.float32)))), f"{name}: {n} has NaN/inf"
    errs[n] = _rel(a, b)
  print(f"\n[{name}] " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
  for n, e in errs.items():
    assert e < tol, f"{name}: {n} rel-L2 {e:.3e} >= {tol}"
  return errs


def _run(name, pos_q, seg_q, pos_kv, seg_kv, *, h=8, kh=2, dk=128, dv=None,
         dtype=jnp.bfloat16, causal=True, window=None, cap=None, sinks=False,
         memory_optimized=False, params=None, seed=0):
  dv = dv or dk
  b, sq = seg_q.shape
  skv = seg_kv.shape[1]
  q, k, v, cot, s = _inputs(seed, b, sq, skv, h, kh, dk, dv, dtype, sinks)
  ints = tuple(jnp.asarray(x, jnp.int32) for x in (pos_q, seg_q, pos_kv, seg_kv))
  kw = {} if params is None else dict(fwd_params=params[0], bwd_params=params[1])
  mask = create_attention_mask(*ints, calc_bwd_mask=True, causal=causal, sliding_window=window,
                               **kw)
  scale = dk ** -0.5

  def ours(q, k, v, s):
    return flash_attention(q, k, v, *ints, mask, scale=scale, logits_soft_cap=cap, sinks=s,
                           memory_optimized_gqa_backward=memory_optimized, backend="triton")

  def ref(q, k, v, s):
    return reference_attention(q, k, v, *ints, causal=causal, sliding_window=window, scale=scale,
                               logits_soft_cap=cap, sinks=s)

  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  mine = jax.jit(lambda *a: _grads(ours, *a, cot))(q, k, v, s)
  # The reference in exact float32 products (XLA may otherwise use TF32 on the GPU, ~4e-4
  # relative error, which would hide or fake float32 kernel errors).
  with jax.default_matmul_precision("highest"):
    theirs = jax.jit(lambda *a: _grads(ref, *a, cot))(f32(q), f32(k), f32(v), f32(s))
  # Padding rows: output and dq exactly zero.
  pad = np.asarray(seg_q) == -1
  if pad.any():
    assert float(jnp.max(jnp.abs(mine[0].astype(jnp.float32)[pad]))) == 0.0, "padding out != 0"
    assert float(jnp.max(jnp.abs(mine[1].astype(jnp.float32)[pad]))) == 0.0, "padding dq != 0"
  return _check(name, mine, theirs, TOL[dtype])


def _same(pos, seg):
  return pos, seg, pos, seg


def _rng(seed):
  return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- cases

CASES = {
    # name: (layout builder, kwargs for _run)
    "odd_length_padding_bf16": (
        lambda r: _same(*layouts.packed_documents(r, 2, 1000, num_docs=5, pad_tail=77)), {}),
    "one_token_docs_fp16_d64": (
        lambda r: _same(*layouts.packed_documents(r, 1, 517, num_docs=20, one_token_docs=8)),
        dict(dk=64, dtype=jnp.float16)),
    "non_contiguous_segments": (
        lambda r: _same(*layouts.non_contiguous_documents(r, 1, 700, num_docs=4, chunk=37)), {}),
    "huge_segment_ids": (
        lambda r: _same(*layouts.packed_documents(r, 1, 640, num_docs=6, pad_tail=30,
                                                  huge_ids=True)), {}),
    "random_positions": (
        lambda r: _same(*layouts.random_positions(r, 1, 300, num_docs=3)), {}),
    "mqa_d256": (
        lambda r: _same(*layouts.packed_documents(r, 1, 600, num_docs=3, pad_tail=10)),
        dict(h=4, kh=1, dk=256)),
    "mla_192_128": (
        lambda r: _same(*layouts.packed_documents(r, 1, 555, num_docs=3)),
        dict(h=4, kh=4, dk=192, dv=128)),
    "softcap_sinks": (
        lambda r: _same(*layouts.packed_documents(r, 1, 800, num_docs=4, pad_tail=50)),
        dict(cap=50.0 / 8, sinks=True)),
    "sliding_window": (
        lambda r: _same(*layouts.packed_documents(r, 1, 900, num_docs=2)),
        dict(window=100)),
    "window_not_causal_fp16": (
        lambda r: _same(*layouts.packed_documents(r, 1, 500, num_docs=2, pad_tail=20)),
        dict(window=64, causal=False, dtype=jnp.float16)),
    "not_causal_gqa8": (
        lambda r: _same(*layouts.packed_documents(r, 1, 480, num_docs=3)),
        dict(h=16, kh=2, causal=False)),
    "memory_optimized_gqa": (
        lambda r: _same(*layouts.packed_documents(r, 2, 700, num_docs=4, pad_tail=33)),
        dict(memory_optimized=True, sinks=True)),
    "explicit_params_64": (
        lambda r: _same(*layouts.packed_documents(r, 1, 650, num_docs=3, pad_tail=5)),
        dict(params=(FlashAttentionParamsConfig(64, 64, 4, 2),
                     FlashAttentionParamsConfig(32, 64, 4, 2)))),
    "float32_d128": (
        lambda r: _same(*layouts.packed_documents(r, 1, 700, num_docs=4, pad_tail=9)),
        dict(dtype=jnp.float32, sinks=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_reference(name):
  build, kwargs = CASES[name]
  seed = sum(map(ord, name))
  _run(name, *build(_rng(seed)), seed=seed, **kwargs)


@pytest.mark.parametrize("sq,skv", [(300, 1000), (1, 999), (1, 64)])
def test_query_shorter_than_kv(sq, skv):
  """Prefill / decode: the queries are the last sq tokens of one kv document."""
  pos_kv = np.arange(skv, dtype=np.int32)[None]
  seg_kv = np.zeros((1, skv), np.int32)
  pos_q = pos_kv[:, skv - sq:]
  seg_q = np.zeros((1, sq), np.int32)
  _run(f"sq{sq}_skv{skv}", pos_q, seg_q, pos_kv, seg_kv, seed=sq + skv)


def test_64k_many_documents_chunked_reference():
  """64k tokens, ~90 documents: checked chunk by chunk (documents never cross a 2048 chunk), so
  the S^2 reference only ever sees 2048 tokens at a time."""
  chunk, n_chunks, h, kh, d = 2048, 32, 4, 2, 64
  r = _rng(64)
  seg = np.full((1, chunk * n_chunks), -1, np.int32)
  pos = np.zeros_like(seg)
  next_id = 0
  for c in range(n_chunks):
    pad = 300 if c == n_chunks - 1 else int(r.integers(0, 40))
    p, s = layouts.packed_documents(r, 1, chunk, num_docs=int(r.integers(1, 6)), pad_tail=pad,
                                    one_token_docs=1, first_id=next_id)
    next_id = int(s.max()) + 1
    seg[:, c * chunk:(c + 1) * chunk] = s
    pos[:, c * chunk:(c + 1) * chunk] = p
  q, k, v, cot, _ = _inputs(7, 1, seg.shape[1], seg.shape[1], h, kh, d, d, jnp.bfloat16, False)
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  mask = create_attention_mask(*ints, calc_bwd_mask=True)

  def ours(q, k, v, s):
    return flash_attention(q, k, v, *ints, mask, scale=d ** -0.5, backend="triton")

  def chunked_ref(q, k, v, s):
    cut = lambda x: x.reshape((n_chunks, chunk) + x.shape[2:])
    cpos, cseg = cut(jnp.asarray(pos)), cut(jnp.asarray(seg))
    out = reference_attention(cut(q), cut(k), cut(v), cpos, cseg, cpos, cseg, scale=d ** -0.5)
    return out.reshape((1, n_chunks * chunk) + out.shape[2:])

  f32 = lambda x: x.astype(jnp.float32)
  mine = jax.jit(lambda *a: _grads(ours, *a, None, cot))(q, k, v)
  theirs = jax.jit(lambda *a: _grads(chunked_ref, *a, None, cot))(f32(q), f32(k), f32(v))
  _check("64k_many_documents", mine, theirs, TOL[jnp.bfloat16])


def test_large_grid_in_place_gqa_matches_per_head():
  """At 16k tokens and 32/8 heads the dk/dv launch sums each GQA group in place by default
  (enough programs); the per-head launch (forced by KernelOptions.triton_tiles) must agree to
  bf16 rounding, and the 64k test above checks the in-place path against the reference."""
  from kvax_plugin.attention.kernels.triton import backend as tb
  s_len, h, kh, d = 16384, 32, 8, 128
  assert tb.gqa_inplace(False, 1, kh, h // kh, s_len // 128, tb._sm_count())
  pos, seg = layouts.packed_documents(_rng(3), 1, s_len, num_docs=12, pad_tail=1000)
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  q, k, v, cot, _ = _inputs(13, 1, s_len, s_len, h, kh, d, d, jnp.bfloat16, False)
  mask = create_attention_mask(*ints, calc_bwd_mask=True)

  def ours(q, k, v, s, options=None):
    return flash_attention(q, k, v, *ints, mask, scale=d ** -0.5, backend="triton",
                           kernel_options=options)

  def per_head_ours(q, k, v, s):
    return ours(q, k, v, s, KernelOptions(triton_tiles="gqa=perhead"))

  in_place = jax.jit(lambda *a: _grads(ours, *a, None, cot))(q, k, v)
  per_head = jax.jit(lambda *a: _grads(per_head_ours, *a, None, cot))(q, k, v)
  errs = {n: _rel(a, b) for n, a, b in zip(["out", "dq", "dk", "dv"], in_place, per_head)}
  print(f"\n[in_place_vs_per_head] {errs}")
  assert errs["out"] == 0.0 and errs["dq"] == 0.0  # same kernels
  assert errs["dk"] < 5e-3 and errs["dv"] < 5e-3  # summation order, one bf16 rounding


def test_gradients_bitwise_reproducible():
  pos, seg = layouts.packed_documents(_rng(5), 1, 2000, num_docs=7, pad_tail=100)
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  q, k, v, cot, s = _inputs(11, 1, 2000, 2000, 8, 2, 128, 128, jnp.bfloat16, True)
  mask = create_attention_mask(*ints, calc_bwd_mask=True)

  def ours(q, k, v, s):
    return flash_attention(q, k, v, *ints, mask, scale=0.1, sinks=s, backend="triton")

  f = jax.jit(lambda *a: _grads(ours, *a, cot))
  first = jax.device_get(f(q, k, v, s))
  second = jax.device_get(f(q, k, v, s))
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_explicit_backend_never_falls_back():
  from kvax_plugin.attention.kernels import AUTO_ORDER, availability, resolve_backend
  runnable = [name for name in AUTO_ORDER if availability(name)[0]]
  # An explicit name that runs here resolves to itself, whatever "auto" would take.
  for name in runnable:
    assert resolve_backend(name) == name
  assert "triton" in runnable
  # "auto": the first of AUTO_ORDER that runs here ("hopper" on Hopper with nvcc).
  assert resolve_backend("auto") == runnable[0]


def test_float32_above_head_dim_128_is_refused_explicitly_and_auto_uses_jax():
  from kvax_plugin.attention.api import BackendUnavailableError
  pos, seg = layouts.packed_documents(_rng(9), 1, 200, num_docs=2)
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  q, k, v, _, _ = _inputs(9, 1, 200, 200, 4, 2, 256, 256, jnp.float32, False)
  mask = create_attention_mask(*ints)
  with pytest.raises(BackendUnavailableError, match="float32"):
    flash_attention(q, k, v, *ints, mask, backend="triton")
  with jax.default_matmul_precision("highest"):  # both sides in exact float32 products
    out = flash_attention(q, k, v, *ints, mask, backend="auto", debug=True)
    ref = reference_attention(q, k, v, *ints)
  assert _rel(out, ref) < 1e-5


def test_kernel_parts_through_split_kv_attention():
  """The Triton kernels as parts (the context-parallel overlap's path), kv in halves merged by
  split_kv_attention under jit and grad, against the float32 reference."""
  import kernel_parts_case  # tests/, on the path above
  from kvax_plugin.attention.kernels.triton import backend as triton_backend
  errs = kernel_parts_case.check(triton_backend.flash_attention_triton, s_len=2048, h=8, kh=2,
                                 d=128)
  print("\n[kernel_parts] " + " ".join(f"{e:.2e}" for e in errs))
