"""benchmarks/fa3.py's glue around FlashAttention-3's varlen call, without the package: the
documents of packed rows become separate sequences (cu_seqlens from their lengths, padding
dropped, the rows of B > 1 one after another), the tokens are gathered and the output scattered
back; with a stand-in for flash_attn3_jax.flash_mha_varlen (dense causal attention within each
sequence) the result and its gradients equal dense masked attention of the packed rows. And the
peer is "unavailable: <reason>" wherever it cannot run, in the benchmark's rows too."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a package of the repository, not installed
  sys.path.insert(0, str(ROOT))

from benchmarks import cases, fa3, impls  # noqa: E402

PAD = cases.PAD


def fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=-1, max_seqlen_k=-1,
                softmax_scale=None, is_causal=False):
  """Dense attention within each sequence of tokens [T, H, D] (cu_seqlens, int32), GQA by
  repeating kv heads: what flash_mha_varlen computes, checked against its calling convention."""
  assert cu_seqlens_q.dtype == jnp.int32 and is_causal and isinstance(softmax_scale, float)
  assert q.ndim == 3 and int(cu_seqlens_q[-1]) == q.shape[0]
  lengths = np.diff(np.asarray(cu_seqlens_q))
  assert max_seqlen_q == max_seqlen_k == lengths.max()
  t = jnp.arange(q.shape[0])
  doc = jnp.searchsorted(cu_seqlens_q, t, side="right")
  keep = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
  rep = q.shape[1] // k.shape[1]
  k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
  logits = jnp.einsum("qhd,khd->hqk", q, k) * softmax_scale
  p = jax.nn.softmax(jnp.where(keep[None], logits, -jnp.inf), axis=-1)
  return jnp.einsum("hqk,khd->qhd", p, v)


def dense_reference(q, k, v, pos, seg, scale):
  """Masked attention on the packed rows [B, S, H, D]; zeros at padding queries."""
  keep = cases.dense_mask(pos, seg)  # [B, S, S]
  rep = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  p = jax.nn.softmax(jnp.where(keep[:, None], logits, -1e30), axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
  return jnp.where((jnp.asarray(seg) != PAD)[..., None, None], out, 0.0)


def two_rows():
  """Row 0: the benchmark's documents (3 of them + 16 padding); row 1: padding first, then two
  documents (segment ids 9, then 7) whose positions do not start at 0."""
  pos0, seg0, lengths0 = cases.layout("docs", 96, seed=3, num_docs=3, pad=16)
  pos1 = np.concatenate([np.zeros(6), 5 + np.arange(40), 2 + np.arange(50)]).astype(np.int32)
  seg1 = np.concatenate([np.full(6, PAD), np.full(40, 9), np.full(50, 7)]).astype(np.int32)
  return (np.concatenate([pos0, pos1[None]]), np.concatenate([seg0, seg1[None]]),
          list(lengths0) + [40, 50])


def test_varlen_layout_from_positions_and_segment_ids():
  pos, seg, lengths = two_rows()
  v = fa3.varlen_layout(pos, seg)
  assert v.cu_seqlens.dtype == np.int32
  assert list(np.diff(v.cu_seqlens)) == lengths and v.cu_seqlens[0] == 0
  assert v.max_seqlen == max(lengths) and (v.batch, v.seq) == (2, 96)
  # every non-padding token once, in order; row 1's tokens after row 0's (flat index b*S + s)
  flat_seg = seg.reshape(-1)
  assert list(v.index) == [i for i in range(2 * 96) if flat_seg[i] != PAD]
  # the tokens' documents read back from cu_seqlens: each one segment id, consecutive positions
  flat_pos = pos.reshape(-1)
  for a, b in zip(v.cu_seqlens[:-1], v.cu_seqlens[1:]):
    assert len(set(flat_seg[v.index[a:b]])) == 1
    assert list(np.diff(flat_pos[v.index[a:b]])) == [1] * (b - a - 1)
  with pytest.raises(ValueError, match="expected both"):
    fa3.varlen_layout(pos[0], seg)
  # what FA3's sequences cannot say: one document in two runs, positions that restart
  with pytest.raises(ValueError, match="comes back after another"):
    fa3.varlen_layout(np.arange(6)[None], np.array([[1, 1, 2, 2, 1, 1]]))
  with pytest.raises(ValueError, match="do not count up by one"):
    fa3.varlen_layout(np.array([[0, 1, 2, 0, 1, 2]]), np.zeros((1, 6), np.int32))


def test_gather_scatter_round_trip_zeros_padding():
  pos, seg, _ = two_rows()
  v = fa3.varlen_layout(pos, seg)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 96, 3, 4)), jnp.float32)
  t = fa3.gather_tokens(x, v)
  assert t.shape == (len(v.index), 3, 4)
  back = np.asarray(fa3.scatter_tokens(t, v))
  real = (seg != PAD)[..., None, None]
  np.testing.assert_array_equal(back, np.where(real, np.asarray(x), 0.0))


def test_documents_through_a_stand_in_varlen_equal_dense_attention():
  pos, seg, _ = two_rows()
  rng = np.random.default_rng(1)
  shape_q, shape_kv = (2, 96, 4, 16), (2, 96, 2, 16)  # GQA: 4 query heads, 2 kv heads
  q, k, v, cot = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                  for s in (shape_q, shape_kv, shape_kv, shape_q))
  scale = 0.25
  fn = fa3.documents_fn(fake_varlen, pos, seg, scale)
  np.testing.assert_allclose(fn(q, k, v), dense_reference(q, k, v, pos, seg, scale),
                             atol=2e-5, rtol=2e-5)

  def loss(f):
    return lambda q, k, v: jnp.sum(f(q, k, v) * cot)
  got = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(lambda q, k, v: dense_reference(q, k, v, pos, seg, scale)),
                  argnums=(0, 1, 2))(q, k, v)
  for g, w, name in zip(got, want, "qkv"):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")
  # padding tokens get no gradient through the gather
  assert float(jnp.abs(got[0][1, :6]).max()) == 0.0


def test_kept_pairs_are_the_documents_causal_pairs():
  """FA3's effective TFLOP/s use our kept-pairs count: the causal pairs of its sequences."""
  pos, seg, lengths = cases.layout("docs", 4096, seed=4096, num_docs=12, pad=1000)
  v = fa3.varlen_layout(pos, seg)
  seqs = np.diff(v.cu_seqlens).astype(np.int64)
  assert cases.kept_pairs(lengths) == int(np.sum(seqs * (seqs + 1) // 2))
  assert int(np.asarray(cases.dense_mask(pos, seg)).sum()) == cases.kept_pairs(lengths)


class _Device:
  def __init__(self, platform, cc=""):
    self.platform, self.compute_capability = platform, cc


def test_unavailable_reasons():
  assert "needs a CUDA GPU (JAX platform: cpu)" in fa3.unavailable(128, 128, _Device("cpu"))
  assert "sm_90 only (this GPU: sm_8.0)" in fa3.unavailable(128, 128, _Device("gpu", "8.0"))
  assert "head dim (128,) only (here 64/64)" in fa3.unavailable(64, 64, _Device("gpu", "9.0"))
  assert "head dim" in fa3.unavailable(192, 128, _Device("gpu", "9.0"))
  why = fa3.unavailable(128, 128, _Device("gpu", "9.0"), module_name="no_such_fa3_module")
  assert why.startswith("unavailable: no_such_fa3_module does not import (ModuleNotFoundError")
  assert fa3.unavailable(128, 128, _Device("gpu", "9.0"), module_name="json") is None


def test_benchmark_rows_record_fa3_unavailable():
  """In the benchmark, a peer that cannot run is a row with its reason, not a crash or a gap."""
  pos, seg, _ = cases.layout("causal", 128, seed=0)
  fns, _ = impls.make_impls("causal", pos, seg, 128 ** -0.5, ("jax", "fa3"), heads=2,
                            head_dims=(128, 128))
  assert callable(fns["jax"]) and fns["fa3"].startswith("unavailable: ")
  assert "fa3" in impls.PEERS and impls.PEER_NAMES["fa3"] == "FA3"


def test_the_installed_package_takes_these_calls():
  """With flash-attn3-jax installed (the GPU runs carry its wheel), its forward and gradient
  trace with the arguments the benchmark gives, shapes and dtypes as ours (abstract evaluation:
  no GPU needed)."""
  mod = pytest.importorskip(fa3.MODULE)
  pos, seg, _ = cases.layout("docs", 2048, seed=0, num_docs=12, pad=100)
  q = jax.ShapeDtypeStruct((1, 2048, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16)
  for fn in (fa3.documents_fn(mod.flash_mha_varlen, pos, seg, 128 ** -0.5),
             lambda q, k, v: mod.flash_mha(q, k, v, softmax_scale=128 ** -0.5, is_causal=True)):
    assert jax.eval_shape(fn, q, kv, kv) == q
    grads = jax.eval_shape(jax.grad(lambda q, k, v, fn=fn: jnp.sum(
        fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)), q, kv, kv)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]
