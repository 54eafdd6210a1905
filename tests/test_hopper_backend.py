"""backend="hopper" (kernels/hopper.py: the Mosaic forward with the CUDA C++ fused backward) on the
CPU: what it declares, where "auto" takes it, what it refuses and how the refusal reads, and its
backward's padding (lengths off the kernel's 128-row tiles) against the float32 reference with
the kernel replaced by a dense JAX model of it. It runs for real in tests/gpu/test_cuda_sm90_gpu.py
(a Hopper GPU). The build itself (cache, lock, toolchain message): tests/test_cuda_sm90_build.py."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvax_plugin as kp
from kvax_plugin.attention import kernels
from kvax_plugin.attention.block_mask import (FlashAttentionParamsConfig, create_attention_mask,
                                            dense_mask)
from kvax_plugin.attention.kernels import (AUTO_ORDER, BACKENDS, BackendUnavailableError,
                                           KERNEL_BACKENDS, supports_inputs)
from kvax_plugin.attention.kernels import hopper
from kvax_plugin.attention.kernels.cuda_sm90 import build
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as cuda_bwd
from kvax_plugin.attention.kernels.custom_vjp import kernel_attention
from kvax_plugin.attention.reference import reference_attention

import layouts

H100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0")


def _ids(s, b=1):
  pos = jnp.tile(jnp.arange(s, dtype=jnp.int32)[None], (b, 1))
  return pos, jnp.zeros((b, s), jnp.int32)


def test_auto_takes_hopper_first():
  assert "hopper" in KERNEL_BACKENDS and "hopper" in BACKENDS
  assert AUTO_ORDER == ("hopper", "mosaic", "triton", "jax")
  assert not KERNEL_BACKENDS["hopper"].reproducible_backward
  assert all(KERNEL_BACKENDS[n].reproducible_backward for n in AUTO_ORDER if n != "hopper")


@pytest.fixture
def fake_hopper_gpu(monkeypatch):
  """availability as on an H100 where hopper's library can be built: hopper, mosaic and triton
  run; the registry's own checks (capabilities, masks, auto_check) are the real ones."""
  real = kernels.availability
  monkeypatch.setattr(kernels, "availability", lambda name: (
      (True, "pretend Hopper") if name in ("hopper", "mosaic", "triton") else real(name)))


def _with_spec(mask, **spec):
  """`mask` as if built with these spec fields (the checks read only the spec; building each
  variant would cost a mask compile per test)."""
  return dataclasses.replace(mask, spec=dataclasses.replace(mask.spec, **spec))


def test_auto_prefers_matches_the_performance_table():
  """docs/status.md's table "What "auto" runs on a Hopper GPU" (the measurements) and
  hopper.auto_prefers (the code) say the same for every row: hopper where the table says so,
  the other backend elsewhere."""
  from pathlib import Path
  text = (Path(__file__).resolve().parents[1] / "docs" / "status.md").read_text()
  section = text.split('## What "auto" runs on a Hopper GPU')[1].split("\n## ")[0]
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
          if line.startswith("| ") and not line.startswith("| head dims")]
  dims_of = {"128": (128, 128), "64": (64, 64), "256": (256, 256), "192 / 128 (MLA)": (192, 128)}
  assert len(rows) == 14 and {r[0] for r in rows} == set(dims_of)
  named = (("soft cap", "logits_soft_cap"), ("sinks", "sinks"), ("window", "sliding_window"))
  for row in rows:
    dims, what, runs = dims_of[row[0]], row[1], row[6]
    calls = ([(jnp.float16 if f == "fp16" else jnp.bfloat16, feats) for f, feats in
              (("bf16", ()), ("fp16", ()), ("soft cap", ("logits_soft_cap",)),
               ("sinks", ("sinks",)), ("window", ("sliding_window",)),
               ("window + soft cap", ("sliding_window", "logits_soft_cap")))]
             if what.startswith("any") else
             [(jnp.float16 if what == "fp16" else jnp.bfloat16,
               tuple(feature for word, feature in named if word in what))])
    for dtype, feats in calls:
      ok, why = kernels.auto_prefers("hopper", dtype, *dims, ("causal", "gqa") + feats)
      assert ok == runs.startswith("hopper"), (row, feats, why)


