"""The CUDA C++ fused backward (kvax_plugin/attention/kernels/cuda_sm90) and backend="hopper"
against the float32 reference on a Hopper GPU: out, dq, dk, dv on small awkward layouts (GQA,
MQA with padding and one-token documents, non-contiguous segments, non-causal with huge segment
ids, two batch rows, Sq != Skv), lengths off the kernel's 128-row tiles (padded by the backend),
kvax's (64, 128) backward blocks, and "auto" taking hopper where it covers the call. The library
comes from the build cache or a prebuilt one with a matching key, or is built on first use where
nvcc is installed; without any of them the file is skipped with the reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/layouts.py

from mosaic_marks import MOSAIC_GPU_MARKS  # noqa: E402
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as cuda_bwd  # noqa: E402

_OK, _WHY = cuda_bwd.library_status()
pytestmark = MOSAIC_GPU_MARKS + [pytest.mark.skipif(not _OK, reason=f"hopper: {_WHY}")]


# "hopper": the same kernel through the public op (kvax_plugin.flash_attention, backend="hopper")
@pytest.mark.parametrize("variant", sorted(cuda_bwd.VARIANTS) + ["hopper"])
@pytest.mark.parametrize("name", ["causal_gqa_512", "docs_padding_mqa_1024",
                                  "non_contiguous_768", "not_causal_docs_640",
                                  "batch2_docs_384", "query_shorter_docs_768"])
def test_fused_backward_against_reference(name, variant):
  import cuda_backward_check as check
  row = check.check_case(name, variant)
  assert row["finite"], row
  assert max(row["errors"].values()) < 2e-2, row


def _errors(sq, skv, heads, kv_heads, causal, batch=1, bwd_q=128, backend="hopper",
            deterministic_backward=None, dtype="bfloat16", window=None, cap=None,
            with_sinks=False, head_dim=128, scale=None, kernel_options=None, results=None):
  """Largest relative L2 error of out, dq, dk, dv (and dsinks with_sinks; dtype inputs against
  the float32 reference) of kvax_plugin.flash_attention on packed documents with a padding
  tail; the queries are the sq tokens before the keys' padding tail, or the whole row when sq
  == skv (or their own layout when longer).
  Every result must be finite and every gradient not all zero. results: a list that receives
  (out, dq, dk, dv) as numpy arrays."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import kvax_plugin as kp
  import conformance_cells as cc
  import layouts
  from kvax_plugin.attention.block_mask import FlashAttentionParamsConfig, create_attention_mask
  from kvax_plugin.attention.reference import reference_attention

  rng = np.random.default_rng(sq * 7 + skv)
  kv_pos, kv_seg = layouts.packed_documents(rng, batch, skv, num_docs=3, pad_tail=skv // 9,
                                            one_token_docs=1)
  # a shorter query ends where the padding tail starts (else a one-token query is padding and
  # every result is 0: nothing checked)
  end = skv if sq >= skv else skv - skv // 9
  q_pos, q_seg = kv_pos[:, end - sq:end], kv_seg[:, end - sq:end]
  if sq > skv:
    q_pos, q_seg = layouts.packed_documents(rng, batch, sq, num_docs=2, pad_tail=5)
  ids = tuple(jnp.asarray(x) for x in (q_pos, q_seg, kv_pos, kv_seg))
  bwd = FlashAttentionParamsConfig(query_block_size=bwd_q, kv_block_size=128)
  mask = create_attention_mask(*ids, calc_bwd_mask=True, causal=causal, bwd_params=bwd,
                               sliding_window=window)
  d, dv = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)  # (qk, v)
  q, k, v, cot = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in (
      (batch, sq, heads, d), (batch, skv, kv_heads, d), (batch, skv, kv_heads, dv),
      (batch, sq, heads, dv)))
  sinks = jnp.asarray(rng.standard_normal(heads), jnp.float32)
  scale = d ** -0.5 if scale is None else scale
  f32 = lambda x: x.astype(jnp.float32)

  def grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out,) + vjp(cot.astype(out.dtype))

  s_arg = lambda s: s if with_sinks else None
  reference = lambda q, k, v, s: reference_attention(
      q, k, v, *ids, causal=causal, scale=scale, sliding_window=window, logits_soft_cap=cap,
      sinks=s_arg(s))
  ours = jax.jit(lambda *a: grads(lambda q, k, v, s: kp.flash_attention(
      q, k, v, *ids, mask, scale=scale, backend=backend, bwd_params=bwd,
      deterministic_backward=deterministic_backward, logits_soft_cap=cap, sinks=s_arg(s),
      kernel_options=kernel_options), *a))(q, k, v, sinks)
  if results is not None:
    results.extend(np.asarray(x) for x in ours[:4])
  want = jax.jit(lambda *a: grads(reference, *a))(f32(q), f32(k), f32(v), sinks)
  errors = []
  names = ("out", "dq", "dk", "dv", "dsinks")[:5 if with_sinks else 4]
  for name, a, b in zip(names, ours, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all(), name
    assert np.abs(a).max() > 0, name
    norm = np.linalg.norm(b)
    if name == "dsinks":
      # dsinks = -sum over rows of p_sink delta, terms of both signs: measured against the
      # terms' magnitude, as the conformance matrix does
      norm = np.linalg.norm(np.asarray(cc.dsinks_terms(
          reference, f32(q), f32(k), f32(v), sinks, f32(cot), jnp.asarray(want[0]))))
    errors.append(float(np.linalg.norm(a - b) / (norm + 1e-30)))
  return max(errors)


# The backward's mask pass sets dropped logits to -inf before they are scaled: a negative scale
# would turn them to +inf, so such calls take the kernels with the mask in the loop
# (MASK_IN_LOOP), which these cases run. Head dim 256's kernel masks in its loop for any scale
# (a pass of its own is slower there); its case checks that.
@pytest.mark.parametrize("head_dim", [128, 64, 256])
def test_hopper_takes_a_negative_scale(head_dim):
  assert _errors(512, 512, 4, 2, True, 2, 128, head_dim=head_dim, scale=-0.2) < 2e-2


@pytest.mark.parametrize("sq, skv, heads, kv_heads, causal, batch, bwd_q", [
    (200, 200, 4, 2, True, 1, 128),   # one length off the tile
    (136, 392, 4, 1, True, 2, 64),    # Sq != Skv, MQA, batch 2, kvax's (64, 128) blocks
    (256, 130, 2, 2, False, 1, 128),  # kv one token past a tile, not causal
    (1, 300, 4, 2, True, 1, 128),     # one query (decode)
    (777, 777, 4, 2, True, 2, 512),   # backward query blocks of 512 (supports_mask takes any
                                      # power of two >= 64): q padded to 1024, kv to 896
])
def test_hopper_pads_lengths_off_the_tile(sq, skv, heads, kv_heads, causal, batch, bwd_q):
  assert _errors(sq, skv, heads, kv_heads, causal, batch, bwd_q) < 2e-2


# The attention features of fused_backward.cu's SOFTCAP / WINDOW variants, fp16, sinks (the
# forward's lse holds them; dsinks on the JAX side) and head dim 64, on awkward layouts.
@pytest.mark.parametrize("dtype, d, sq, skv, heads, kv_heads, causal, batch, bwd_q, window, cap, "
                         "with_sinks", [
    ("bfloat16", 128, 777, 777, 8, 2, True, 2, 128, 97, None, False),   # causal window, odd length
    ("bfloat16", 128, 384, 384, 4, 4, False, 1, 128, 97, None, False),  # window both ways
    ("bfloat16", 128, 512, 512, 4, 1, True, 1, 64, None, 3.0, False),   # soft cap that bends, MQA
    ("bfloat16", 128, 200, 600, 4, 2, True, 2, 128, None, None, True),  # sinks, Sq != Skv
    ("bfloat16", 128, 640, 640, 8, 2, True, 1, 128, 128, 30.0, True),   # all three
    ("float16", 128, 512, 512, 4, 2, True, 1, 128, None, None, False),  # fp16 plain
    ("float16", 128, 300, 300, 2, 2, False, 2, 128, 64, 30.0, True),    # fp16 all, not causal
    ("float16", 128, 136, 392, 4, 1, True, 2, 64, 200, 3.0, False),     # fp16, Sq != Skv, window
    ("bfloat16", 64, 777, 777, 8, 2, True, 2, 128, None, None, False),  # head dim 64, GQA
    ("bfloat16", 64, 200, 600, 4, 1, True, 1, 64, 128, None, True),     # 64: window + sinks
    ("float16", 64, 384, 384, 2, 2, False, 1, 128, None, 30.0, False),  # 64: fp16, soft cap
    ("bfloat16", 64, 1, 300, 4, 2, True, 1, 128, None, None, False),    # 64: one query (decode)
    # head dim 256: its own layout (64-row kv tiles, the consumers splitting the head dim)
    ("bfloat16", 256, 777, 777, 8, 2, True, 2, 128, None, None, False),  # 256: GQA, odd, batch 2
    ("bfloat16", 256, 200, 600, 4, 1, True, 1, 64, 128, None, True),     # 256: window + sinks, MQA
    ("bfloat16", 256, 512, 512, 4, 1, True, 1, 64, None, 3.0, False),    # 256: soft cap that bends
    ("float16", 256, 384, 384, 2, 2, False, 1, 128, None, 30.0, False),  # 256: fp16 soft cap
    ("float16", 256, 640, 640, 8, 2, True, 1, 128, 128, 30.0, True),     # 256: fp16, all three
    ("bfloat16", 256, 1, 300, 4, 2, True, 1, 128, None, None, False),    # 256: one query (decode)
    ("bfloat16", 256, 256, 130, 2, 2, False, 1, 128, None, None, False), # 256: kv past a tile
    ("bfloat16", 256, 1024, 1024, 4, 2, True, 1, 128, 300, None, False), # 256: whole steps, window
    # MLA's (192, 128): its own layout (64-row kv tiles, the consumers splitting the products)
    ("bfloat16", (192, 128), 777, 777, 8, 2, True, 2, 128, None, None, False),  # GQA, batch 2
    ("bfloat16", (192, 128), 200, 600, 4, 1, True, 1, 64, 128, None, True),     # window + sinks
    ("bfloat16", (192, 128), 512, 512, 4, 1, True, 1, 64, None, 3.0, False),    # soft cap
    ("float16", (192, 128), 640, 640, 8, 2, True, 1, 128, 128, 30.0, True),     # fp16, all three
    ("float16", (192, 128), 384, 384, 2, 2, False, 1, 128, None, 30.0, False),  # fp16 not causal
    ("bfloat16", (192, 128), 1, 300, 4, 2, True, 1, 128, None, None, False),    # decode
    ("bfloat16", (192, 128), 256, 130, 2, 2, False, 1, 128, None, None, False), # kv past a tile
], ids=lambda v: f"d{v[0]}v{v[1]}" if isinstance(v, tuple) else None)
def test_hopper_features_and_head_dims(dtype, d, sq, skv, heads, kv_heads, causal, batch,
                                              bwd_q, window, cap, with_sinks):
  tolerance = {"bfloat16": 2e-2, "float16": 1e-2}[dtype]
  assert _errors(sq, skv, heads, kv_heads, causal, batch, bwd_q, dtype=dtype, window=window,
                 cap=cap, with_sinks=with_sinks, head_dim=d) < tolerance


def test_auto_takes_hopper_and_deterministic_takes_mosaic():
  """Where the library is there (or buildable), "auto" runs hopper for a call it covers and
  prefers, mosaic with a sliding window and the soft cap together, and
  deterministic_backward=True runs mosaic, whose backward is bitwise reproducible."""
  import jax.numpy as jnp

  from kvax_plugin.attention import kernels
  dims = (jnp.bfloat16, 128, 128, ("causal", "gqa", "backward"))
  assert kernels.resolve_backend_for("auto", *dims) == "hopper"
  assert kernels.resolve_backend_for("auto", *dims, deterministic_backward=True) == "mosaic"
  assert _errors(384, 384, 4, 2, True, backend="auto") < 2e-2
  assert _errors(384, 384, 4, 2, True, backend="auto", deterministic_backward=True) < 2e-2
  # fp16, soft cap and sinks at head dim 128: hopper (hopper.auto_prefers), and the sliding
  # window too; the window with the soft cap: mosaic
  capped = (jnp.float16, 128, 128, ("causal", "gqa", "logits_soft_cap", "sinks", "backward"))
  assert kernels.resolve_backend_for("auto", *capped) == "hopper"
  assert _errors(384, 384, 4, 2, True, backend="auto", dtype="float16", cap=30.0,
                 with_sinks=True) < 1e-2
  windowed = (jnp.bfloat16, 128, 128, ("causal", "sliding_window", "backward"))
  assert kernels.resolve_backend_for("auto", *windowed) == "hopper"
  assert _errors(384, 384, 4, 2, True, backend="auto", window=128) < 2e-2
  capped_window = (jnp.bfloat16, 128, 128, ("causal", "sliding_window", "logits_soft_cap"))
  assert kernels.resolve_backend_for("auto", *capped_window) == "mosaic"
  assert _errors(384, 384, 4, 2, True, backend="auto", window=128, cap=30.0) < 2e-2


def test_by_mask_runs_the_backward_its_threshold_picks(monkeypatch):
  """HopperOptions(backward="by_mask") (what "auto" runs): from threshold 0 every call takes the
  Mosaic backward, whose gradients then equal backend="mosaic"'s bit for bit; above 1 none does,
  and the CUDA backward matches the reference."""
  import jax
  import numpy as np

  import kvax_plugin as kp
  from kvax_plugin.attention.kernels import hopper
  by_mask = kp.HopperOptions(backward="by_mask")
  mosaic_grads, by_mask_grads, cuda_grads = [], [], []
  monkeypatch.setattr(hopper, "mosaic_backward_from", lambda *a, **k: 0.0)
  jax.clear_caches()  # a cached trace would keep the threshold it was traced with
  assert _errors(640, 640, 4, 2, True, kernel_options=by_mask, results=by_mask_grads) < 2e-2
  assert _errors(640, 640, 4, 2, True, backend="mosaic", results=mosaic_grads) < 2e-2
  for ours, theirs in zip(by_mask_grads, mosaic_grads):
    np.testing.assert_array_equal(ours, theirs)
  monkeypatch.setattr(hopper, "mosaic_backward_from", lambda *a, **k: 2.0)
  jax.clear_caches()
  assert _errors(640, 640, 4, 2, True, kernel_options=by_mask, results=cuda_grads) < 2e-2
  # the CUDA backward ran: its dq (float32 reduce-adds in launch order) is not the Mosaic one's
  assert not np.array_equal(cuda_grads[1], mosaic_grads[1])


@pytest.mark.parametrize("head_dim", [128, 64, 256])
def test_any_launch_order_gives_the_same_gradients(monkeypatch, head_dim):
  """The kernel runs the (kv head, kv tile) pairs in its `order` input's sequence
  (fused_backward.launch_order): with the pairs reversed or shuffled, each CTA still computes its
  own pair, so dk and dv are bitwise the default's and dq (float32 reduce-adds in another order)
  within rounding; every run matches the reference."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  default, *others = [], [], []
  assert _errors(640, 640, 4, 2, True, head_dim=head_dim, results=default) < 2e-2
  perm = np.random.default_rng(head_dim).permutation
  launch_order = cuda_bwd.launch_order  # the default, before the patches below replace it

  def shuffled(bounds, n_tiles, kv_heads, layout, wave=None):
    codes = np.array([(k << 20) | t for k in range(kv_heads) for t in range(n_tiles)])
    return jnp.asarray(np.stack([codes[perm(codes.size)] for _ in range(bounds[0].shape[0])]),
                       jnp.int32)
  orders = (lambda *a, **kw: launch_order(*a, **kw)[:, ::-1], shuffled)
  for order, results in zip(orders, others):
    calls = []
    monkeypatch.setattr(cuda_bwd, "launch_order",
                        lambda *a, **kw: calls.append(a) or order(*a, **kw))
    jax.clear_caches()  # a cached trace would run the default order again
    assert _errors(640, 640, 4, 2, True, head_dim=head_dim, results=results) < 2e-2
    assert calls, "the patched launch order was never called"
    np.testing.assert_array_equal(results[0], default[0])  # out: the forward's
    np.testing.assert_array_equal(results[2], default[2])  # dk
    np.testing.assert_array_equal(results[3], default[3])  # dv
    np.testing.assert_allclose(results[1].astype(np.float32), default[1].astype(np.float32),
                               rtol=2e-2, atol=2e-2)


def test_the_library_is_the_one_for_this_source():
  """The loaded library is a prebuilt or cached one whose recorded key is this source's (or
  was just built into the cache under it)."""
  from kvax_plugin.attention.kernels.cuda_sm90 import build
  cuda_bwd.load()
  assert build.cached_library() is not None


def test_hopper_runs_on_every_gpu_of_the_process():
  """backend="hopper" on each visible GPU in turn, against the float32 reference: the handler's
  per-device state (the kernel's shared-memory limit: a context-parallel run hangs when only
  the first device has it). benchmarks/hopper_on_each_device.py is the same check as a
  program."""
  import jax
  import hopper_on_each_device as each
  for device in jax.devices():
    assert each.check_device(device) < 2e-2, device
