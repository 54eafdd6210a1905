"""NaN / inf inputs, x64, degenerate sizes and huge windows: no silent wrong results.

The non-finite contract and its checks live in nonfinite_cases.py (shared with the Triton
interpreter test, tests/test_triton_interpret.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvax_plugin as kp
from kvax_plugin.attention import arguments
from kvax_plugin.attention.block_mask import diff_below
from kvax_plugin.attention.kernels import backend_function, resolve_backend_for

import nonfinite_cases

P = kp.FlashAttentionParamsConfig


def test_jax_backend_nan_inf_follow_the_reference():
  # scale_inf / soft_cap_with_q_inf pass too; left out here to keep CI short (one compile each).
  failures = nonfinite_cases.run_cases(backend_function("jax"),
                                       option_cases=["scale_nan", "sink_nan"])
  assert not failures, "\n".join(failures)


def test_reference_backend_keeps_padding_rows_zero_under_nan():
  # The reference against itself: what remains checked is that padding rows (out and dq) stay
  # exactly 0 whatever NaN / inf the inputs or options hold.
  failures = nonfinite_cases.run_cases(backend_function("reference"), grad_propagation=False,
                                       option_cases=[])
  assert not failures, "\n".join(failures)


def test_soft_cap_nan_and_inf_are_normalised():
  # inf is the limit of cap * tanh(s / cap): no cap. NaN makes every logit NaN, as scale=nan.
  assert arguments.normalize_logit_options(0.5, math.inf) == (0.5, None)
  scale, cap = arguments.normalize_logit_options(0.5, math.nan)
  assert math.isnan(scale) and cap is None
  assert arguments.normalize_logit_options(np.float32(2.0), np.float64(30.0)) == (2.0, 30.0)
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 2, 16))
  seg = jnp.zeros((1, 16), jnp.int32)
  pos = jnp.arange(16, dtype=jnp.int32)[None]
  ref = lambda **kw: kp.reference_attention(x, x, x, pos, seg, pos, seg, **kw)
  np.testing.assert_array_equal(ref(logits_soft_cap=math.inf), ref())
  assert bool(jnp.all(jnp.isnan(ref(logits_soft_cap=math.nan))))


def _problem(b, sq, skv, h, kh, d=16, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (b, sq, h, d)).astype(dtype)
  k = jax.random.normal(ks[1], (b, skv, kh, d)).astype(dtype)
  v = jax.random.normal(ks[2], (b, skv, kh, d)).astype(dtype)
  return q, k, v


def test_x64_jax_backend_float32_and_float64():
  # JAX_ENABLE_X64: int64 positions; float64 inputs computed in float64 (forward and backward).
  # float32 inputs under x64 run the same int32 index arithmetic (what used to fail).
  with jax.enable_x64(True):
    b, s, h, kh = 1, 40, 2, 1
    seg = jnp.zeros((b, s), jnp.int64).at[:, -6:].set(-1)
    pos = jnp.arange(s)[None]
    assert pos.dtype == jnp.int64
    mask = kp.create_attention_mask(pos, seg, pos, seg, fwd_params=P(16, 16),
                                    bwd_params=P(16, 16), calc_bwd_mask=True, sliding_window=9)
    options = dict(scale=0.3, logits_soft_cap=np.float64(4.0))
    ours = lambda q, k, v: kp.flash_attention(q, k, v, pos, seg, pos, seg, mask, backend="jax",
                                              **options)
    ref = lambda q, k, v: kp.reference_attention(q, k, v, pos, seg, pos, seg, sliding_window=9,
                                                 **options)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a) ** 2)
    q, k, v = _problem(b, s, s, h, kh, dtype=jnp.float64)
    out, grads = jax.jit(jax.value_and_grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    want, want_grads = jax.jit(jax.value_and_grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-12)
    for g, w in zip(grads, want_grads):
      assert g.dtype == jnp.float64
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_float64_never_goes_to_triton():
  # "auto" skips backends without float64; an explicit "triton" names the dtype (on a GPU) or
  # the missing GPU (here): never a silent cast.
  assert resolve_backend_for("auto", jnp.float64, 64, 64) == "jax"
  with pytest.raises(kp.BackendUnavailableError):
    resolve_backend_for("triton", jnp.float64, 64, 64)


@pytest.mark.parametrize("b,sq,skv,h,kh", [(0, 8, 8, 2, 1), (1, 0, 0, 2, 1), (1, 8, 0, 2, 1),
                                           (1, 0, 8, 2, 1), (1, 8, 8, 0, 0), (1, 8, 8, 0, 1)])
@pytest.mark.parametrize("backend", ["jax", "reference"])
def test_zero_sizes_give_empty_or_zero_outputs(b, sq, skv, h, kh, backend):
  # Empty in, empty out; Skv = 0 leaves every query row with nothing to attend: zeros.
  q, k, v = _problem(b, sq, skv, h, kh)
  qi, ki = jnp.zeros((b, sq), jnp.int32), jnp.zeros((b, skv), jnp.int32)
  mask = kp.create_attention_mask(qi, qi, ki, ki, calc_bwd_mask=True)
  if 0 in (b, sq, skv):
    assert kp.mask_sparsity(mask)["blocks_total"] == 0.0
  fn = lambda q, k, v: kp.flash_attention(q, k, v, qi, qi, ki, ki, mask, backend=backend)
  out = fn(q, k, v)
  assert out.shape == (b, sq, h, 16) and not bool(jnp.any(out))
  grads = jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2))(q, k, v)
  assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
  assert not any(bool(jnp.any(g)) for g in grads)
  ref = kp.reference_attention(q, k, v, qi, qi, ki, ki)
  assert ref.shape == out.shape and not bool(jnp.any(ref))


def test_zero_kv_heads_with_query_heads_is_an_error():
  q, k, v = _problem(1, 8, 8, 2, 0)
  i = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="key/value have 0 heads but query has 2"):
    kp.flash_attention(q, k, v, i, i, i, i, kp.create_attention_mask(i, i, i, i), backend="jax")


def test_diff_below_is_exact_for_any_int32_positions():
  rng = np.random.default_rng(0)
  lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
  edge = np.array([lo, lo + 1, -1, 0, 1, hi - 1, hi], np.int64)
  a = np.concatenate([np.repeat(edge, len(edge)), rng.integers(lo, hi, 400, endpoint=True)])
  b = np.concatenate([np.tile(edge, len(edge)), rng.integers(lo, hi, 400, endpoint=True)])
  for w in (1, 7, 2**31 - 1, 2**31, 2**31 + 5, 2**32 - 1):
    got = np.asarray(diff_below(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32), w))
    np.testing.assert_array_equal(got, (a - b) < w, err_msg=f"window {w}")


def test_no_window_values():
  # Common "no window" values: 2**32 and above exclude no pair of int32 positions and are stored
  # as None; 2**31 keeps its exact meaning, which for these positions (differences < 2**31)
  # excludes nothing either.
  for window in (2**32, 2**63 - 1, np.int64(2**40), np.uint64(2**33)):
    assert arguments.normalize_window(window) is None
  assert arguments.normalize_window(np.int32(2**31 - 1)) == 2**31 - 1
  s = 40
  seg = jnp.zeros((1, s), jnp.int32)
  pos = jnp.arange(s, dtype=jnp.int32)[None] * 50_000_000  # differences up to ~1.95e9
  mask = kp.create_attention_mask(pos, seg, pos, seg, sliding_window=2**31, causal=False)
  assert mask.spec.sliding_window == 2**31
  assert kp.mask_sparsity(mask)["skipped"] == 0.0  # every block visited, as without a window
  q, k, v = _problem(1, s, s, 2, 1)
  np.testing.assert_array_equal(
      kp.reference_attention(q, k, v, pos, seg, pos, seg, causal=False, sliding_window=2**31),
      kp.reference_attention(q, k, v, pos, seg, pos, seg, causal=False))