def test_auto_picks_hopper_where_it_supports_the_call(fake_hopper_gpu):
  pos, seg = _ids(512)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  pick = lambda dtype=jnp.bfloat16, dims=(128, 128), features=("causal", "gqa", "backward"), \
      m=mask, **kw: kernels.resolve_backend_for("auto", dtype, *dims, features, m, **kw)
  assert pick() == "hopper"
  assert pick(deterministic_backward=False) == "hopper"
  assert pick(features=()) == "hopper"  # not causal, no GQA, forward only
  # kvax's backward blocks (64, 128) are the fused backward's too
  kvax_bwd = _with_spec(mask, bwd_params=FlashAttentionParamsConfig(query_block_size=64,
                                                                     kv_block_size=128))
  assert pick(m=kvax_bwd) == "hopper"
  # fp16, soft cap and sinks: faster than mosaic with the one-pass backward; the sliding window
  # with the mask pass, but not with the soft cap, whose kernels keep the mask in their loop
  assert pick(dtype=jnp.float16) == "hopper"
  for feature in ("logits_soft_cap", "sinks"):
    assert pick(features=("causal", feature)) == "hopper", feature
    assert pick(dtype=jnp.float16, features=("causal", "gqa", feature)) == "hopper", feature
  assert pick(features=("causal", "sliding_window")) == "hopper"
  assert pick(features=("causal", "sliding_window", "sinks")) == "hopper"
  assert pick(features=("causal", "logits_soft_cap", "sliding_window")) == "mosaic"
  ok, why = kernels.auto_prefers("hopper", jnp.bfloat16, 128, 128,
                                 ("causal", "logits_soft_cap", "sliding_window"))
  assert not ok and "sliding_window with logits_soft_cap" in why and 'backend="hopper"' in why
  assert kernels.auto_prefers("hopper", jnp.bfloat16, 128, 128, ("causal", "gqa")) == (True, "")
  assert kernels.resolve_backend_for("hopper", jnp.float16, 128, 128, ("sinks",)) == "hopper"
  # what it is not preferred for goes to mosaic (above head dim 128, mosaic's auto_check: triton)
  # head dim 64: with 128-row query steps, faster than mosaic with fp16, soft cap and sinks
  # too, and the window with the mask pass; the window with the soft cap stays with mosaic, as
  # at 128
  assert pick(dims=(64, 64)) == "hopper"
  assert pick(dims=(64, 64), features=("causal", "sliding_window")) == "hopper"
  assert pick(dims=(64, 64), features=("causal", "sliding_window", "logits_soft_cap")) == "mosaic"
  assert pick(dims=(64, 64), dtype=jnp.float16) == "hopper"
  for feature in ("logits_soft_cap", "sinks"):
    assert pick(dims=(64, 64), features=("causal", feature)) == "hopper", feature
  assert kernels.resolve_backend_for("hopper", jnp.float16, 64, 64) == "hopper"
  assert pick(dims=(192, 128)) == "mosaic"
  # head dim 256: hopper's own layout is faster than Triton with every feature and fp16, so
  # auto takes it for all of them
  assert pick(dims=(256, 256)) == "hopper"
  assert pick(dims=(256, 256), dtype=jnp.float16,
               features=("causal", "logits_soft_cap", "sliding_window", "sinks")) == "hopper"
  assert pick(dims=(256, 256), deterministic_backward=True) == "triton"
  assert pick(dtype=jnp.float32) == "triton"
  wide = FlashAttentionParamsConfig(query_block_size=128, kv_block_size=256)
  assert pick(m=_with_spec(mask, bwd_params=wide)) == "mosaic"
  narrow = FlashAttentionParamsConfig(query_block_size=32, kv_block_size=128)
  assert pick(m=_with_spec(mask, bwd_params=narrow)) == "triton"  # mosaic's tiles refuse it too
  assert kernels.resolve_backend("auto") == "hopper"


