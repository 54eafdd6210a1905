"""Every bad input gets a clear error that names the argument."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvax_plugin as kp
from kvax_plugin import FlashAttentionParamsConfig as P

B, S, H, K, D = 2, 64, 4, 2, 64


def _ok():
  q = jnp.ones((B, S, H, D), jnp.float32)
  k = jnp.ones((B, S, K, D), jnp.float32)
  v = jnp.ones((B, S, K, D), jnp.float32)
  pos = jnp.tile(jnp.arange(S, dtype=jnp.int32), (B, 1))
  seg = jnp.zeros((B, S), jnp.int32)
  return q, k, v, pos, seg


def _call(q=None, k=None, v=None, qpos=None, qseg=None, kpos=None, kseg=None, mask=None, **kw):
  q0, k0, v0, pos0, seg0 = _ok()
  q, k, v = (q0 if q is None else q), (k0 if k is None else k), (v0 if v is None else v)
  qpos = pos0 if qpos is None else qpos
  qseg = seg0 if qseg is None else qseg
  kpos = pos0 if kpos is None else kpos
  kseg = seg0 if kseg is None else kseg
  if mask is None:
    mask = kp.create_attention_mask(pos0, seg0, pos0, seg0)
  kw.setdefault("backend", "jax")
  return kp.flash_attention(q, k, v, qpos, qseg, kpos, kseg, mask, **kw)


@pytest.mark.parametrize("arg,value,exc,match", [
    ("q", jnp.ones((B, S, H * D)), ValueError, "query must be a .batch, seq_len, heads, head_dim"),
    ("k", jnp.ones((S, K, D)), ValueError, "key must be"),
    ("v", jnp.ones((B, S, K, D, 1)), ValueError, "value must be"),
    ("q", jnp.ones((B + 1, S, H, D)), ValueError, "batch mismatch"),
    ("k", jnp.ones((B, S + 1, K, D)), ValueError, "key .* and value .* must agree"),
    ("q", jnp.ones((B, S, 3, D)), ValueError, r"query heads \(3\) must be a multiple of"),
    ("k", jnp.ones((B, S, K, 32)), ValueError, "key head dim 32 must equal query head dim"),
    ("q", jnp.ones((B, S, H, D), jnp.int32), TypeError, "query must be float32, bfloat16"),
    ("q", jnp.ones((B, S, H, D), jnp.bfloat16), TypeError, "must share a dtype"),
    ("qseg", jnp.zeros((B, S), jnp.float32), TypeError, "query_segment_ids must hold integers"),
    ("kpos", jnp.zeros((B, S), jnp.float32), TypeError, "kv_positions must hold integers"),
    ("qpos", jnp.zeros((B, S + 1), jnp.int32), ValueError, "query_positions has shape"),
    ("kseg", jnp.zeros((S,), jnp.int32), ValueError, "kv_segment_ids must be a .batch, seq_len"),
])
def test_bad_arrays(arg, value, exc, match):
  with pytest.raises(exc, match=match):
    _call(**{arg: value})


@pytest.mark.parametrize("dim", [8, 24, 300])
def test_unsupported_head_dim(dim):
  q = jnp.ones((B, S, H, dim))
  k = jnp.ones((B, S, K, dim))
  with pytest.raises(ValueError, match=f"head dim {dim} is unsupported"):
    _call(q=q, k=k)
  with pytest.raises(ValueError, match=f"value head dim {dim} is unsupported"):
    _call(v=jnp.ones((B, S, K, dim)))


def test_mask_built_for_other_shapes():
  q0, k0, v0, pos, seg = _ok()
  short = kp.create_attention_mask(pos[:, :32], seg[:, :32], pos[:, :32], seg[:, :32])
  with pytest.raises(ValueError, match="mask was built for batch 2, query length 32"):
    _call(mask=short)
  with pytest.raises(TypeError, match="mask must be an AttentionMask"):
    _call(mask={"fwd": None})
  mask = kp.create_attention_mask(pos, seg, pos, seg, fwd_params=P(64, 64))
  with pytest.raises(ValueError, match="fwd_params .* differ from the mask's"):
    _call(mask=mask, fwd_params=P(32, 32))


def test_bad_options():
  with pytest.raises(ValueError, match="logits_soft_cap must be a positive float"):
    _call(logits_soft_cap=-1.0)
  with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
    _call(sinks=jnp.zeros((3,)))
  with pytest.raises(TypeError, match="sinks must be floating point"):
    _call(sinks=jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="backend must be one of"):
    _call(backend="cuda")
  with pytest.raises(TypeError, match="scale must be a Python or NumPy real number, got Array"):
    _call(scale=jnp.ones(()))


def test_bad_mask_arguments():
  _, _, _, pos, seg = _ok()
  with pytest.raises(ValueError, match="sliding_window must be an integer >= 1, got 0"):
    kp.create_attention_mask(pos, seg, pos, seg, sliding_window=0)
  with pytest.raises(TypeError, match="query_segment_ids must hold integers"):
    kp.create_attention_mask(pos, seg.astype(jnp.float32), pos, seg)
  with pytest.raises(ValueError, match="batch of the query"):
    kp.create_attention_mask(pos, seg, pos[:1], seg[:1])
  with pytest.raises(ValueError, match="kv_positions .* and kv_segment_ids .* same shape"):
    kp.create_attention_mask(pos, seg, pos, seg[:, :10])
  with pytest.raises(ValueError, match="query_block_size must be a power of two"):
    P(query_block_size=48)


def test_attention_one_off_rejects_mismatched_lengths():
  q = jnp.ones((1, 8, 2, 64))
  kv = jnp.ones((1, 16, 2, 64))
  with pytest.raises(ValueError, match="use create_attention_mask"):
    kp.attention(q, kv, kv, backend="jax")
  with pytest.raises(TypeError, match="segment_ids must hold integers"):
    kp.attention(q, q, q, segment_ids=np.zeros((1, 8), np.float32), backend="jax")


def test_numpy_scalars_are_accepted_where_python_numbers_are():
  p = P(np.int64(64), np.int32(32), np.int64(4), np.array(2))
  assert p == P(64, 32, 4, 2) and hash(p) == hash(P(64, 32, 4, 2))
  assert all(type(getattr(p, f)) is int for f in ("query_block_size", "kv_block_size",
                                                  "num_warps", "num_stages"))
  _, _, _, pos, seg = _ok()
  mask = kp.create_attention_mask(pos, seg, pos, seg, fwd_params=p, sliding_window=np.int64(16),
                                  causal=np.bool_(True))
  assert mask.spec.sliding_window == 16 and type(mask.spec.sliding_window) is int
  out = _call(mask=mask, fwd_params=P(64, 32, 4, 2), scale=np.float32(0.125),
              logits_soft_cap=np.float32(30.0), backend="reference")
  assert out.shape == (B, S, H, D)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(scale="0.1"), TypeError, "scale must be a Python or NumPy real number, got str '0.1'"),
    (dict(scale=True), TypeError, "scale must be a Python or NumPy real number, got bool"),
    (dict(logits_soft_cap=np.array([30.0])), TypeError,
     r"logits_soft_cap must be a Python or NumPy real number, got ndarray of shape \(1,\)"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be a positive float or None"),
    (dict(fwd_params={"query_block_size": 64}), TypeError,
     "fwd_params must be a FlashAttentionParamsConfig or None, got dict"),
    (dict(bwd_params=(64, 64)), TypeError,
     "bwd_params must be a FlashAttentionParamsConfig or None, got tuple"),
])
def test_bad_scalar_options_name_the_argument(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    _call(backend="reference", **kwargs)


def test_bad_mask_options_name_the_argument():
  _, _, _, pos, seg = _ok()
  make = lambda **kw: kp.create_attention_mask(pos, seg, pos, seg, **kw)
  with pytest.raises(TypeError, match="FlashAttentionParamsConfig.query_block_size must be a "
                     "Python or NumPy integer, got str '64'"):
    P(query_block_size="64")
  with pytest.raises(TypeError, match="kv_block_size must be a Python or NumPy integer, got "
                     "float32"):
    P(kv_block_size=np.float32(64))
  with pytest.raises(ValueError, match="num_warps must be an integer >= 1, got 0"):
    P(num_warps=0)
  with pytest.raises(TypeError, match="sliding_window must be a Python or NumPy integer, got "
                     "float 16.0"):
    make(sliding_window=16.0)
  with pytest.raises(TypeError, match="sliding_window must be a Python or NumPy integer, got "
                     "bool"):
    make(sliding_window=True)
  with pytest.raises(TypeError, match="causal must be a bool, got str 'yes'"):
    make(causal="yes")
  with pytest.raises(TypeError, match="fwd_params must be a FlashAttentionParamsConfig or None, "
                     "got dict"):
    make(fwd_params={"query_block_size": 64})


def test_draw_mask_and_balance_report_errors(tmp_path):
  _, _, _, pos, seg = _ok()
  mask = kp.create_attention_mask(pos, seg, pos, seg)
  with pytest.raises(ValueError, match=r"view must be one of \('fwd', 'dq', 'dkv'\).*got 'bwd'"):
    kp.draw_mask(mask, str(tmp_path / "m.png"), view="bwd")
  with pytest.raises(ValueError, match="view='dq' is absent: build the mask with calc_bwd_mask"):
    kp.draw_mask(mask, str(tmp_path / "m.png"), view="dq")
  with pytest.raises(ValueError, match="batch_index 2 is out of range for a mask of batch 2"):
    kp.draw_mask(mask, str(tmp_path / "m.png"), batch_index=2)
  with pytest.raises(TypeError, match="mask must be an AttentionMask"):
    kp.draw_mask({"fwd": None}, str(tmp_path / "m.png"))
  with pytest.raises(ValueError, match="cp must be an integer >= 1, got 0"):
    kp.context_parallel_balance(pos, seg, 0, permute=True)
  with pytest.raises(TypeError, match="cp must be a Python or NumPy integer, got str"):
    kp.context_parallel_balance(pos, seg, "2", permute=True)
  with pytest.raises(ValueError, match="must both be .batch, seq_len. arrays of one shape"):
    kp.context_parallel_balance(pos[0], seg[0], 2, permute=True)


def test_reference_rejects_integer_and_malformed_inputs():
  q, k, v, pos, seg = _ok()
  ref = lambda q=q, k=k, v=v, **kw: kp.reference_attention(q, k, v, pos, seg, pos, seg, **kw)
  with pytest.raises(TypeError, match="query must be float32, bfloat16, float16"):
    ref(q=q.astype(jnp.int32), k=k.astype(jnp.int32), v=v.astype(jnp.int32))
  with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key/value heads"):
    ref(k=jnp.ones((B, S, 3, D)), v=jnp.ones((B, S, 3, D)))
  with pytest.raises(TypeError, match="kv_segment_ids must hold integers"):
    kp.reference_attention(q, k, v, pos, seg, pos, seg.astype(jnp.float32))
  with pytest.raises(TypeError, match="scale must be a Python or NumPy real number"):
    ref(scale=jnp.ones(()))
  # Head dims the kernels do not support are fine for the reference.
  x = jnp.ones((B, S, 2, 8))
  assert kp.reference_attention(x, x, x, pos, seg, pos, seg).shape == (B, S, 2, 8)
