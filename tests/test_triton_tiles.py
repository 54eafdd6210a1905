"""Launch settings of the Triton backend, on the CPU: tuned tiles, overrides, shared memory.

The kernels' shared memory is only checked by Triton when it compiles them on a GPU, where a
too-large request fails the whole jitted step (seen with MaxText's gemma2 in float32, head dim
256). These tests pin the host-side fit that prevents it.
"""

import jax.numpy as jnp
import pytest

from kvax_plugin.attention.kernels.triton import backend as tb
from kvax_plugin.attention.block_mask import create_attention_mask
from kvax_plugin.attention.params import FlashAttentionParamsConfig as P

H200 = "NVIDIA H200"


def _spec(fwd=None, bwd=None):
  seg = jnp.zeros((1, 256), jnp.int32)
  pos = jnp.arange(256, dtype=jnp.int32)[None]
  kw = {}
  if fwd is not None:
    kw = dict(fwd_params=fwd, bwd_params=bwd)
  return create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, **kw).spec


@pytest.mark.parametrize("family", ["h100", "h200"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tuned_16bit_tiles_fit_unchanged(family, head_dim):
  tuned = tb._tuned(family, head_dim)
  limit = tb.shared_memory_limit("NVIDIA H100 80GB HBM3" if family == "h100" else H200)
  for name in ("fwd", "dq", "dkv"):
    t = getattr(tuned, name)
    assert tb.shared_memory_bytes(name, t, 2, head_dim, head_dim) <= limit, (name, t)
    assert tb.fit_shared_memory(name, t, 2, head_dim, head_dim, limit) == t


def test_refused_float32_config_is_over_the_limit():
  # Triton refused this forward on an H200 (345344 B > 232448 B); the estimate must say so.
  t = tb._Tiles(64, 64, 8, 3)
  assert tb.shared_memory_bytes("fwd", t, 4, 256, 256) >= 345344
  assert tb.shared_memory_limit(H200) == 232448


def test_float32_head_dim_256_explicit_params_are_fitted():
  # MaxText's gpu parity settings: explicit 64x64 blocks, 8 warps, 3 (fwd) / 2 (bwd) stages.
  spec = _spec(P(64, 64, 8, 3), P(64, 64, 8, 2))
  launch = tb._launch_for(spec, H200, 256, 256, itemsize=4)
  limit = tb.shared_memory_limit(H200)
  for name in ("fwd", "dq", "dkv"):
    t = getattr(launch, name)
    assert tb.shared_memory_bytes(name, t, 4, 256, 256) <= limit, (name, t)
    assert 64 % t.block_m == 0 and 64 % t.block_n == 0, (name, t)  # still divide the table
    assert t.num_stages >= 1
    rows = t.block_n if name == "dkv" else t.block_m
    assert t.num_warps == 4 or rows >= 64
  # bf16 at the same settings is left exactly as asked.
  launch16 = tb._launch_for(spec, H200, 256, 256, itemsize=2)
  assert launch16.fwd == tb._Tiles(64, 64, 8, 3)


def test_fallback_gpu_gets_smaller_limit_and_fits():
  spec = _spec()
  for kind, limit in (("NVIDIA A100-SXM4-80GB", 166912), ("NVIDIA GeForce RTX 4090", 101376)):
    assert tb.shared_memory_limit(kind) == limit
    launch = tb._launch_for(spec, kind, 128, 128, itemsize=2)
    for name in ("fwd", "dq", "dkv"):
      assert tb.shared_memory_bytes(name, getattr(launch, name), 2, 128, 128) <= limit


def test_override_is_exact():
  spec = _spec()
  launch = tb._launch_for(spec, H200, 256, 256, override="fwd=64,64,8,3", itemsize=4)
  assert launch.fwd == tb._Tiles(64, 64, 8, 3)  # KernelOptions.triton_tiles: taken as given


def test_float32_products_stay_float32_accurate():
  assert tb._dot_precision(jnp.float32) == "ieee"
  assert tb._dot_precision(jnp.bfloat16) == "tf32"  # ignored for 16-bit inputs


def test_unknown_kernel_name_raises():
  with pytest.raises(ValueError, match="kernel"):
    tb.shared_memory_bytes("bwd", tb._Tiles(64, 64, 4, 2), 2, 64, 64)


def test_float32_head_dim_rule(monkeypatch):
  from kvax_plugin.attention import kernels
  assert kernels.supports_inputs("triton", jnp.float32, 128, 128)[0]
  assert kernels.supports_inputs("triton", jnp.bfloat16, 256, 256)[0]
  ok, why = kernels.supports_inputs("triton", jnp.float32, 192, 128)
  assert not ok and "float32" in why and "(192, 128)" in why
  # As if a supported GPU were present: auto moves to jax, an explicit request raises.
  real = kernels.availability
  monkeypatch.setattr(kernels, "availability",
                      lambda name: (True, "pretend GPU") if name == "triton" else real(name))
  assert kernels.resolve_backend_for("auto", jnp.float32, 256, 256) == "jax"
  assert kernels.resolve_backend_for("auto", jnp.bfloat16, 256, 256) == "triton"
  with pytest.raises(kernels.BackendUnavailableError, match="head dims"):
    kernels.resolve_backend_for("triton", jnp.float32, 256, 256)


def test_default_tables_get_the_tuned_backward_tiles():
  # Library defaults (no params): 128-token backward query blocks, so the dq kernel runs on its
  # tuned 128-row tiles and the dk/dv kernel on 64-row query tiles inside them.
  launch = tb._launch_for(_spec(), H200, 128, 128, itemsize=2)
  assert launch.fwd == tb._Tiles(128, 128, 8, 3)
  assert launch.dq == tb._Tiles(128, 64, 8, 3)
  assert launch.dkv == tb._Tiles(64, 128, 8, 3)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_params_masks_run_the_tuned_tiles(head_dim):
  fwd, bwd = tb.default_params(H200, head_dim)
  tuned = tb._tuned("h200", head_dim)
  for t in (tuned.dq, tuned.dkv):  # both backward kernels' tiles divide the bwd table blocks
    assert bwd.query_block_size % t.block_m == 0 and bwd.kv_block_size % t.block_n == 0
  launch = tb._launch_for(_spec(fwd, bwd), H200, head_dim, head_dim, itemsize=2)
  assert launch == tuned


def test_explicit_backward_params_are_taken_as_given():
  launch = tb._launch_for(_spec(P(64, 64, 4, 2), P(32, 64, 4, 1)), H200, 128, 128, itemsize=2)
  assert launch.dq == launch.dkv == tb._Tiles(32, 64, 4, 1)


def test_gqa_inplace_rule():
  # Explicit request or no group: always in place.
  assert tb.gqa_inplace(True, 1, 1, 8, 1, 132)
  assert tb.gqa_inplace(False, 1, 8, 1, 1, 132)
  # Otherwise in place only while the kv-head grid fills the GPU 4 times over: 16k tokens,
  # 8 kv heads, 128-token kv tiles gives 1024 programs >= 4 * 132; 2k tokens gives 128.
  assert tb.gqa_inplace(False, 1, 8, 4, 128, 132)
  assert not tb.gqa_inplace(False, 1, 8, 4, 16, 132)
  assert tb.gqa_inplace(False, 8, 8, 4, 16, 132)
  # The CPU interpreter (0 SMs) keeps the caller's choice, so tests reach both kernels' paths.
  assert not tb.gqa_inplace(False, 64, 8, 4, 128, 0)


def test_override_keys_are_checked():
  from kvax_plugin.attention.options import KernelOptions
  spec = _spec()
  with pytest.raises(ValueError, match=r"triton_tiles='ws=fwd': 'ws=fwd' is not KEY=VALUE"):
    tb._launch_for(spec, H200, 128, 128, override="ws=fwd", itemsize=2)
  for bad, why in (("fwd=64,64,8", "four positive integers"), ("gqa=both", "inplace or perhead"),
                   ("dq", "is not KEY=VALUE")):
    with pytest.raises(ValueError, match=why):
      KernelOptions(triton_tiles=bad)  # refused when the options are made, not at trace time
  # gqa= is the backward launch's choice: accepted here, tiles untouched.
  assert tb._launch_for(spec, H200, 128, 128, override="gqa=perhead", itemsize=2) == \
      tb._launch_for(spec, H200, 128, 128, itemsize=2)


def test_kernel_options_reach_the_triton_launch(monkeypatch):
  """kvax_plugin.flash_attention(kernel_options=...) reaches the Triton backend's launch
  constants (the tiles and the backward's kernel order), through the registry; the defaults
  leave them empty."""
  import kvax_plugin
  from kvax_plugin.attention import kernels
  real = kernels.availability
  monkeypatch.setattr(kernels, "availability", lambda name: (
      (True, "pretend GPU") if name == "triton" else real(name)))
  seen = []
  monkeypatch.setattr(tb, "_attention", lambda cfg, q, *a: (seen.append(cfg), q)[1])
  monkeypatch.setattr(tb.compat, "check", lambda: None)
  seg = jnp.zeros((1, 64), jnp.int32)
  pos = jnp.arange(64, dtype=jnp.int32)[None]
  mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  x = jnp.zeros((1, 64, 2, 32))
  options = kvax_plugin.KernelOptions(triton_tiles="fwd=64,64,4,2;gqa=perhead",
                                      dq_after_dkv=True)
  for opts in (None, options):
    kvax_plugin.flash_attention(x, x, x, pos, seg, pos, seg, mask, backend="triton",
                                kernel_options=opts)
  assert [(c.tiles_override, c.dq_after_dkv) for c in seen] == [
      ("", False), ("fwd=64,64,4,2;gqa=perhead", True)], seen


def test_auto_prefers_triton_above_head_dim_128_on_hopper(monkeypatch):
  """On a GPU where both run (as if Hopper), "auto" takes Mosaic up to head dim 128 and for MLA
  (192 / 128: Mosaic is faster there), Triton above otherwise (about 2x faster forward+backward
  at head dim 256; 192 / 192 not measured); an explicit "mosaic" still runs
  head dim 256, and float32 still goes to Triton / JAX."""
  from kvax_plugin.attention import kernels
  real = kernels.availability
  monkeypatch.setattr(kernels, "availability", lambda name: (
      (True, "pretend Hopper") if name in ("mosaic", "triton") else real(name)))
  assert kernels.resolve_backend_for("auto", jnp.bfloat16, 128, 128) == "mosaic"
  assert kernels.resolve_backend_for("auto", jnp.bfloat16, 64, 64) == "mosaic"
  assert kernels.resolve_backend_for("auto", jnp.bfloat16, 256, 256) == "triton"
  assert kernels.resolve_backend_for("auto", jnp.float16, 192, 128) == "mosaic"
  assert kernels.resolve_backend_for("auto", jnp.bfloat16, 192, 192) == "triton"
  assert kernels.resolve_backend_for("mosaic", jnp.bfloat16, 256, 256) == "mosaic"
  assert kernels.resolve_backend_for("auto", jnp.float32, 128, 128) == "triton"
  ok, why = kernels.auto_prefers("mosaic", jnp.bfloat16, 256, 256)
  assert not ok and "(256, 256)" in why and 'backend="mosaic"' in why
  assert kernels.auto_prefers("triton", jnp.bfloat16, 256, 256)[0]