def test_deterministic_backward_routes_auto_to_mosaic(fake_hopper_gpu):
  """deterministic_backward=True is how to get bitwise-reproducible gradients: "auto" passes
  over hopper (its dq summation order varies) to mosaic; an explicit "hopper" with True is
  refused by the registry, naming why (test_a_deterministic_backward_is_refused...)."""
  pos, seg = _ids(512)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  args = (jnp.bfloat16, 128, 128, ("causal", "backward"), mask)
  assert kernels.resolve_backend_for("auto", *args, deterministic_backward=True) == "mosaic"
  assert kernels.resolve_backend_for("auto", *args, deterministic_backward=None) == "hopper"
  assert kernels.resolve_backend_for("hopper", *args, deterministic_backward=None) == "hopper"
  with pytest.raises(BackendUnavailableError, match="not bitwise reproducible"):
    kernels.resolve_backend_for("hopper", *args, deterministic_backward=True)


def test_the_public_op_routes_deterministic_auto_to_mosaic(fake_hopper_gpu, monkeypatch):
  """Through kvax_plugin.flash_attention: "auto" runs hopper by default and mosaic for
  deterministic_backward=True (the backends are recorded, not run: no GPU here)."""
  ran = []
  monkeypatch.setattr(kernels, "backend_function", lambda name: (
      lambda q, *a, **kw: ran.append((name, kw.get("deterministic_backward"))) or q))
  pos, seg = _ids(256)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
  k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  for det in (None, False, True):
    kp.flash_attention(q, k, k, pos, seg, pos, seg, mask, scale=0.1, deterministic_backward=det)
  assert ran == [("hopper", None), ("hopper", False), ("mosaic", True)]


def test_without_a_toolchain_auto_takes_mosaic(monkeypatch):
  """On a Hopper GPU with no prebuilt library and no nvcc, hopper is unavailable with the
  install message and "auto" moves on."""
  real = kernels.availability
  monkeypatch.setattr(cuda_bwd, "prepare", lambda *a: (False, build.MISSING_TOOLCHAIN))
  monkeypatch.setattr(kernels, "availability", lambda name: (
      hopper.device_supported(H100) if name == "hopper" else
      (True, "pretend Hopper") if name == "mosaic" else real(name)))
  assert kernels.resolve_backend_for("auto", jnp.bfloat16, 128, 128) == "mosaic"
  with pytest.raises(BackendUnavailableError, match=r"kvax-plugin\[gpu\]"):
    kernels.resolve_backend_for("hopper", jnp.bfloat16, 128, 128)


