"""The MaxText plugin's contract: install/uninstall, version guard, config keys, routing, one
mask per step."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_results import report

pytestmark = pytest.mark.maxtext


def test_install_is_idempotent_and_reversible():
  from maxtext.configs import pyconfig
  from maxtext.layers import attention_op, nnx_decoders
  from maxtext.utils import train_utils
  from kvax_plugin.integrations import maxtext as kvax_maxtext

  def targets():
    return (attention_op.AttentionOp.apply_attention, nnx_decoders.NNXDecoder.__call__,
            pyconfig.initialize, pyconfig.initialize_pydantic, train_utils.setup_train_loop)

  kvax_maxtext.uninstall()
  originals = targets()
  kvax_maxtext.install()
  try:
    wrapped = targets()
    assert all(w is not o for w, o in zip(wrapped, originals))
    kvax_maxtext.install()  # a second install changes nothing
    assert wrapped == targets()
    assert kvax_maxtext.is_installed()
  finally:
    kvax_maxtext.uninstall()
  assert targets() == originals
  assert not kvax_maxtext.is_installed()
  kvax_maxtext.uninstall()  # uninstalling twice is harmless


def test_uninstalled_maxtext_rejects_kvax_and_its_keys():
  import maxtext_harness as H
  from kvax_plugin.integrations import maxtext as kvax_maxtext

  kvax_maxtext.uninstall()
  with pytest.raises(Exception, match=r"'kvax_\w+' not in"):
    H.make_config("llama3-8b", "kvax")  # MaxText's strict config: unknown key
  no_kvax_keys = {k: v for k, v in H.COMMON.items() if not k.startswith("kvax_")}
  original = H.COMMON
  H.COMMON = no_kvax_keys
  try:
    config = H.make_config("llama3-8b", "kvax", seq_len=64, batch_per_device=1)
  finally:
    H.COMMON = original
  model, mesh = H.make_model(config)
  batch = H.packed_batch(1, 64, config.vocab_size)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="Unexpected attention kernel"):
    model(batch.tokens, batch.positions, batch.segment_ids, enable_dropout=False)


def test_version_guard_names_supported_versions(monkeypatch):
  from maxtext import version
  from maxtext.layers import attention_op
  from kvax_plugin.integrations import maxtext as kvax_maxtext

  kvax_maxtext.uninstall()
  monkeypatch.setattr(version, "__version__", "9.9.9")
  with pytest.raises(kvax_maxtext.MaxTextVersionError, match=r"9\.9\.9.*0\.2\.5"):
    kvax_maxtext.install()
  assert not kvax_maxtext.is_installed()

  def changed(self, query, key, value, segment_ids, model_mode):  # a renamed/reordered API
    raise AssertionError("never called")

  monkeypatch.setattr(attention_op.AttentionOp, "apply_attention", changed)
  with pytest.raises(kvax_maxtext.MaxTextVersionError, match="apply_attention changed.*0.2.5"):
    kvax_maxtext.install(allow_unsupported_version=True)
  assert not kvax_maxtext.is_installed()


def test_kvax_config_keys(kvax_installed):
  import maxtext_harness as H
  config = H.make_config("llama3-8b", "kvax", extra=dict(kvax_backend="reference",
                                                         kvax_fwd_query_block_size=64))
  options = kvax_installed.options_from_config(config)
  assert options.backend == "reference" and options.fwd_params.query_block_size == 64
  assert options.bwd_params.kv_block_size == 32
  with pytest.raises(Exception, match="'kvax_not_a_key' not in"):
    H.make_config("llama3-8b", "kvax", extra=dict(kvax_not_a_key=1))
  bad = H.make_config("llama3-8b", "kvax", extra=dict(kvax_backend="cuda"))
  with pytest.raises(ValueError, match="kvax_backend='cuda'"):
    kvax_installed.options_from_config(bad)
  bad = H.make_config("llama3-8b", "kvax", extra=dict(kvax_bwd_kv_block_size=48))
  with pytest.raises(ValueError, match="kvax_bwd_kv_block_size=48"):
    kvax_installed.options_from_config(bad)
  assert (options.kv_grad_reduce_dtype, options.overlap_kv_gather) == ("auto", False)
  lever = H.make_config("llama3-8b", "kvax", extra=dict(kvax_kv_grad_reduce_dtype="input",
                                                        kvax_overlap_kv_gather=True))
  lever = kvax_installed.options_from_config(lever)
  assert (lever.kv_grad_reduce_dtype, lever.overlap_kv_gather) == ("input", True)
  bad = H.make_config("llama3-8b", "kvax", extra=dict(kvax_kv_grad_reduce_dtype="bf16"))
  with pytest.raises(ValueError, match="kvax_kv_grad_reduce_dtype='bf16'"):
    kvax_installed.options_from_config(bad)


def test_padding_segment_mapping():
  """MaxText's padding (0) stays a segment (its attention lets padding attend earlier padding);
  only negative ids, which MaxText's mask drops as keys, become kvax padding."""
  from kvax_plugin import PADDING_SEGMENT_ID
  from kvax_plugin.integrations.maxtext import seam
  seg = jnp.array([[1, 1, 2, 0, 0, -1]], jnp.int32)
  np.testing.assert_array_equal(seam.to_kvax_segment_ids(seg, 1, 6),
                                [[1, 1, 2, 0, 0, PADDING_SEGMENT_ID]])
  np.testing.assert_array_equal(seam.to_kvax_segment_ids(None, 2, 3), np.zeros((2, 3)))


