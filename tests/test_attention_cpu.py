"""backend="jax" (and the public API) against the float32 reference: output and every gradient.

Compiling is most of this file's time (~5 s per program on a CPU), so the checks run through
one jitted function taking every array (and the mask) as an argument: cases of one shape and
one static setting (causal, window, soft cap, sinks or not, dtype) share its compiled programs,
whatever their layouts. One case goes through the public kvax_plugin.compare_with_reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import layouts
import kvax_plugin as kp
from kvax_plugin import FlashAttentionParamsConfig as P

FWD, BWD = P(32, 32), P(16, 32)
# Relative L2 error allowed per input dtype (outputs and gradients are rounded to it).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2, jnp.float16: 3e-3}


def _inputs(seed, b, sq, skv, h, kh, dqk, dv, dtype):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, sq, h, dqk), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, skv, kh, dqk), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, skv, kh, dv), jnp.float32).astype(dtype)
  return q, k, v


def _outputs_and_grads(fn, q, k, v, sinks, cot):
  """(out, dq, dk, dv[, dsinks]) of <fn(q, k, v, sinks), cot> in one forward."""
  if sinks is None:
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None), q, k, v)
  else:
    out, vjp = jax.vjp(fn, q, k, v, sinks)
  return (out,) + vjp(cot.astype(out.dtype))


@functools.partial(jax.jit, static_argnames=("scale", "cap"))
def _ours(q, k, v, sinks, cot, ints, mask, *, scale, cap):
  return _outputs_and_grads(lambda q, k, v, s: kp.flash_attention(
      q, k, v, *ints, mask, scale=scale, logits_soft_cap=cap, sinks=s, backend="jax"),
      q, k, v, sinks, cot)


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "cap"))
def _theirs(q, k, v, sinks, cot, ints, *, causal, window, scale, cap):
  f32 = lambda x: x.astype(jnp.float32)
  return _outputs_and_grads(lambda q, k, v, s: kp.reference_attention(
      f32(q), f32(k), f32(v), *ints, causal=causal, sliding_window=window, scale=scale,
      logits_soft_cap=cap, sinks=s), q, k, v, sinks, cot)


def _host(x):
  """x as a float64 numpy array: the checks run on the host, as eager jax ops compile a small
  program per new shape."""
  return np.asarray(x).astype(np.float64)


def _check(q, k, v, qpos, qseg, kpos, kseg, *, causal=True, window=None, dtype=jnp.float32,
           logits_soft_cap=None, sinks=None, public=False):
  """ours against the float32 reference (relative L2 per output, all finite); returns
  (ours, reference) as (out, dq, dk, dv[, dsinks]). public: through
  kvax_plugin.compare_with_reference instead (its report's numbers checked the same way)."""
  ints = tuple(jnp.asarray(x) for x in (qpos, qseg, kpos, kseg))
  mask = kp.create_attention_mask(*ints, fwd_params=FWD, bwd_params=BWD, calc_bwd_mask=True,
                                  causal=causal, sliding_window=window)
  scale = q.shape[-1] ** -0.5
  tol = TOL[dtype]
  names = ("out", "dq", "dk", "dv", "dsinks")
  if public:
    report = kp.compare_with_reference(q, k, v, *ints, mask, backend="jax", scale=scale,
                                       logits_soft_cap=logits_soft_cap, sinks=sinks)
    for name in names:
      if f"{name}_rel_l2" in report:
        assert report[f"{name}_finite"] == 1.0, f"{name} has NaN/inf"
        assert report[f"{name}_rel_l2"] < tol, f"{name}: {report}"
    return None
  cot = jax.random.normal(jax.random.PRNGKey(0), q.shape[:3] + v.shape[3:], jnp.float32)
  mine = _ours(q, k, v, sinks, cot, ints, mask, scale=scale, cap=logits_soft_cap)
  theirs = _theirs(q, k, v, sinks, cot, ints, causal=causal, window=window, scale=scale,
                   cap=logits_soft_cap)
  for name, a, b in zip(names, mine, theirs):
    a, b = _host(a), _host(b)
    assert np.all(np.isfinite(a)), f"{name} has NaN/inf"
    rel = float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))
    assert rel < tol, f"{name}: relative L2 {rel}"
  return mine, theirs