@pytest.mark.parametrize("dtype, dims, features, message", [
    (jnp.bfloat16, (128, 128), ("causal", "gqa", "backward"), None),
    (jnp.float16, (128, 128), ("sliding_window", "logits_soft_cap", "sinks", "backward"), None),
    (jnp.float32, (128, 128), (), "float32 inputs are not supported"),
    (jnp.bfloat16, (64, 64), ("causal", "sinks"), None),
    (jnp.bfloat16, (128, 64), ("distinct_v_head_dim",), r"head dims \(128, 64\) are not supported"),
    (jnp.bfloat16, (256, 256), ("causal", "gqa", "logits_soft_cap", "backward"), None),
    # MLA (DeepSeek): its own layout (backward_mla_kernel)
    (jnp.float16, (192, 128), ("distinct_v_head_dim", "sliding_window", "sinks", "backward"), None),
    # a multiple of 64 inside [64, 256] that no layout is built for
    (jnp.bfloat16, (192, 192), (), r"head dims \(192, 192\) are not supported \(one of"),
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
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  assert hopper.supports_mask(_with_spec(mask, sliding_window=128))[0]
  large = _with_spec(mask, bwd_params=FlashAttentionParamsConfig(query_block_size=128,
                                                                 kv_block_size=256))
  ok, why = hopper.supports_mask(large)  # the Mosaic kernels take it; the fused tile does not
  assert not ok and "kv blocks of 128" in why, why
  for bq in (64, 256):  # kvax's (64, 128) among them
    assert hopper.supports_mask(_with_spec(mask, bwd_params=FlashAttentionParamsConfig(
        query_block_size=bq, kv_block_size=128)))[0], bq
  for bq, bkv in ((32, 128), (128, 64)):
    assert not hopper.supports_mask(_with_spec(mask, bwd_params=FlashAttentionParamsConfig(
        query_block_size=bq, kv_block_size=bkv)))[0], (bq, bkv)


def test_device_check_prepares_the_library_on_hopper_only(monkeypatch, tmp_path):
  """Off Hopper nothing is looked for; on Hopper the first ask loads the library (building it
  if needed: build.ensure_library), and a failure is remembered, not retried per ask."""
  asked = []

  def ensure(cache_dir=None, nvcc=None, **kw):
    asked.append(cache_dir)
    raise build.ToolchainMissing(build.MISSING_TOOLCHAIN)
  monkeypatch.setattr(build, "ensure_library", ensure)
  monkeypatch.setattr(cuda_bwd, "_LOADED", [])
  monkeypatch.setattr(cuda_bwd, "_FAILED", [])
  cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
  assert not hopper.device_supported(cpu)[0]
  a100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA A100", compute_capability="8.0")
  assert not hopper.device_supported(a100)[0]
  assert asked == []
  for _ in range(3):
    ok, why = hopper.device_supported(H100)
    assert not ok and "pip install 'kvax-plugin[gpu]'" in why and "nvidia-cuda-nvcc>=13" in why
  assert asked == [None]
  with pytest.raises(build.ToolchainMissing):  # the first call says the same
    cuda_bwd.load()
  assert cuda_bwd.library_status() == (False, build.MISSING_TOOLCHAIN)
  # loaded (as after a build): ok, and nothing more is asked
  monkeypatch.setattr(cuda_bwd, "_FAILED", [])
  monkeypatch.setattr(cuda_bwd, "_LOADED", ["a loaded library"])
  assert hopper.device_supported(H100) == (True, "")
  assert asked == [None]


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
  with pytest.raises(ValueError, match="query: float32; .* bfloat16 or float16"):
    call(q.astype(jnp.float32), k, k)
  with pytest.raises(ValueError, match="key: bfloat16; .*the same type"):
    call(q.astype(jnp.float16), k, k)
  with pytest.raises(ValueError, match=r"head dims 128 / 128 / 64; .*\(192, 128\)\)"):
    call(q, k, k[..., :64])
  with pytest.raises(ValueError, match="head dims 32 / 32 / 32"):
    call(q[..., :32], k[..., :32], k[..., :32])
  with pytest.raises(ValueError, match="head dims 192 / 192 / 192"):
    call(jnp.zeros((1, 256, 4, 192), jnp.bfloat16), *(jnp.zeros((1, 256, 2, 192), jnp.bfloat16),) * 2)
  wide = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, bwd_params=(
      FlashAttentionParamsConfig(query_block_size=128, kv_block_size=256)))
  with pytest.raises(ValueError, match="mask: the mask's backward blocks 128x256"):
    call(q, k, k, m=wide)


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
  registry = r'backend="hopper" was requested but cannot run: deterministic_backward=True'
  with pytest.raises(ValueError, match=message):
    hopper.flash_attention_hopper(q, k, k, pos, seg, pos, seg, mask, scale=0.1,
                                  logits_soft_cap=None, sinks=None, deterministic_backward=True)
  from kvax_plugin.attention.options import HopperOptions
  assert kernels.backend_options("hopper", deterministic_backward=True,
                                 memory_optimized_gqa_backward=True) == {
                                     "deterministic_backward": True,
                                     "kernel_options": HopperOptions()}
  real = kernels.availability
  monkeypatch.setattr(kernels, "availability", lambda name: (
      (True, "pretend Hopper") if name == "hopper" else real(name)))
  with pytest.raises(BackendUnavailableError, match=registry):
    kp.flash_attention(q, k, k, pos, seg, pos, seg, mask, scale=0.1, backend="hopper",
                       deterministic_backward=True)
  import inspect
  assert inspect.signature(kp.flash_attention).parameters["deterministic_backward"].default is None


# --- the backward's padding, with the kernel replaced by a dense model of it -------------------
def _dense_kernel(q, k, v, d_out, lse, delta, q_pos, q_seg, kv_pos, kv_seg, bounds, *, scale,
                  causal, variant, soft_cap=0.0, window=0):
  """What fused_backward computes, densely in float32, with the kernel's own rules: whole
  128-row tiles only (checked); only the 64-row query blocks its tile's bounds list are visited;
  a pair kept by the package's dense_mask, or every pair on the blocks the bounds mark whole
  (there the kernel skips the mask: a wrong table shows here); P = exp(z - lse) (lse +inf: 0)
  with z = scale s, or cap tanh(scale s / cap) whose derivative 1 - tanh^2 multiplies dS."""
  assert variant == hopper.VARIANT
  b, sq, h, _ = q.shape
  skv, kh = k.shape[1], k.shape[2]
  assert sq % 128 == 0 and skv % 128 == 0, (sq, skv)
  assert all(x.shape == (b, skv // 128) for x in bounds)
  f32 = lambda x: x.astype(jnp.float32)
  group = h // kh
  kk, vv = (jnp.repeat(f32(x), group, axis=2) for x in (k, v))
  s = jnp.einsum("bqhd,bkhd->bhqk", f32(q), kk)
  keep = dense_mask(q_pos, q_seg, kv_pos, kv_seg, causal=causal, sliding_window=window or None)
  lo, hi, full_lo, full_hi = (jnp.repeat(x, 128, axis=1)[:, None, :] for x in bounds)  # per kv row
  q_block = jnp.arange(sq)[None, :, None] // 64
  keep |= (full_lo <= q_block) & (q_block < full_hi)
  keep &= (lo <= q_block) & (q_block < hi)
  z, dz = scale * s, 1.0
  if soft_cap:
    t = jnp.tanh(z / soft_cap)
    z, dz = soft_cap * t, 1.0 - t * t
  p = jnp.where(keep[:, None], jnp.exp(z - lse[..., None]), 0.0)
  dp = jnp.einsum("bqhd,bkhd->bhqk", f32(d_out), vv)
  ds = p * (dp - delta[..., None]) * dz
  dq = scale * jnp.einsum("bhqk,bkhd->bqhd", ds, kk)
  dk = scale * jnp.einsum("bhqk,bqhd->bkhd", ds, f32(q))
  dv = jnp.einsum("bhqk,bqhd->bkhd", p, f32(d_out))
  fold = lambda x: x.reshape(b, skv, kh, group, -1).sum(3)
  return dq.astype(q.dtype), fold(dk), fold(dv)


def _dense_forward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask):
  """out and lse (natural log, sinks in its sum, +inf where nothing is attended and no sink) as
  the Mosaic forward gives them."""
  group = q.shape[2] // k.shape[2]
  kk, vv = (jnp.repeat(x, group, axis=2) for x in (k, v))
  s = cfg.scale * jnp.einsum("bqhd,bkhd->bhqk", q, kk)
  if cfg.soft_cap:
    s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
  keep = dense_mask(q_pos, q_seg, kv_pos, kv_seg, causal=cfg.causal,
                    sliding_window=cfg.window or None)
  s = jnp.where(keep[:, None], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  if cfg.has_sinks:
    lse = jnp.logaddexp(lse, sinks[None, :, None])
  out = jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep[:, None], jnp.exp(s - lse[..., None]), 0),
                   vv)
  return out, jnp.where(jnp.isfinite(lse), lse, jnp.inf)


@pytest.mark.parametrize("causal, sq, skv, bwd_q, window, cap, with_sinks", [
    (True, 200, 200, 128, None, None, False),   # one length, off the tile
    # the query the last 136 tokens of 392; kvax's (64, 128) blocks
    (True, 136, 392, 64, None, None, False),
    (False, 256, 130, 128, None, None, False),  # kv one token past a tile, not causal
    # window both ways, soft cap and sinks: the JAX side passes them on (dsinks its own)
    (False, 200, 200, 128, 40, 3.0, True),
])
def test_backward_pads_lengths_off_the_tile(monkeypatch, causal, sq, skv, bwd_q, window, cap,
                                            with_sinks):
  """Any Sq, Skv: the backward pads both to the kernel's 128-row tiles (padded kv rows the
  padding id, padded query rows lse +inf) and slices the gradients back; batch 2, GQA, packed
  documents with a padding tail; window, soft cap and sinks reach the kernel (and the sinks'
  gradient). Against the float32 reference's gradients."""
  monkeypatch.setattr(cuda_bwd, "fused_backward", _dense_kernel)
  rng = np.random.default_rng(sq + skv)
  kv_pos, kv_seg = layouts.packed_documents(rng, 2, skv, num_docs=3, pad_tail=skv // 10)
  q_pos, q_seg = kv_pos[:, skv - sq:], kv_seg[:, skv - sq:]
  if sq > skv:
    q_pos, q_seg = layouts.packed_documents(rng, 2, sq, num_docs=2, pad_tail=9)
  ids = [jnp.asarray(x) for x in (q_pos, q_seg, kv_pos, kv_seg)]
  q, k, v, d_out = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in (
      (2, sq, 4, 128), (2, skv, 2, 128), (2, skv, 2, 128), (2, sq, 4, 128)))
  scale = 128 ** -0.5
  cfg = hopper._Static(scale=scale, soft_cap=cap or 0.0, has_sinks=with_sinks, causal=causal,
                       window=window or 0, deterministic=True, interpret=False)
  attention = kernel_attention(_dense_forward, hopper._backward)
  sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
  bwd = FlashAttentionParamsConfig(query_block_size=bwd_q, kv_block_size=128)
  ref_sinks = sinks if with_sinks else None

  @jax.jit  # one compile per case (eagerly, each small op is dispatched on its own)
  def grads(q, k, v, sinks, d_out, ids):
    mask = create_attention_mask(*ids, calc_bwd_mask=True, causal=causal, bwd_params=bwd,
                                 sliding_window=window)
    _, vjp = jax.vjp(lambda q, k, v, s: attention(cfg, q, k, v, s, *ids, mask), q, k, v, sinks)
    _, ref_vjp = jax.vjp(lambda q, k, v, s: reference_attention(
        q, k, v, *ids, causal=causal, scale=scale, sliding_window=window,
        logits_soft_cap=cap, sinks=s if with_sinks else None), q, k, v, sinks)
    return vjp(d_out), ref_vjp(d_out), mask

  got, want, mask = grads(q, k, v, sinks, d_out, ids)
  assert hopper.supports_mask(mask)[0]
  if with_sinks:
    assert float(jnp.max(jnp.abs(want[3]))) > 0  # the sinks' gradient is there to check
  else:
    assert float(jnp.max(jnp.abs(got[3]))) == 0
  for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
    assert a.shape == b.shape, name
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=2e-4, err_msg=name)
  assert hopper.padded_lengths(mask, sq, skv) == (-(-sq // 128) * 128, -(-skv // 128) * 128)


def test_kernel_options_reach_the_mosaic_forward(monkeypatch):
  """kvax_plugin.KernelOptions (its Mosaic forward fields) or a HopperOptions passed to
  backend="hopper" (or to "auto", which picks it on Hopper) reach the Mosaic forward's static
  configuration, as the MosaicOptions the forward reads."""
  from kvax_plugin.attention.options import HopperOptions, KernelOptions, MosaicOptions
  seen = []
  monkeypatch.setattr(hopper, "_attention", lambda cfg, q, *a: seen.append(cfg) or q)
  pos, seg = _ids(256)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
  k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  for opts in (KernelOptions(mosaic_forward_grid="per_tile", mosaic_backward_registers=240),
               HopperOptions(forward_grid="per_tile")):
    hopper.flash_attention_hopper(q, k, k, pos, seg, pos, seg, mask, scale=0.1,
                                  logits_soft_cap=None, sinks=None, kernel_options=opts)
  assert [cfg.options for cfg in seen] == [MosaicOptions(forward_grid="per_tile")] * 2
  assert "kernel_options" in kernels.KERNEL_BACKENDS["hopper"].options



def test_auto_runs_hopper_with_the_backward_chosen_by_the_mask(fake_hopper_gpu, monkeypatch):
  """"auto" hands hopper HopperOptions(backward="by_mask") unless the options name a backward;
  backend="hopper" keeps the CUDA backward (backward None)."""
  from kvax_plugin.attention.options import HopperOptions, KernelOptions
  ran = []
  monkeypatch.setattr(kernels, "backend_function", lambda name: (
      lambda q, *a, **kw: ran.append((name, kw["kernel_options"])) or q))
  pos, seg = _ids(256)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
  k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  for backend, opts in (("auto", None), ("hopper", None), ("auto", HopperOptions(backward="cuda")),
                        ("auto", KernelOptions(mosaic_forward_grid="per_tile"))):
    kp.flash_attention(q, k, k, pos, seg, pos, seg, mask, scale=0.1, backend=backend,
                       kernel_options=opts)
  assert ran == [("hopper", HopperOptions(backward="by_mask")), ("hopper", HopperOptions()),
                 ("hopper", HopperOptions(backward="cuda")),
                 ("hopper", HopperOptions(forward_grid="per_tile", backward="by_mask"))]
  with pytest.raises(ValueError, match=r"HopperOptions.backward='mosaic': expected one of"):
    HopperOptions(backward="mosaic")


def test_the_shipped_table_covers_head_dim_128_in_bf16():
  """backward_choice.json is read, and its rule for the measured case is a share in [0, 1]."""
  start = hopper.mosaic_backward_from(jnp.bfloat16, 128, 128)
  assert start is None or 0.0 <= start <= 1.0
  assert hopper.mosaic_backward_from(jnp.bfloat16, 128, 128, ("logits_soft_cap",)) is None
  assert hopper.mosaic_backward_from(jnp.float32, 100, 100) is None


@pytest.mark.parametrize("threshold, mosaic_ran", [(0.0, True), (0.5, True), (0.6, False),
                                                   (None, False)])
def test_by_mask_takes_the_mosaic_backward_from_its_partial_share(monkeypatch, threshold,
                                                                  mosaic_ran):
  """On the device, per call: the Mosaic backward when block_mask.partial_share(mask.dkv) is at
  least the table's threshold, else the CUDA one (both replaced by the dense model here, the
  Mosaic one scaled by 2 so the result shows which ran). The layout's share is 1/2."""
  monkeypatch.setattr(cuda_bwd, "fused_backward", _dense_kernel)
  monkeypatch.setattr(hopper.mosaic, "_backward", lambda cfg, *a: tuple(
      2 * g for g in hopper._cuda_backward(cfg, *a)))
  pos, seg = _ids(384)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  from kvax_plugin.attention import block_mask
  assert float(block_mask.partial_share(mask.dkv)) == 0.5
  rng = np.random.default_rng(0)
  q, k, v, d_out = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in (
      (1, 384, 4, 128), (1, 384, 2, 128), (1, 384, 2, 128), (1, 384, 4, 128)))
  cfgs = {t: hopper._Static(scale=0.1, soft_cap=0.0, has_sinks=False, causal=True, window=0,
                            deterministic=True, interpret=False, mosaic_backward_from=t)
          for t in (threshold, None)}
  attention = kernel_attention(_dense_forward, hopper._backward)
  sinks = jnp.zeros((4,), jnp.float32)

  def grads(cfg):
    _, vjp = jax.vjp(lambda q, k, v: attention(cfg, q, k, v, sinks, pos, seg, pos, seg, mask),
                     q, k, v)
    return vjp(d_out)
  got, cuda = grads(cfgs[threshold]), grads(cfgs[None])
  for a, b in zip(got, cuda):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b) * (2 if mosaic_ran else 1),
                               rtol=1e-6, atol=1e-6)