def test_positions_follow_maxtext_causality(kvax_installed):
  """Row indices where MaxText's attention measures causality in rows (whatever positions the
  pipeline wrote on padding), its positions under load-balanced context parallelism."""
  import maxtext_harness as H
  from kvax_plugin.integrations.maxtext import seam
  pos = jnp.array([[0, 1, 2, 0, 1, 0, 0]], jnp.int32)
  np.testing.assert_array_equal(seam.to_kvax_positions(pos, 1, 7, False), [np.arange(7)])
  np.testing.assert_array_equal(seam.to_kvax_positions(pos, 1, 7, True), pos)
  np.testing.assert_array_equal(seam.to_kvax_positions(None, 2, 3, True), [np.arange(3)] * 2)
  from maxtext.utils import maxtext_utils
  config = H.make_config("llama3-8b", "kvax")
  mesh = maxtext_utils.get_mesh_from_config(config)
  assert not seam.masks_by_positions(config, mesh)  # one device: MaxText uses row indices


class _FakeOp:
  """Stands in for AttentionOp in routing tests: records what MaxText's own path receives."""

  def __init__(self, attention_type):
    self.attention_type = attention_type
    self.calls = []

  def apply_attention_dot(self, *args, **kwargs):
    self.calls.append((args, kwargs))
    return "maxtext-path"


@pytest.mark.parametrize("case", ["autoregressive", "chunk", "bidirectional", "indexer",
                                  "previous_chunk", "full"])
def test_unservable_calls_use_maxtext_path_with_a_note(case, caplog):
  from maxtext.common.common_types import (MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_TRAIN,
                                           AttentionType)
  from kvax_plugin.integrations.maxtext import seam

  kind = {"chunk": AttentionType.CHUNK, "full": AttentionType.FULL}.get(case, AttentionType.GLOBAL)
  op = _FakeOp(kind)
  q = jnp.zeros((1, 8, 2, 16))
  kwargs = dict(decoder_segment_ids=None, segment_positions=None, lengths=None,
                model_mode=MODEL_MODE_AUTOREGRESSIVE if case == "autoregressive" else MODEL_MODE_TRAIN,
                qk_product_einsum=jnp.einsum, wv_product_einsum=jnp.einsum)
  if case == "bidirectional":
    kwargs["bidirectional_mask"] = jnp.ones((1, 8), bool)
  if case == "indexer":
    kwargs["indexer_mask"] = jnp.ones((1, 8, 8), bool)
  if case == "previous_chunk":
    kwargs["previous_chunk"] = jnp.zeros((1, 4))
  seam._NOTED.clear()
  with caplog.at_level(logging.WARNING, logger="kvax_plugin.integrations.maxtext"):
    assert seam.apply_attention(op, q, q, q, **kwargs) == "maxtext-path"
  assert len(op.calls) == 1
  assert "use MaxText's dot_product path" in caplog.text