def _docs(seed, b, s, **kw):
  return layouts.packed_documents(np.random.default_rng(seed), b, s, **kw)


@pytest.mark.parametrize("h,kh,dqk,dv", [(4, 2, 64, 64), (4, 1, 128, 128), (2, 2, 256, 256),
                                         (4, 1, 192, 128)],
                         ids=["gqa-d64", "mqa-d128", "mha-d256", "mla-192-128"])
def test_head_layouts_and_dims(h, kh, dqk, dv):
  pos, seg = _docs(0, 2, 161, num_docs=5, pad_tail=23, one_token_docs=2)
  q, k, v = _inputs(1, 2, 161, 161, h, kh, dqk, dv, jnp.float32)
  # the public comparison helper once (it compiles its own programs: one case is enough)
  _check(q, k, v, pos, seg, pos, seg, public=(h, kh, dqk) == (2, 2, 256))


@pytest.mark.parametrize("variant", ["window", "softcap", "sinks", "non_causal",
                                     "non_causal_window", "all"])
def test_mask_and_logit_variants(variant):
  pos, seg = _docs(2, 2, 161, num_docs=4, pad_tail=11, one_token_docs=1)
  q, k, v = _inputs(3, 2, 161, 161, 4, 2, 64, 64, jnp.float32)
  kwargs = {}
  causal, window = True, None
  if variant in ("window", "non_causal_window", "all"):
    window = 19
  if variant in ("non_causal", "non_causal_window"):
    causal = False
  if variant in ("softcap", "all"):
    kwargs["logits_soft_cap"] = 2.0  # small cap so tanh saturates for many logits
  if variant in ("sinks", "all"):
    kwargs["sinks"] = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
  q = q * 3.0  # larger logits exercise the soft cap and the online max
  _check(q, k, v, pos, seg, pos, seg, causal=causal, window=window, **kwargs)


@pytest.mark.parametrize("layout", ["non_contiguous", "huge_ids", "random_positions",
                                    "all_padding_row"])
def test_awkward_layouts(layout):
  rng = np.random.default_rng(4)
  s = 161
  if layout == "non_contiguous":
    pos, seg = layouts.non_contiguous_documents(rng, 2, s, num_docs=3, chunk=13)
  elif layout == "huge_ids":
    pos, seg = layouts.packed_documents(rng, 2, s, num_docs=6, pad_tail=9, huge_ids=True)
  elif layout == "random_positions":
    pos, seg = layouts.random_positions(rng, 2, s, num_docs=3)
  else:
    pos, seg = layouts.packed_documents(rng, 2, s, num_docs=3, pad_tail=0)
    seg[0] = -1
  q, k, v = _inputs(5, 2, s, s, 4, 2, 64, 64, jnp.float32)
  _check(q, k, v, pos, seg, pos, seg, sinks=jnp.zeros((4,), jnp.float32) - 1.0)


