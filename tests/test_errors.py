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
