"""GPU tests of backend="mosaic" (Pallas Mosaic GPU, Hopper): forward and every gradient against
the float32 reference, both backward modes.

Run on an H100 / H200 (see tests/gpu/RUNS.md for the recorded runs):
    python -m pytest -m gpu tests/gpu/test_mosaic_gpu.py -v -s
Skipped, with the reason, where no Hopper GPU is present. Same layouts and tolerances as the
Triton GPU tests (tests/gpu/test_triton_gpu.py); errors are relative L2 against the reference
run in float32 on the same rounded inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import layouts  # noqa: E402  (tests/layouts.py: the shared layout generators)

import kvax_plugin as kvax  # noqa: E402
from mosaic_marks import MOSAIC_GPU_MARKS  # noqa: E402
from kvax_plugin.attention.kernels.mosaic import backend as mosaic_backend  # noqa: E402


pytestmark = MOSAIC_GPU_MARKS

TOL = {jnp.bfloat16: 1.5e-2, jnp.float16: 4e-3}


def _rel(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def _grads(fn, q, k, v, s, cot):
  def loss(q, k, v, s):
    return jnp.sum(fn(q, k, v, s).astype(jnp.float32) * cot)
  argnums = (0, 1, 2, 3) if s is not None else (0, 1, 2)
  return (fn(q, k, v, s),) + tuple(jax.grad(loss, argnums=argnums)(q, k, v, s))


def _run(name, pos_q, seg_q, pos_kv, seg_kv, *, h=8, kh=2, dk=128, dv=None,
         dtype=jnp.bfloat16, causal=True, window=None, cap=None, sinks=False,
         deterministic=True, seed=0, bwd_blocks=None, options=None):
  dv = dv or dk
  b, sq = seg_q.shape
  skv = seg_kv.shape[1]
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(keys[0], (b, sq, h, dk), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, skv, kh, dk), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, skv, kh, dv), jnp.float32).astype(dtype)
  cot = jax.random.normal(keys[3], (b, sq, h, dv), jnp.float32)
  s = jax.random.normal(keys[4], (h,), jnp.float32) if sinks else None
  ints = tuple(jnp.asarray(x, jnp.int32) for x in (pos_q, seg_q, pos_kv, seg_kv))
  bwd_params = (None if bwd_blocks is None
                else kvax.FlashAttentionParamsConfig(*bwd_blocks, num_warps=4, num_stages=2))
  mask = kvax.create_attention_mask(*ints, calc_bwd_mask=True, causal=causal,
                                    sliding_window=window, bwd_params=bwd_params)
  scale = dk ** -0.5

  def ours(q, k, v, s):
    return kvax.flash_attention(q, k, v, *ints, mask, scale=scale, logits_soft_cap=cap, sinks=s,
                                backend="mosaic", deterministic_backward=deterministic,
                                kernel_options=options)

  def ref(q, k, v, s):
    return kvax.reference_attention(q, k, v, *ints, causal=causal, sliding_window=window,
                                    scale=scale, logits_soft_cap=cap, sinks=s)

  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  mine = jax.jit(lambda *a: _grads(ours, *a, cot))(q, k, v, s)
  with jax.default_matmul_precision("highest"):
    theirs = jax.jit(lambda *a: _grads(ref, *a, cot))(f32(q), f32(k), f32(v), f32(s))
  pad = np.asarray(seg_q) == -1
  if pad.any():
    assert float(jnp.max(jnp.abs(mine[0].astype(jnp.float32)[pad]))) == 0.0, "padding out != 0"
    assert float(jnp.max(jnp.abs(mine[1].astype(jnp.float32)[pad]))) == 0.0, "padding dq != 0"
  names = ["out", "dq", "dk", "dv", "dsinks"]
  errs = {}
  for n, a, b_ in zip(names, mine, theirs):
    assert bool(jnp.all(jnp.isfinite(jnp.asarray(a, jnp.float32)))), f"{name}: {n} has NaN/inf"
    errs[n] = _rel(a, b_)
  print(f"\n[{name}] " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
  for n, e in errs.items():
    assert e < TOL[dtype], f"{name}: {n} rel-L2 {e:.3e} >= {TOL[dtype]}"


def _same(pos, seg):
  return pos, seg, pos, seg


CASES = {
    "odd_length_padding_bf16": (
        lambda r: _same(*layouts.packed_documents(r, 2, 1000, num_docs=5, pad_tail=77)), {}),
    "one_token_docs_fp16_d64": (
        lambda r: _same(*layouts.packed_documents(r, 1, 517, num_docs=20, one_token_docs=8)),
        dict(dk=64, dtype=jnp.float16)),
    "non_contiguous_segments": (
        lambda r: _same(*layouts.non_contiguous_documents(r, 1, 700, num_docs=4, chunk=37)), {}),
    "huge_segment_ids_fused": (
        lambda r: _same(*layouts.packed_documents(r, 1, 640, num_docs=6, pad_tail=30,
                                                  huge_ids=True)), dict(deterministic=False)),
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
    "sliding_window_fused": (
        lambda r: _same(*layouts.packed_documents(r, 1, 900, num_docs=2)),
        dict(window=100, deterministic=False)),
    "window_not_causal_fp16": (
        lambda r: _same(*layouts.packed_documents(r, 1, 500, num_docs=2, pad_tail=20)),
        dict(window=64, causal=False, dtype=jnp.float16)),
    "not_causal_gqa8": (
        lambda r: _same(*layouts.packed_documents(r, 1, 480, num_docs=3)),
        dict(h=16, kh=2, causal=False)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_reference(name):
  build, kwargs = CASES[name]
  seed = sum(map(ord, name))
  _run(name, *build(np.random.default_rng(seed)), seed=seed, **kwargs)


@pytest.mark.parametrize("sq,skv", [(300, 1000), (1, 999)])
def test_query_shorter_than_kv(sq, skv):
  pos_kv = np.arange(skv, dtype=np.int32)[None]
  seg_kv = np.zeros((1, skv), np.int32)
  _run(f"sq{sq}_skv{skv}", pos_kv[:, skv - sq:], np.zeros((1, sq), np.int32), pos_kv, seg_kv,
       seed=sq + skv)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("b,h,s_len", [(2, 2, 8192), (2, 8, 8192), (3, 1, 1000)])
def test_kvax_backward_blocks_64x128(b, h, s_len, deterministic):
  """kvax 0.1.0's Hopper default backward blocks (query 64, kv 128): causal, one document per
  row, MHA. A deterministic dq kernel that reads these tables with a zero row stride returns
  dq all zeros (B=2, H=2, 8k) or NaN (B=2, H=8, 8k)."""
  pos = np.tile(np.arange(s_len, dtype=np.int32), (b, 1))
  seg = np.zeros((b, s_len), np.int32)
  _run(f"kvax_bwd_64x128_b{b}_h{h}_{s_len}", pos, seg, pos, seg, h=h, kh=h,
       deterministic=deterministic, bwd_blocks=(64, 128), seed=b * 100 + h)


def test_fused_and_deterministic_backward_agree_and_deterministic_is_reproducible():
  """16k tokens, 32/8 heads: the two backward modes agree to rounding, and the deterministic one
  is bitwise reproducible. dk / dv are not bitwise equal between the modes: the deterministic
  dk/dv kernel folds lse / delta into its products' accumulators (backward.py, BwdConfig's
  settled choices) and the fused one does not, so their float32 rounding differs
  (tests/test_mosaic_interpret.py::test_fold_changes_dkv_rounding_only shows the size)."""
  s_len, h, kh, d = 16384, 32, 8, 128
  pos, seg = layouts.packed_documents(np.random.default_rng(3), 1, s_len, num_docs=12,
                                      pad_tail=1000)
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  keys = jax.random.split(jax.random.PRNGKey(13), 4)
  q = jax.random.normal(keys[0], (1, s_len, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, s_len, kh, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, s_len, kh, d), jnp.bfloat16)
  cot = jax.random.normal(keys[3], (1, s_len, h, d), jnp.float32)
  mask = kvax.create_attention_mask(*ints, calc_bwd_mask=True)

  def grads(det):
    def ours(q, k, v, s):
      return kvax.flash_attention(q, k, v, *ints, mask, scale=d ** -0.5, backend="mosaic",
                                  deterministic_backward=det)
    return jax.device_get(jax.jit(lambda *a: _grads(ours, *a, None, cot))(q, k, v))

  fused, det1, det2 = grads(False), grads(True), grads(True)
  for a, b_ in zip(det1, det2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
  errs = {n: _rel(a, b_) for n, a, b_ in zip(["out", "dq", "dk", "dv"], fused, det1)}
  print(f"\n[fused_vs_deterministic] {errs}")
  assert errs["out"] == 0.0
  assert errs["dq"] < 2e-3  # float32 summation order, one bf16 rounding
  assert errs["dk"] < 2e-3 and errs["dv"] < 2e-3  # the fold's float32 rounding, one bf16 rounding


# KernelOptions fields with a GPU test against the float32 reference, selected by id, e.g.
# -k "per_tile". (The defaults run in every other test.)
OPTIONS = {"persistent": dict(mosaic_forward_grid="persistent"),
           "per_tile": dict(mosaic_forward_grid="per_tile"),
           "regs240": dict(mosaic_backward_registers=240),
           "unpaired": dict(mosaic_paired_products=False),
           "id_rings": dict(mosaic_backward_id_rings=True),
           "dq_after_dkv": dict(dq_after_dkv=True)}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("name", ["odd_length_padding_bf16", "non_contiguous_segments",
                                  "one_token_docs_fp16_d64"])
def test_kernel_options_against_reference(name, option):
  """The kernels with each non-default KernelOptions field (forward grid, the backward's
  register split, unpaired products, id rings, the dq kernel's order; read while tracing)
  against the float32 reference on the GPU, before any timing of them counts."""
  build, kwargs = CASES[name]
  seed = sum(map(ord, name))
  _run(name, *build(np.random.default_rng(seed)), seed=seed, **kwargs,
       options=kvax.KernelOptions(**OPTIONS[option]))


@pytest.mark.parametrize("name", ["softcap_sinks", "sliding_window_fused", "window_not_causal_fp16",
                                  "not_causal_gqa8", "random_positions"])
def test_per_tile_forward_features_against_reference(name):
  """The per-tile forward grid (the default above backend.PERSISTENT_MAX_KV kv rows, where these
  short cases would run the persistent one) with each mask and logits feature: soft cap and
  sinks, windows causal and not, a wide GQA group, positions in any order."""
  build, kwargs = CASES[name]
  seed = sum(map(ord, name)) + 1
  _run(name, *build(np.random.default_rng(seed)), seed=seed, **kwargs,
       options=kvax.KernelOptions(mosaic_forward_grid="per_tile"))


def test_kernel_parts_through_split_kv_attention():
  """The kernels as parts (the context-parallel overlap's path, which crashes at lowering if a
  part closes over a tracer): kv in halves, merged by split_kv_attention under jit and grad,
  against the float32 reference (tests/kernel_parts_case.py)."""
  import kernel_parts_case  # tests/, on the path above
  errs = kernel_parts_case.check(mosaic_backend.flash_attention_mosaic, s_len=2048, h=8, kh=2,
                                 d=128)
  print("\n[kernel_parts] " + " ".join(f"{e:.2e}" for e in errs))
