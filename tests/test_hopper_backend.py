"""backend="hopper" (kernels/hopper.py: the Mosaic forward with the CUDA C++ fused backward) on the
CPU: what it declares, what it refuses and how the refusal reads. It runs in
tests/gpu/test_cuda_sm90_gpu.py (a Hopper GPU and the built shared object)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

import kvax_plugin as kp
from kvax_plugin.attention.block_mask import FlashAttentionParamsConfig, create_attention_mask
from kvax_plugin.attention.kernels import (AUTO_ORDER, BACKENDS, BackendUnavailableError,
                                           KERNEL_BACKENDS, supports_inputs)
from kvax_plugin.attention.kernels import hopper
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as cuda_bwd


def _ids(s, b=1):
  pos = jnp.tile(jnp.arange(s, dtype=jnp.int32)[None], (b, 1))
  return pos, jnp.zeros((b, s), jnp.int32)


def test_registered_by_name_only():
  assert "hopper" in KERNEL_BACKENDS and "hopper" in BACKENDS
  assert "hopper" not in AUTO_ORDER  # slower than "mosaic" on short documents (session 19)


@pytest.mark.parametrize("dtype, dims, features, message", [
    (jnp.bfloat16, (128, 128), ("causal", "gqa", "backward"), None),
    (jnp.float16, (128, 128), (), "float16 inputs are not supported"),
    (jnp.bfloat16, (64, 64), (), r"head dims \(64, 64\) are not supported"),
    (jnp.bfloat16, (192, 128), (), r"head dims \(192, 128\) are not supported"),
    (jnp.bfloat16, (128, 128), ("logits_soft_cap",), "logits_soft_cap not supported"),
    (jnp.bfloat16, (128, 128), ("sinks",), "sinks not supported"),
    (jnp.bfloat16, (128, 128), ("sliding_window",), "sliding_window not supported"),
])
def test_capabilities(dtype, dims, features, message):
  ok, why = supports_inputs("hopper", dtype, *dims, features)
  if message is None:
    assert ok, why
  else:
    assert not ok and why.endswith("by the hopper backend")
    assert re.search(message, why), why


def test_mask_rule():
  pos, seg = _ids(512)
  assert hopper.supports_mask(create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True))[0]
  window = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, sliding_window=128)
  ok, why = hopper.supports_mask(window)
  assert not ok and "sliding-window" in why
  large = create_attention_mask(
      pos, seg, pos, seg, calc_bwd_mask=True,
      bwd_params=FlashAttentionParamsConfig(query_block_size=128, kv_block_size=256))
  ok, why = hopper.supports_mask(large)  # the Mosaic kernels take it; the fused tile does not
  assert not ok and "kv blocks of 128" in why, why


def test_device_check_names_the_missing_build(monkeypatch, tmp_path):
  cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
  assert not hopper.device_supported(cpu)[0]
  h100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0")
  monkeypatch.setattr(cuda_bwd, "LIB", tmp_path / "libkvax_sm90_bwd.so")
  ok, why = hopper.device_supported(h100)
  assert not ok and "is not built" in why and "kernels.cuda_sm90.build" in why
  (tmp_path / "libkvax_sm90_bwd.so").write_bytes(b"")
  assert hopper.device_supported(h100) == (True, "")
  a100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA A100", compute_capability="8.0")
  assert not hopper.device_supported(a100)[0]


def test_explicit_request_on_cpu_raises():
  pos, seg = _ids(256)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
  k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  with pytest.raises(BackendUnavailableError, match='backend="hopper" was requested'):
    kp.flash_attention(q, k, k, pos, seg, pos, seg, mask, scale=0.1, backend="hopper")


def test_direct_call_names_what_it_does_not_cover():
  pos, seg = _ids(256)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
  k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  call = lambda q, k, v, m=mask, **kw: hopper.flash_attention_hopper(
      q, k, v, pos, seg, pos, seg, m, scale=0.1, **{"logits_soft_cap": None, "sinks": None, **kw})
  with pytest.raises(ValueError, match="logits_soft_cap=30.0: not supported"):
    call(q, k, k, logits_soft_cap=30.0)
  with pytest.raises(ValueError, match="sinks: not supported"):
    call(q, k, k, sinks=jnp.zeros((4,), jnp.float32))
  with pytest.raises(ValueError, match="query: float16 with head dim 128"):
    call(q.astype(jnp.float16), k, k)
  with pytest.raises(ValueError, match="value: bfloat16 with head dim 64"):
    call(q, k, k[..., :64])
  pos2, seg2 = _ids(320)  # Sq != Skv is taken (S20A checked it); lengths off 128 are not
  k2 = jnp.zeros((1, 320, 2, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="query length 256, key length 320: .*multiple of 128"):
    hopper.flash_attention_hopper(q, k2, k2, pos, seg, pos2, seg2, mask, scale=0.1,
                                  logits_soft_cap=None, sinks=None)
  window = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, sliding_window=64)
  with pytest.raises(ValueError, match="mask: a sliding-window mask"):
    call(q, k, k, m=window)


def test_variant_hook_is_checked(monkeypatch):
  monkeypatch.setenv(hopper.VARIANT_ENV, "v6")
  assert hopper._variant() == "v6"
  monkeypatch.setenv(hopper.VARIANT_ENV, "v1")
  with pytest.raises(ValueError, match=r"KVAX_HOPPER_BWD_VARIANT='v1': expected one of"):
    hopper._variant()
  monkeypatch.delenv(hopper.VARIANT_ENV)
  assert hopper._variant() == hopper.VARIANT == "v7"


def test_a_deterministic_backward_is_refused_not_ignored(monkeypatch):
  """hopper's backward reduce-adds dq in float32 in no fixed order: deterministic_backward=True
  names the argument and the backend that has one, through the public op too (the option
  reaches hopper: registry options); None (the default: the backend's own) and False pass
  these checks."""
  from kvax_plugin.attention import kernels
  pos, seg = _ids(256)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
  k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  message = r"deterministic_backward=True: the hopper backend's backward .*backend=\"mosaic\""
  with pytest.raises(ValueError, match=message):
    hopper.flash_attention_hopper(q, k, k, pos, seg, pos, seg, mask, scale=0.1,
                                  logits_soft_cap=None, sinks=None, deterministic_backward=True)
  assert kernels.backend_options("hopper", deterministic_backward=True,
                                 memory_optimized_gqa_backward=True) == {
                                     "deterministic_backward": True}
  real = kernels.availability
  monkeypatch.setattr(kernels, "availability", lambda name: (
      (True, "pretend Hopper") if name == "hopper" else real(name)))
  with pytest.raises(ValueError, match=message):
    kp.flash_attention(q, k, k, pos, seg, pos, seg, mask, scale=0.1, backend="hopper",
                       deterministic_backward=True)
  import inspect
  assert inspect.signature(kp.flash_attention).parameters["deterministic_backward"].default is None
