"""Levanter's dot_product_attention with attn_backend=kvax, called directly (no decoder entry).

Outside a wrapped decoder entry the seam builds the block mask per call (and says so once);
inside one it reads the entry's. Each case runs kvax and Levanter's vanilla attention on the
same named arrays, float32, and compares outputs on every query row and the gradients of q, k, v
(and sinks) under a random cotangent on every row: Levanter's padding (-1) attends earlier
padding, and those rows feed training too (e.g. MoE router losses average over them), so the
seam must give them as well. Then what kvax does not serve: it must reach Levanter's default
path, with a logged note.
"""

from __future__ import annotations

import logging
import os

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

SEED = int(os.environ.get("KVAX_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
B, S, K, G, D = 2, 48, 2, 2, 16
Batch, Pos, KPos = hax.Axis("batch", B), hax.Axis("position", S), hax.Axis("key_position", S)
KVHead, Group = hax.Axis("kv_head", K), hax.Axis("q_heads_per_group", G)


def _segments(rng, contiguous=True):
  """[B, S] segment ids: documents of 1..20 tokens, -1 padding at the end of each row;
  non-contiguous: the same ids shuffled within the non-padding part of each row."""
  seg = np.full((B, S), -1, np.int32)
  for r in range(B):
    fill = int(rng.integers(S // 2, S - 1))
    start, doc = 0, 0
    while start < fill:
      n = min(int(rng.integers(1, 21)), fill - start)
      seg[r, start:start + n] = doc
      start, doc = start + n, doc + 1
    if not contiguous:
      seg[r, :fill] = rng.permutation(seg[r, :fill])
  return seg


def _inputs(rng, seg, d=D):
  dim = hax.Axis("head_size", d)
  q = hax.named(jnp.asarray(rng.normal(size=(B, K, G, S, d)), jnp.float32),
                (Batch, KVHead, Group, Pos, dim))
  k = hax.named(jnp.asarray(rng.normal(size=(B, K, S, d)), jnp.float32), (Batch, KVHead, KPos, dim))
  v = hax.named(jnp.asarray(rng.normal(size=(B, K, S, d)), jnp.float32), (Batch, KVHead, KPos, dim))
  valid = np.ones((B, S), bool) if seg is None else seg >= 0
  ct = rng.normal(size=(B, K, G, S, d))  # padding rows too: they must be Levanter's as well
  cot = hax.named(jnp.asarray(ct, jnp.float32), (Batch, KVHead, Group, Pos, dim))
  return q, k, v, cot, valid


def _attend(backend, mask, q, k, v, cot, sink=None, **kwargs):
  """(output, grads of q, k, v, sink) for one backend."""
  from levanter.layers.attention import AttentionBackend, dot_product_attention

  def f(q, k, v, sink):
    out = dot_product_attention("position", "key_position", "head_size", q, k, v, mask,
                                attn_backend=AttentionBackend(backend), attn_sink=sink, **kwargs)
    out = out.rearrange((Batch, KVHead, Group, Pos, "head_size"))
    return hax.sum(out * cot).scalar(), out

  @jax.jit
  def run(q, k, v, sink):
    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sink)
    return out, grads

  out, grads = run(q, k, v, sink)
  return np.asarray(out.array), [None if g is None else np.asarray(g.array) for g in grads]


def _assert_same(ref, got, what):
  """Outputs on every row (padding included) and the gradients agree to 2e-6 relative."""
  out_r, grads_r = ref
  out_c, grads_c = got
  diff = np.abs(out_r - out_c).max() / np.abs(out_r).max()
  assert diff <= 2e-6, f"{what}: outputs differ by {diff:.2e} (relative)"
  for name, gr, gc in zip("qkv" + "s", grads_r, grads_c):
    if gr is None:
      continue
    diff = np.abs(gr - gc).max() / max(np.abs(gr).max(), 1e-30)
    assert diff <= 2e-6, f"{what}: d{name} differs by {diff:.2e} (relative)"


def _masks():
  from levanter.layers.attention import AttentionMask
  return AttentionMask


@pytest.mark.parametrize("case", ["causal_docs", "causal_window", "non_contiguous_causal",
                                  "bidirectional_docs", "bidirectional_window", "no_mask",
                                  "sinks", "softcap_traced_scale", "sinks_softcap"])
def test_matches_vanilla(case, kvax_levanter, seam_counts, caplog):
  AttentionMask = _masks()
  rng = np.random.default_rng([SEED, len(case)])
  seg = None if case == "no_mask" else _segments(rng, contiguous=case != "non_contiguous_causal")
  q, k, v, cot, _ = _inputs(rng, seg)
  named_seg = None if seg is None else hax.named(jnp.asarray(seg), (Batch, Pos))
  kwargs, sink = {}, None
  if case in ("causal_docs", "non_contiguous_causal", "sinks", "softcap_traced_scale",
              "sinks_softcap"):
    mask = AttentionMask.causal().with_segment_ids(named_seg)
  elif case == "causal_window":
    mask = AttentionMask.causal(sliding_window=7).with_segment_ids(named_seg)
  elif case == "bidirectional_docs":
    mask = AttentionMask(is_causal=False).with_segment_ids(named_seg)
  elif case == "bidirectional_window":
    mask = AttentionMask.bidirectional_sliding_window(5).with_segment_ids(named_seg)
  else:
    mask = None
  if "sinks" in case:
    sink = hax.named(jnp.asarray(rng.normal(size=(K, G)), jnp.float32), (KVHead, Group))
  if "softcap" in case:
    kwargs["logits_soft_cap"] = 3.0
  if "traced_scale" in case:
    kwargs["scaling_factor"] = jnp.float32(0.4)  # not a Python float: the query is pre-scaled
  with caplog.at_level(logging.WARNING, logger="kvax_plugin.integrations.levanter"):
    got = _attend("kvax", mask, q, k, v, cot, sink, **kwargs)
  ref = _attend("vanilla", mask, q, k, v, cot, sink, **kwargs)
  _assert_same(ref, got, f"{case} (KVAX_TEST_SEED={SEED})")
  assert seam_counts["routed"] == 0 and seam_counts["per_call_masks"] == 1, dict(seam_counts)


@pytest.mark.parametrize("case", ["bias", "explicit_mask", "head_dim_8", "causal_offset"])
def test_unserved_calls_go_to_levanter(case, kvax_levanter, seam_counts, caplog):
  """kvax does not serve these: the call reaches Levanter's default path (JAX flash on CPU),
  whose result equals vanilla's, and a note says why."""
  AttentionMask = _masks()
  from kvax_plugin.integrations.levanter import seam
  rng = np.random.default_rng([SEED, len(case)])
  seg = _segments(rng)
  q, k, v, cot, valid = _inputs(rng, seg, d=8 if case == "head_dim_8" else D)
  named_seg = hax.named(jnp.asarray(seg), (Batch, Pos))
  mask = AttentionMask.causal().with_segment_ids(named_seg)
  kwargs = {}
  if case == "bias":
    kwargs["bias"] = hax.named(jnp.asarray(rng.normal(size=(S, S)), jnp.float32), (Pos, KPos))
    expected = "additive attention bias"
  elif case == "explicit_mask":
    dense = hax.named(jnp.asarray(np.tril(np.ones((S, S), bool))), (Pos, KPos))
    mask = AttentionMask.explicit(dense).with_segment_ids(named_seg)
    expected = "explicit (dense) mask"
  elif case == "head_dim_8":
    expected = "head dim 8"
  else:
    mask = AttentionMask.causal(offset=0).with_segment_ids(named_seg)
    expected = "causal_offset"
  seam._NOTED.clear()
  with caplog.at_level(logging.WARNING, logger="kvax_plugin.integrations.levanter"):
    got = _attend("kvax", mask, q, k, v, cot, **kwargs)
  assert seam_counts["routed"] >= 1 and seam_counts["layer_calls"] == 0, dict(seam_counts)
  assert any(expected in r.getMessage() and "Levanter's default" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]
  ref = _attend("vanilla", mask, q, k, v, cot, **kwargs)
  # Levanter's JAX flash attention against its vanilla attention: its own (looser) agreement.
  out_r, out_c = ref[0], got[0]
  rows = np.broadcast_to(valid[:, None, None, :, None], out_r.shape)
  np.testing.assert_allclose(out_c[rows], out_r[rows], atol=2e-5, rtol=2e-5)


def test_padding_is_a_segment_of_its_own():
  """Negative ids (Levanter's padding) become ordinary kvax segments above the row's largest
  id, one per negative value (Levanter's mask is plain equality); positions are row indices."""
  from kvax_plugin.integrations.levanter import seam
  seg = jnp.array([[0, 0, 1, -1, -1], [-1, -1, -1, -1, -1], [3, -2, 3, -1, -2]], jnp.int32)
  q_pos, q_seg, kv_pos, kv_seg = seam.kvax_tokens(seg)
  np.testing.assert_array_equal(q_pos, [np.arange(5)] * 3)
  np.testing.assert_array_equal(kv_pos, q_pos)
  np.testing.assert_array_equal(q_seg, [[0, 0, 1, 2, 2], [0, 0, 0, 0, 0], [3, 5, 3, 4, 5]])
  np.testing.assert_array_equal(kv_seg, q_seg)
  # Query and key/value ids apart: numbered above the largest of both.
  _, q_seg, _, kv_seg = seam.kvax_tokens(jnp.array([[0, -1]]), jnp.array([[4, -1]]))
  np.testing.assert_array_equal(q_seg, [[0, 5]])
  np.testing.assert_array_equal(kv_seg, [[4, 5]])


def test_levanter_seam_goes_through_the_provider_registry(kvax_levanter, seam_counts,
                                                           monkeypatch):
  """The seam asks the registry for "kvax" to build the masks and to run each layer, as
  MaxText's does: a provider registered under that name in its place is the one that runs (here
  a recorder around the real one), with the options from the settings in force, and the result
  is still Levanter's."""
  import dataclasses
  from kvax_plugin import providers
  AttentionMask = _masks()
  real = providers.get_provider("kvax")
  calls = []

  def prepare(*args, **kwargs):
    calls.append(("prepare", kwargs["mask_keys"], kwargs["options"]))
    return real.prepare(*args, **kwargs)

  def apply(query, key, value, prepared, settings, **kwargs):
    calls.append(("apply", settings, prepared.options))
    return real.apply(query, key, value, prepared, settings, **kwargs)
  monkeypatch.setitem(providers._REGISTRY, "kvax",
                      dataclasses.replace(real, prepare=prepare, apply=apply))
  rng = np.random.default_rng([SEED, 67])
  seg = _segments(rng)
  q, k, v, cot, _ = _inputs(rng, seg)
  mask = AttentionMask.causal(sliding_window=7).with_segment_ids(
      hax.named(jnp.asarray(seg), (Batch, Pos)))
  got = _attend("kvax", mask, q, k, v, cot, logits_soft_cap=3.0)
  _assert_same(_attend("vanilla", mask, q, k, v, cot, logits_soft_cap=3.0), got,
               f"through a registered provider (KVAX_TEST_SEED={SEED})")
  assert [c[0] for c in calls] == ["prepare", "apply"], calls
  (_, keys, options), (_, settings, applied) = calls
  assert list(keys) == [(True, 7)]
  assert isinstance(options, real.options_type) and applied == options
  assert (options.backend, options.fwd_params.query_block_size, options.mesh,
          options.deterministic_backward) == ("auto", 16, None, False)
  assert (settings.causal, settings.sliding_window, settings.logits_soft_cap,
          settings.scale) == (True, 7, 3.0, pytest.approx(D ** -0.5))
  assert seam_counts["per_call_masks"] == 1 and seam_counts["layer_calls"] == 1