def test_local_layer_without_window_is_an_error():
  from maxtext.common.common_types import AttentionType
  from kvax_plugin.integrations.maxtext import seam
  op = _FakeOp(AttentionType.LOCAL_SLIDING)
  op.sliding_window_size, op.attn_logits_soft_cap = 0, None
  with pytest.raises(ValueError, match="sliding_window_size"):
    seam.layer_settings(op)
  op.sliding_window_size, op.attn_logits_soft_cap = 64, 50.0
  s = seam.layer_settings(op)
  assert (s.sliding_window, s.logits_soft_cap, s.scale, s.causal) == (64, 50.0, 1.0, True)


@pytest.mark.parametrize("model_name,scan_layers,masks", [
    ("llama3-8b", True, 1), ("llama3-8b", False, 1), ("gemma2-2b", True, 2)])
def test_mask_is_built_once_per_step(kvax_installed, model_name, scan_layers, masks):
  """Trace one training step (forward + backward): one prepare, one build per window."""
  import maxtext_harness as H
  from kvax_plugin.providers import kvax_provider

  config = H.make_config(model_name, "kvax", seq_len=128,
                         extra=dict(scan_layers=scan_layers, base_num_decoder_layers=2))
  model, mesh = H.make_model(config)
  batch = H.packed_batch(config.global_batch_size_to_train_on, config.max_target_length,
                         config.vocab_size)
  before = dict(kvax_provider.TRACE_COUNTS)
  with jax.set_mesh(mesh):
    loss, _, _ = H.value_and_grads(model, batch)  # nnx.jit: traced once, then run
  assert np.isfinite(float(loss))
  counts = {k: kvax_provider.TRACE_COUNTS[k] - before.get(k, 0)
            for k in ("prepare", "mask_builds", "apply")}
  layers = config.num_decoder_layers * (2 if model_name.startswith("gemma2") else 1)
  report(f"[mask once] {model_name} scan_layers={scan_layers} ({layers} attention layers): "
         f"{counts}")
  assert counts["prepare"] == 1
  assert counts["mask_builds"] == masks
  assert counts["apply"] >= (1 if scan_layers else layers)


def test_maxtext_seam_goes_through_the_provider_registry(kvax_installed, monkeypatch):
  """The seam asks the registry for "kvax" at the decoder entry and in every layer: a provider
  registered under that name in its place is the one that runs (here a recorder around the
  real one), with the options built from the config's kvax_* keys."""
  import dataclasses
  import maxtext_harness as H
  from kvax_plugin import providers

  real = providers.get_provider("kvax")
  calls = []

  def prepare(*args, **kwargs):
    calls.append(("prepare", kwargs["options"]))
    return real.prepare(*args, **kwargs)

  def apply(query, key, value, prepared, settings, **kwargs):
    calls.append(("apply", settings))
    return real.apply(query, key, value, prepared, settings, **kwargs)
  monkeypatch.setitem(providers._REGISTRY, "kvax",
                      dataclasses.replace(real, prepare=prepare, apply=apply))
  config = H.make_config("llama3-8b", "kvax", seq_len=128,
                         extra=dict(scan_layers=True, base_num_decoder_layers=2))
  model, mesh = H.make_model(config)
  batch = H.packed_batch(config.global_batch_size_to_train_on, config.max_target_length,
                         config.vocab_size)
  with jax.set_mesh(mesh):
    loss, _, _ = H.value_and_grads(model, batch)
  assert np.isfinite(float(loss))
  kinds = [kind for kind, _ in calls]
  assert kinds[0] == "prepare" and kinds.count("prepare") == 1 and "apply" in kinds, kinds
  options = calls[0][1]
  assert isinstance(options, real.options_type)
  assert options.backend == config.kvax_backend
  assert options.fwd_params.query_block_size == config.kvax_fwd_query_block_size
  assert all(s.causal and s.sliding_window is None for kind, s in calls if kind == "apply")