@pytest.mark.parametrize("sq,skv", [(1, 150), (70, 203), (203, 70)])
def test_query_and_kv_lengths_differ(sq, skv):
  rng = np.random.default_rng(sq + skv)
  kpos, kseg = layouts.packed_documents(rng, 2, skv, num_docs=3, pad_tail=4)
  qpos = (kpos.max(axis=1, keepdims=True) - sq // 2 + np.arange(sq)[None]).astype(np.int32)
  qseg = np.repeat(kseg[:, :1], sq, axis=1)
  if sq > 1:
    qseg[:, -3:] = -1
  q, k, v = _inputs(6, 2, sq, skv, 4, 2, 64, 64, jnp.float32)
  _check(q, k, v, qpos, qseg, kpos, kseg)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_low_precision(dtype):
  pos, seg = _docs(7, 2, 161, num_docs=5, pad_tail=12, one_token_docs=1)
  q, k, v = _inputs(8, 2, 161, 161, 4, 2, 64, 64, dtype)
  _check(q, k, v, pos, seg, pos, seg, dtype=dtype, logits_soft_cap=30.0)


def test_padding_rows_are_exactly_zero_with_zero_gradients():
  # The shapes and settings of test_head_layouts_and_dims[gqa-d64] (one compiled program for
  # both), 30 padding tokens per row; the cotangent is not zero on the padding rows.
  pos, seg = _docs(9, 2, 161, num_docs=2, pad_tail=30)
  q, k, v = _inputs(10, 2, 161, 161, 4, 2, 64, 64, jnp.float32)
  (out, dq, dk, dv), _ = _check(q, k, v, pos, seg, pos, seg)
  pad = seg == -1
  assert pad.sum() == 60
  for x in (out, dq, dk, dv):
    assert np.all(np.asarray(x)[pad] == 0)
    assert np.all(np.isfinite(np.asarray(x)))


def test_attention_one_off_matches_reference_and_derives_positions():
  seg = jnp.array([[0, 0, 0, 1, 1, 0, 0, -1, -1]], jnp.int32)  # document 0 resumes after doc 1
  pos = kp.positions_from_segment_ids(seg)
  np.testing.assert_array_equal(np.asarray(pos), [[0, 1, 2, 0, 1, 3, 4, 0, 1]])
  q, k, v = _inputs(11, 1, 9, 9, 2, 1, 64, 64, jnp.float32)
  out = kp.attention(q, k, v, segment_ids=seg, backend="jax")
  ref = jax.jit(lambda q, k, v: kp.reference_attention(q, k, v, pos, seg, pos, seg,
                                                       scale=64 ** -0.5))(q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6)


def test_gradient_needs_backward_tables():
  pos, seg = _docs(12, 1, 64, num_docs=2)
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  q, k, v = _inputs(13, 1, 64, 64, 2, 1, 64, 64, jnp.float32)
  mask = kp.create_attention_mask(*ints)  # calc_bwd_mask=False
  kp.flash_attention(q, k, v, *ints, mask, backend="jax")  # forward is fine
  with pytest.raises(ValueError, match="calc_bwd_mask=True"):
    jax.grad(lambda q: jnp.sum(kp.flash_attention(q, k, v, *ints, mask, backend="jax")))(q)


def test_explicit_backend_never_falls_back():
  if any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("this machine has a GPU; the CPU-only refusal is what is tested here")
  pos, seg = _docs(14, 1, 64, num_docs=2)
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  q, k, v = _inputs(15, 1, 64, 64, 2, 1, 64, 64, jnp.float32)
  mask = kp.create_attention_mask(*ints)
  with pytest.raises(kp.BackendUnavailableError, match="triton"):
    kp.flash_attention(q, k, v, *ints, mask, backend="triton")
  assert kp.resolve_backend("auto") == "jax"


def test_jit_scan_remat_reuses_one_mask():
  """The use the mask is built for: one mask, many layers, under scan and checkpoint."""
  pos, seg = _docs(16, 2, 128, num_docs=3, pad_tail=7)
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  q, k, v = _inputs(17, 2, 128, 128, 2, 1, 64, 64, jnp.float32)

  @jax.jit
  def loss(q, k, v):
    mask = kp.create_attention_mask(*ints, fwd_params=FWD, bwd_params=BWD, calc_bwd_mask=True)

    def layer(x, _):
      return kp.flash_attention(x, k, v, *ints, mask, backend="jax") + x, None

    out, _ = jax.lax.scan(jax.checkpoint(layer), q, None, length=2)
    return jnp.sum(out ** 2)

  def ref_loss(q, k, v):
    x = q
    for _ in range(2):
      x = kp.reference_attention(x, k, v, *ints) + x
    return jnp.sum(x ** 2)

  g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(g, g_ref):
    a, b = _host(a), _host(b)
    rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    assert rel < 2e-5, rel
