"""The attention provider registry and the kvax provider (CPU, no MaxText needed)."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvax_plugin
from kvax_plugin.providers import (AttentionProvider, LayerSettings, PreparedAttention,
                                  available_providers, get_provider, register_provider)
from kvax_plugin.providers import kvax_provider


def _tokens():
  # Two documents and padding in row 0; one document crossing blocks in row 1.
  seg = np.full((2, 96), kvax_plugin.PADDING_SEGMENT_ID, np.int32)
  pos = np.zeros((2, 96), np.int32)
  seg[0, :40], pos[0, :40] = 1, np.arange(40)
  seg[0, 40:80], pos[0, 40:80] = 2, np.arange(40)
  seg[1, :90], pos[1, :90] = 7, np.arange(90)
  return jnp.asarray(pos), jnp.asarray(seg)


def test_kvax_is_registered_and_advertised():
  assert "kvax" in available_providers()
  assert get_provider("kvax") is kvax_provider.KVAX_PROVIDER
  eps = importlib.metadata.entry_points(group="kvax_plugin.providers")
  assert [ep.value for ep in eps if ep.name == "kvax"] == [
      "kvax_plugin.providers.kvax_provider:KVAX_PROVIDER"]
  assert next(ep for ep in eps if ep.name == "kvax").load() is kvax_provider.KVAX_PROVIDER


def test_registry_errors_name_the_problem():
  with pytest.raises(KeyError, match="unknown attention provider 'nope'.*kvax"):
    get_provider("nope")
  with pytest.raises(ValueError, match="already registered"):
    register_provider(dataclasses.replace(kvax_provider.KVAX_PROVIDER, description="other"))
  with pytest.raises(TypeError, match="AttentionProvider"):
    register_provider("kvax")


@pytest.mark.parametrize("window,cap,sinks", [(None, None, False), (24, 30.0, True)])
def test_prepare_once_apply_matches_reference(window, cap, sinks):
  pos, seg = _tokens()
  b = get_provider("kvax")
  opts = kvax_provider.KvaxOptions(backend="jax",
                                  fwd_params=kvax_plugin.FlashAttentionParamsConfig(32, 32),
                                  bwd_params=kvax_plugin.FlashAttentionParamsConfig(16, 32))
  before = dict(kvax_provider.TRACE_COUNTS)
  prepared = b.prepare(pos, seg, mask_keys=[(True, None), (True, window)], options=opts)
  builds = kvax_provider.TRACE_COUNTS["mask_builds"] - before.get("mask_builds", 0)
  assert builds == (1 if window is None else 2)
  assert isinstance(prepared, PreparedAttention)
  kq, kk, kv, ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (2, 96, 4, 32))
  k = jax.random.normal(kk, (2, 96, 2, 32))
  v = jax.random.normal(kv, (2, 96, 2, 16))
  s = jax.random.normal(ks, (4,)) if sinks else None
  settings = LayerSettings(sliding_window=window, logits_soft_cap=cap, scale=0.2)

  def f(q, k, v):
    return b.apply(q, k, v, prepared, settings, sinks=s)

  def ref(q, k, v):
    return kvax_plugin.reference_attention(q, k, v, pos, seg, pos, seg, sliding_window=window,
                                           scale=0.2, logits_soft_cap=cap, sinks=s)

  # kvax eagerly (apply outside jit); the reference jitted (one compile instead of one per op).
  np.testing.assert_allclose(f(q, k, v), jax.jit(ref)(q, k, v), atol=2e-5, rtol=2e-5)
  g = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
  gr = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) ** 2), argnums=(0, 1, 2)))(q, k, v)
  for a, r in zip(g, gr):
    np.testing.assert_allclose(a, r, atol=5e-5, rtol=5e-5)
  # The prepared state is a pytree: it crosses jit as an argument.
  out = jax.jit(lambda p, q, k, v: b.apply(q, k, v, p, settings, sinks=s))(prepared, q, k, v)
  np.testing.assert_allclose(out, f(q, k, v), atol=1e-6)


def test_missing_mask_and_bad_settings_are_errors():
  pos, seg = _tokens()
  prepared = get_provider("kvax").prepare(pos, seg)
  q = jnp.zeros((2, 96, 2, 16))
  with pytest.raises(KeyError, match="sliding_window=8.*prepare"):
    get_provider("kvax").apply(q, q, q, prepared, LayerSettings(sliding_window=8))
  with pytest.raises(ValueError, match="sliding_window"):
    LayerSettings(sliding_window=0)
  with pytest.raises(ValueError, match="logits_soft_cap"):
    LayerSettings(logits_soft_cap=-1.0)
  with pytest.raises(TypeError, match="options"):
    get_provider("kvax").prepare(pos, seg, options={"backend": "jax"})


def test_explicit_triton_request_never_falls_back():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present: the request is legitimate here")
  pos, seg = _tokens()
  prepared = get_provider("kvax").prepare(pos, seg,
                                         options=kvax_provider.KvaxOptions(backend="triton"))
  q = jnp.zeros((2, 96, 2, 16))
  with pytest.raises(kvax_plugin.BackendUnavailableError):
    get_provider("kvax").apply(q, q, q, prepared, LayerSettings())
