"""install() / uninstall(), the config string, settings and the haliax -> kvax spec mapping."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest


def _targets():
  from levanter.layers import attention
  from levanter.models import gpt2, llama, qwen
  return attention, gpt2, llama, qwen


def test_install_is_idempotent_and_reversible(kvax_levanter):
  import draccus
  from levanter.models.lm_model import LmConfig
  attention, gpt2, llama, qwen = _targets()
  routed = attention.dot_product_attention
  original = routed.__kvax_original__
  entry = llama.LlamaTransformer.__call__
  kvax_levanter.install()  # again: nothing wrapped twice
  assert attention.dot_product_attention is routed
  assert llama.LlamaTransformer.__call__ is entry
  assert gpt2.dot_product_attention is routed  # imported by name there: replaced too
  assert attention.AttentionBackend("kvax") is attention.AttentionBackend.KVAX
  try:
    kvax_levanter.uninstall()
    assert not kvax_levanter.is_installed()
    assert attention.dot_product_attention is original
    assert gpt2.dot_product_attention is original
    assert llama.LlamaTransformer.__call__ is entry.__kvax_original__
    assert "__call__" in qwen.QwenTransformer.__dict__  # its own __call__ is back, unwrapped
    assert not hasattr(qwen.QwenTransformer.__call__, "__kvax_original__")
    assert "kvax" not in [b.value for b in attention.AttentionBackend]
    with pytest.raises(Exception, match="kvax"):
      draccus.decode(LmConfig, {"type": "llama", "attn_backend": "kvax"})
    kvax_levanter.uninstall()  # a no-op now
  finally:
    kvax_levanter.install()
  assert attention.dot_product_attention.__kvax_original__ is original
  assert draccus.decode(LmConfig, {"type": "llama", "attn_backend": "kvax"}).attn_backend == "kvax"


def test_config_string_on_levanters_command_line(kvax_levanter):
  """`--model.attn_backend kvax` on train_lm's command line, for any registered family."""
  import draccus
  from levanter.layers.attention import AttentionBackend
  from levanter.main.train_lm import TrainLmConfig
  for family in ("llama", "qwen3", "gemma2", "mixtral"):
    cfg = draccus.parse(TrainLmConfig,
                        args=["--model.type", family, "--model.attn_backend", "kvax"])
    assert cfg.model.attn_backend is AttentionBackend.KVAX
    assert cfg.model.attention_config().attn_backend is AttentionBackend.KVAX \
        if hasattr(cfg.model, "attention_config") else True
    assert "- kvax" in draccus.dump(cfg.model)  # saved configs keep the string


def test_version_guard(kvax_levanter, monkeypatch):
  from kvax_plugin.integrations.levanter import _install, versions
  kvax_levanter.uninstall()
  try:
    monkeypatch.setattr(versions, "installed_version", lambda: "0.1.0")
    with pytest.raises(versions.LevanterVersionError, match="0.2.227.dev40316220070"):
      kvax_levanter.install()
    assert not kvax_levanter.is_installed()
    kvax_levanter.install(allow_unsupported_version=True)  # signatures still match: allowed
    assert kvax_levanter.is_installed()
  finally:
    kvax_levanter.uninstall()
    monkeypatch.undo()
    kvax_levanter.install()
  del _install


def test_signature_change_is_refused():
  from kvax_plugin.integrations.levanter import versions

  def renamed(self, hidden, attn_mask, *, key, pos_ids=None):
    return hidden

  with pytest.raises(versions.LevanterVersionError, match=r"Transformer\.__call__ changed"):
    versions.check_signature("Transformer.__call__", "Transformer.__call__", renamed)


def test_settings_errors_and_environment(monkeypatch):
  from kvax_plugin.integrations.levanter import settings
  with pytest.raises(ValueError, match="kernel='cuda'"):
    settings.KvaxLevanterSettings(kernel="cuda")
  with pytest.raises(ValueError, match="block_size=24"):
    settings.KvaxLevanterSettings(block_size=24)
  monkeypatch.setenv(settings.ENV_BACKEND, "jax")
  monkeypatch.setenv(settings.ENV_BLOCK_SIZE, "32")
  s = settings.from_environment()
  assert (s.kernel, s.block_size) == ("jax", 32)
  fwd, bwd = s.params()
  assert fwd.query_block_size == fwd.kv_block_size == bwd.kv_block_size == 32
  monkeypatch.setenv(settings.ENV_BLOCK_SIZE, "big")
  with pytest.raises(ValueError, match="KVAX_LEVANTER_BLOCK_SIZE"):
    settings.from_environment()
  monkeypatch.delenv(settings.ENV_BLOCK_SIZE)
  monkeypatch.delenv(settings.ENV_BACKEND)
  assert settings.KvaxLevanterSettings().params() == (None, None)
  previous = settings.configure(kernel="reference")
  try:
    assert settings.current().kernel == "reference"
    assert settings.current().block_size == previous.block_size  # other fields kept
    with pytest.raises(TypeError):
      settings.configure(settings.KvaxLevanterSettings(), kernel="jax")
  finally:
    settings.configure(previous)


def test_explicit_kernel_never_falls_back(kvax_levanter):
  """kernel="triton" where Triton cannot run (this CPU): kvax's error, not another kernel."""
  import kvax_plugin
  import levanter_harness as harness
  previous = kvax_levanter.configure(kernel="triton")
  try:
    model = harness.init_model(harness.config("llama", "kvax", num_layers=1), seed=0)
    batch = harness.packed_batch(np.random.default_rng(0), batch=1)
    with pytest.raises(kvax_plugin.BackendUnavailableError):
      harness.run(model, batch)
  finally:
    kvax_levanter.configure(previous)


# ----------------------------------------------------------------------------- specs


def _layout(kv, groups, batch=4, seq=64):
  import haliax as hax
  from kvax_plugin.integrations.levanter import axes
  return axes.Layout(batch=(hax.Axis("batch", batch),), q_pos=hax.Axis("position", seq),
                     kv_pos=hax.Axis("key_position", seq), kv_heads=(hax.Axis("kv_head", kv),),
                     groups=(hax.Axis("q_heads_per_group", groups),),
                     qk_dim=hax.Axis("head_size", 16), v_dim=hax.Axis("head_size", 16))


@pytest.mark.parametrize("mapping,kv,groups,expected", [
    ({"kv_head": "model"}, 2, 2, ("model",)),  # one kv head per shard
    ({"kv_head": "model"}, 4, 2, ("model",)),  # two kv heads per shard
    ({"q_heads_per_group": "model"}, 1, 4, ("model",)),  # MQA: query heads split, kv shared
    ({"q_heads_per_group": "model"}, 2, 4, ()),  # groups split under 2 kv heads: not a block
    ({"kv_head": "model", "q_heads_per_group": "data"}, 2, 2, ("model",)),  # data: the batch
    ({"heads": "model", "mlp": "model"}, 2, 2, ()),  # Levanter's default: attention unmapped
])
def test_head_axes_from_haliax_mapping(mapping, kv, groups, expected):
  import haliax as hax
  from jax.sharding import AbstractMesh
  from kvax_plugin.integrations.levanter import axes
  mesh = AbstractMesh((2, 2), ("data", "model"))
  layout = _layout(kv, groups)
  with hax.axis_mapping({"batch": "data", **mapping}):
    tokens = axes.token_specs(mesh, layout.batch, layout.q_pos)
    assert tokens == axes.TokenSpecs(("data",), ())
    assert axes.head_axes(mesh, layout, tokens) == expected


def test_token_specs_context_and_indivisible():
  import haliax as hax
  from jax.sharding import AbstractMesh
  from kvax_plugin.integrations.levanter import axes
  mesh = AbstractMesh((2, 2, 1), ("data", "context", "replica"))
  layout = _layout(2, 2, batch=3)
  with hax.axis_mapping({"batch": ("replica", "data"), "position": "context"}):
    # batch 3 does not split over data 2: left unsharded (XLA reshards around the call)
    assert axes.token_specs(mesh, layout.batch, layout.q_pos) == axes.TokenSpecs((), ("context",))
    q_specs, kv_specs = axes.specs(axes.TokenSpecs(("replica", "data"), ("context",)), ("model",))
    assert q_specs == (("replica", "data"), "context", "model", None)
    assert kv_specs == (("replica", "data"), None, "model", None)


def test_train_lm_launcher_parses_kvax(kvax_levanter, monkeypatch):
  """The launcher hands its command line to Levanter's train_lm with kvax installed (train_lm's
  main is replaced here by a stub that keeps the parsed config)."""
  from kvax_plugin.integrations.levanter import train_lm as launcher
  from levanter.layers.attention import AttentionBackend
  from levanter.main import train_lm
  seen = []

  def stub(config):
    seen.append(config)

  stub.__annotations__ = {"config": train_lm.TrainLmConfig}  # Levanter reads the class off it

  monkeypatch.setattr(train_lm, "main", stub)
  monkeypatch.setattr("sys.argv", ["train_lm", "--model.type", "gemma2",
                                   "--model.attn_backend", "kvax", "--trainer.num_train_steps", "3"])
  launcher.main()
  (config,) = seen
  assert config.model.attn_backend is AttentionBackend.KVAX
  assert config.trainer.num_train_steps == 3
