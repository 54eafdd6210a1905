"""kvax_plugin.launch and configs/: every family config loads, bad flags fail naming the flag,
and a tiny MaxText training run on the packed corpus writes its pictures, TensorBoard events and
finite, falling losses.

Flag errors run the launcher in a subprocess (absl flags are process-global); the end-to-end run
does too, so MaxText's patched state never leaks into other tests. CPU only; about a minute.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
FAMILIES = ("llama3", "mistral", "gemma2", "qwen3", "gpt_oss", "deepseek")
# Keys that define attention: a tiny variant may change head counts (keeping the ratio) but none
# of these.
ATTENTION_KEYS = ("head_dim", "sliding_window_size", "attn_logits_soft_cap", "attention_sink",
                  "attention_type", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "q_lora_rank", "kv_lora_rank")

has_maxtext = importlib.util.find_spec("maxtext") is not None
needs_maxtext = pytest.mark.skipif(not has_maxtext, reason="needs the [maxtext] extra")


def has_gpu() -> bool:
  import jax
  return jax.default_backend() == "gpu"


def load_family(family: str):
  spec = importlib.util.spec_from_file_location(f"_kvax_cfg_{family}",
                                                os.path.join(CONFIGS, f"{family}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_launcher(*args: str, timeout: int = 240, cwd: str = ROOT) -> subprocess.CompletedProcess:
  # One CPU device, as a user's machine has (tests/conftest.py simulates 8 for the sharding tests).
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "xla_force_host_platform_device_count" not in f)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  return subprocess.run([sys.executable, "-m", "kvax_plugin.launch", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)


def upstream_yml(model: str) -> dict:
  import maxtext
  import yaml
  with open(os.path.join(os.path.dirname(maxtext.__file__), "configs", "models",
                         f"{model}.yml")) as f:
    return yaml.safe_load(f)


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_every_variant_loads(family):
  module = load_family(family)
  assert "tiny" in module.VARIANTS and len(module.VARIANTS) >= 2
  assert f"--config=configs/{family}.py:tiny" in module.__doc__  # the command line is shown
  for variant in module.VARIANTS:
    c = module.get_config(variant)
    assert (c.family, c.variant) == (family, variant)
    for field in ("model", "attention", "kvax", "mesh", "context_parallel_load_balance",
                  "seq_len", "per_device_batch_size", "steps", "learning_rate", "data",
                  "output_dir", "model_overrides"):
      assert field in c, field
    assert c.attention == "kvax" and c.kvax.backend == "auto"
    assert set(c.mesh) >= {"ici_data", "ici_fsdp", "ici_tensor", "ici_context", "dcn_data"}
    if variant != "tiny":
      assert not c.model_overrides, "upstream sizes run MaxText's model yml unchanged"
  assert module.get_config(None).variant == "tiny"  # no argument selects tiny


@needs_maxtext
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_keeps_the_familys_attention(family):
  module = load_family(family)
  for variant in module.VARIANTS:
    upstream_yml(module.get_config(variant).model)  # the model yml exists in MaxText
  c = module.get_config("tiny")
  up = upstream_yml(c.model)
  over = c.model_overrides.to_dict()
  assert not set(over) & set(ATTENTION_KEYS), "tiny must keep head dims, windows, caps, sinks, MLA"
  q = over.get("base_num_query_heads", up["base_num_query_heads"])
  kv = over.get("base_num_kv_heads", up["base_num_kv_heads"])
  assert q * up["base_num_kv_heads"] == kv * up["base_num_query_heads"], "GQA ratio changed"
  assert over["vocab_size"] >= 259  # the byte tokenizer's ids fit


def test_unknown_variant_names_the_flag():
  with pytest.raises(ValueError, match=r"--config=llama3:huge.*tiny"):
    load_family("llama3").get_config("huge")


@needs_maxtext
def test_translation_to_maxtext_keys():
  from kvax_plugin.errors import FlagError
  from kvax_plugin.integrations.maxtext import launch_checks as checks
  from kvax_plugin.integrations.maxtext import launch_keys
  c = load_family("gemma2").get_config("tiny")
  with c.unlocked():
    c.mesh.ici_tensor = 2
    c.kvax.backend = "jax"
  keys = launch_keys.maxtext_keys(c, "cpu")
  assert keys["model_name"] == "gemma2-2b" and keys["attention"] == "kvax"
  assert keys["hardware"] == "cpu" and keys["skip_jax_distributed_system"] is True
  assert keys["dtype"] == "float32"  # auto on CPU
  assert keys["ici_tensor_parallelism"] == 2 and keys["max_target_length"] == c.seq_len
  assert keys["kvax_backend"] == "jax" and keys["kvax_fwd_query_block_size"] == 64
  assert keys["kvax_context_parallel_order"] == "auto"
  assert keys["kvax_kv_grad_reduce_dtype"] == "auto" and keys["kvax_overlap_kv_gather"] is False
  assert keys["base_num_decoder_layers"] == 1 and keys["override_model_config"] is True
  assert launch_keys.maxtext_keys(c, "gpu")["dtype"] == "bfloat16"
  argv = launch_keys.maxtext_argv(keys)
  assert argv[1].endswith("base.yml") and "packing=true" in argv
  assert checks.parse_raw_overrides(["steps=3", "log_period=2"]) == {"steps": "3",
                                                                      "log_period": "2"}
  with pytest.raises(FlagError, match="key=value"):
    checks.parse_raw_overrides(["--steps", "3"])


@needs_maxtext
def test_transformer_engine_is_told_the_rows_are_packed():
  # MaxText's cudnn_flash_te reads segment ids only when dataset_type is not "synthetic", takes
  # packed rows with context parallelism only through its ring strategy, and needs the most
  # documents per row: count them on the batches the run trains on.
  from kvax_plugin.data import batch_iterator
  from kvax_plugin.integrations.maxtext import launch_keys
  c = load_family("llama3").get_config("tiny")
  with c.unlocked():
    c.attention = "cudnn_flash_te"
    c.seq_len = 8192
    c.steps = 3
  keys = launch_keys.maxtext_keys(c, "gpu")
  te = launch_keys.te_packing_keys(c, keys, {})
  import jax
  rows = int(c.per_device_batch_size) * jax.device_count()
  stream = batch_iterator(8192, rows, seed=c.data.seed, window_batches=c.data.window_batches,
                          min_chars=c.data.min_doc_chars, max_chars=c.data.max_doc_chars)
  counts = [max(next(stream).segments_per_row()) for _ in range(3)]
  assert te["max_segments_per_seq"] == max(counts) > 1
  assert te["dataset_type"] == "grain" and te["grain_train_files"]
  assert "context_parallel_strategy" not in te  # no context axis: MaxText's default stays
  keys["ici_context_parallelism"] = 2
  assert launch_keys.te_packing_keys(c, keys, {})["context_parallel_strategy"] == "ring"
  # Raw keys win; a raw dataset_type is MaxText's own pipeline: nothing is set.
  assert "max_segments_per_seq" not in launch_keys.te_packing_keys(
      c, keys, {"max_segments_per_seq": "32"})
  assert launch_keys.te_packing_keys(c, keys, {"dataset_type": "hf"}) == {}
  assert launch_keys.te_packing_keys(c, dict(keys, attention="kvax"), {}) == {}


def test_packed_corpus_feeds_maxtext_features():
  from kvax_plugin.data.feeding import PackedCorpus
  from kvax_plugin.errors import FlagError
  c = load_family("llama3").get_config("tiny")
  hosts = [PackedCorpus(c, seq_len=256, global_rows=4, host_index=h, host_count=2,
                               sliding_window=64) for h in range(2)]
  batches = [next(iter(corpus)) for corpus in hosts]
  for b in batches:
    assert set(b) == {"inputs", "inputs_segmentation", "inputs_position", "targets",
                      "targets_segmentation", "targets_position"}
    assert b["inputs"].shape == (2, 256) and b["inputs"].dtype == np.int32
    seg, pos = b["inputs_segmentation"], b["inputs_position"]
    assert seg.min() >= 0 and seg.max() >= 1  # 1..n documents, 0 padding
    # Padding is a suffix; real segments count up 1, 2, ... along the row.
    assert np.all(np.diff(np.where(seg == 0, seg.max() + 1, seg), axis=1) >= 0)
    # Positions restart at 0 at every document boundary.
    boundary = np.diff(seg, axis=1) != 0
    assert np.all(pos[:, 1:][boundary & (seg[:, 1:] > 0)] == 0)
  # The two hosts hold different rows of the same global batch.
  assert not np.array_equal(batches[0]["inputs"], batches[1]["inputs"])
  stats = hosts[0].stats[0]
  assert set(stats.skipped) == {"global", "local"}
  # 4 x 4 blocks of 64: causality alone skips the 6 blocks above the diagonal.
  assert 6 / 16 <= stats.skipped["global"] < 1.0
  assert stats.skipped["local"] >= stats.skipped["global"]
  # Another kernel's run builds no masks (it reports no skipping).
  plain = PackedCorpus(c, seq_len=256, global_rows=2, host_index=0, host_count=1,
                       sliding_window=None, mask_stats=False)
  next(iter(plain))
  assert plain.stats[0].skipped == {} and plain.stats[0].real_tokens > 0
  with pytest.raises(FlagError, match="per_device_batch_size"):
    PackedCorpus(c, seq_len=256, global_rows=3, host_index=0, host_count=2,
                 sliding_window=None)


def test_packed_corpus_counts_only_the_rows_maxtext_trains_on():
  # per_device_batch_size < 1 (one row over a context mesh of 4): MaxText loads 4 rows and
  # trains on the first, so the statistics (tokens/s) hold that row alone.
  from kvax_plugin.data.feeding import PackedCorpus
  c = load_family("llama3").get_config("tiny")
  full = PackedCorpus(c, seq_len=256, global_rows=4, host_index=0, host_count=1,
                      sliding_window=None)
  one = PackedCorpus(c, seq_len=256, global_rows=4, host_index=0, host_count=1,
                     sliding_window=None, train_rows=1)
  b_full, b_one = next(iter(full)), next(iter(one))
  np.testing.assert_array_equal(b_full["inputs"], b_one["inputs"])  # the same 4 rows are fed
  assert one.stats[0].rows == 1 and full.stats[0].rows == 4
  assert one.stats[0].real_tokens == int((b_one["inputs_segmentation"][0] > 0).sum())
  assert 0 < one.stats[0].real_tokens < full.stats[0].real_tokens
  # A second host holding rows 2..3 of the 4 trains on none of them.
  other = PackedCorpus(c, seq_len=256, global_rows=4, host_index=1, host_count=2,
                       sliding_window=None, train_rows=1)
  next(iter(other))
  assert other.stats[0].rows == 0 and other.stats[0].real_tokens == 0


@needs_maxtext
def test_hooks_restore_maxtext():
  from maxtext.common import metric_logger
  from maxtext.input_pipeline import input_pipeline_interface as ipi

  from maxtext.trainers.pre_train import train as mt_train
  from maxtext.utils import train_utils

  from kvax_plugin.integrations.maxtext import setup_timing, training_hooks
  c = load_family("llama3").get_config("tiny")
  before = (ipi.create_data_iterator, metric_logger.MetricLogger.write_metrics,
            train_utils.setup_train_loop, mt_train.training_loop_iteration)
  progress = training_hooks.Progress(c, {}, total_steps=3)
  with (training_hooks.packed_corpus_pipeline(c, {}), training_hooks.progress_hook(progress),
        setup_timing.SetupTimer().maxtext_hooks()):
    now = (ipi.create_data_iterator, metric_logger.MetricLogger.write_metrics,
           train_utils.setup_train_loop, mt_train.training_loop_iteration)
    assert all(a is not b for a, b in zip(now, before))
  assert (ipi.create_data_iterator, metric_logger.MetricLogger.write_metrics,
          train_utils.setup_train_loop, mt_train.training_loop_iteration) == before


def test_compile_events_counted_once_for_the_innermost():
  # Spans (start, end, event, function) as JAX's listeners see them: an eager op compiled while
  # a trace is open nests inside it; a span crossing another's end (another thread) owns the
  # overlap from its start on.
  from kvax_plugin.integrations.maxtext import setup_timing as st
  spans = [(0.0, 10.0, st.TRACE_EVENT, "train_step"), (2.0, 5.0, st.COMPILE_EVENT, "jit(add)"),
           (3.0, 4.0, st.LOWER_EVENT, "jit(add)"), (9.0, 12.0, st.COMPILE_EVENT, "jit(x)"),
           (20.0, 30.0, st.COMPILE_EVENT, "jit(train_step)")]
  got = st.exclusive_seconds(spans, 0.0, 25.0)
  assert got["total"] == pytest.approx(17.0)  # [0, 12] and [20, 25]
  assert got["by_event"] == pytest.approx({st.TRACE_EVENT: 6.0, st.COMPILE_EVENT: 2.0 + 3.0 + 5.0,
                                           st.LOWER_EVENT: 1.0})
  assert got["top"][0] == ["jax_trace", "train_step", 6.0, 1]


# ---------------------------------------------------------------------------------------------
# Bad flags: exit status 2 and a message naming the flag
def test_context_parallel_order_flag():
  from kvax_plugin.errors import FlagError
  from kvax_plugin.integrations.maxtext import launch_checks as checks
  c = load_family("llama3").get_config("tiny")
  checks.check_config(c)
  with c.unlocked():
    c.kvax.context_parallel_order = "striped"
  with pytest.raises(FlagError, match=r"--config.kvax.context_parallel_order='striped'"):
    checks.check_config(c)
  unit = max(c.kvax.fwd_query_block_size, c.kvax.bwd_query_block_size)
  with c.unlocked():
    c.kvax.context_parallel_order = "auto"  # balanced under load-balanced context parallelism
    c.mesh.ici_context = 4
    c.seq_len = 4 * unit * 3 + 4
  with pytest.raises(FlagError, match=rf"--config.seq_len={c.seq_len}: .* multiple of "
                     rf"{4 * unit}"):
    checks.check_config(c)
  with c.unlocked():
    c.kvax.context_parallel_order = "llama3"
  checks.check_config(c)
  with c.unlocked():
    c.kvax.kv_grad_reduce_dtype = "bf16"
  with pytest.raises(FlagError, match=r"--config.kvax.kv_grad_reduce_dtype='bf16': choose one"):
    checks.check_config(c)


# ---------------------------------------------------------------------------------------------


def test_family_names_resolve_to_the_packaged_configs(tmp_path):
  from kvax_plugin.configs import config_file
  from kvax_plugin.integrations.maxtext import launch_checks as checks
  packaged = config_file("llama3")
  assert os.path.dirname(packaged).endswith(os.path.join("kvax_plugin", "configs"))
  # From a directory without configs/: a family name, or a checkout's path, finds the package's.
  os.chdir(tmp_path)
  try:
    for value in ("llama3", "llama3.py", "configs/llama3.py"):
      assert checks.resolve_config_path(value) == packaged, value
    assert checks.resolve_config_argv(["p", "--config=configs/gemma2.py:tiny", "x=1"]) == [
        "p", f"--config={config_file('gemma2')}:tiny", "x=1"]
    assert checks.resolve_config_path("other/llama3.py") == "other/llama3.py"  # a path stays
  finally:
    os.chdir(ROOT)
  # The checkout's configs/ files give the packaged configs.
  for family in FAMILIES:
    assert load_family(family).get_config("tiny").to_dict() == (
        importlib.import_module(f"kvax_plugin.configs.{family}").get_config("tiny").to_dict())


@needs_maxtext
def test_remat_policy_defaults_to_maxtexts_gpu_recipe():
  from kvax_plugin.integrations.maxtext.launch_keys import (GPU_DEFAULT_REMAT_POLICY, gpu_recipe,
                                                            maxtext_keys)
  c = load_family("llama3").get_config("8b")
  assert c.remat_policy == "auto"
  assert gpu_recipe("llama3-8b")["remat_policy"] == "minimal_with_context"  # MaxText's own yml
  assert maxtext_keys(c, "gpu")["remat_policy"] == "minimal_with_context"
  assert "remat_policy" not in maxtext_keys(c, "cpu")  # MaxText's default on CPU
  assert gpu_recipe("llama3-70b")["remat_policy"] == "full"
  c70 = load_family("llama3").get_config("70b")
  assert maxtext_keys(c70, "gpu")["remat_policy"] == "full"
  g = load_family("gemma2").get_config("tiny")  # no GPU recipe for gemma2-2b
  assert gpu_recipe(g.model) == {}
  assert maxtext_keys(g, "gpu")["remat_policy"] == GPU_DEFAULT_REMAT_POLICY
  with c.unlocked():
    c.remat_policy = "full"
  assert maxtext_keys(c, "gpu")["remat_policy"] == "full"
  assert maxtext_keys(c, "cpu")["remat_policy"] == "full"


def test_launcher_runs_a_family_name_from_any_directory(tmp_path):
  r = run_launcher("--config=llama3:tiny", "--dry_run", timeout=120, cwd=str(tmp_path))
  assert r.returncode == 0, r.stderr[-2000:]
  assert "model_name=llama3-8b" in r.stdout


@pytest.mark.parametrize("args, flag", [
    (["--config=configs/llama4.py:tiny"], "--config=configs/llama4.py:tiny"),
    (["--config=llama3:huge"], "--config=llama3:huge"),
    (["--config=llama4"], "--config=llama4"),
    (["--config=configs/llama3.py:tiny", "--config.kvax.blocks=3"], "--config.kvax.blocks"),
    (["--config=configs/llama3.py:tiny", "--config.attention=sdpa"], "--config.attention"),
    (["--config=configs/llama3.py:tiny", "--config.kvax.fwd_kv_block_size=48"],
     "--config.kvax.fwd_kv_block_size"),
    (["--config=configs/llama3.py:tiny", "stray"], "'stray'"),
    pytest.param(["--config=configs/llama3.py:tiny", "--config.attention=cudnn_flash_te"],
                 "--config.attention=cudnn_flash_te", marks=pytest.mark.skipif(
                     has_gpu(), reason="the kernel can run here")),
])
def test_bad_flags_are_named(args, flag):
  r = run_launcher(*args, "--dry_run", timeout=120)
  assert r.returncode == 2, r.stderr[-2000:]
  error = [line for line in r.stderr.splitlines() if "kvax_plugin.launch: error:" in line]
  assert error and flag in error[-1], r.stderr[-2000:]
  assert "Traceback" not in r.stderr


def test_transformer_engine_missing_is_named_before_maxtext_starts(monkeypatch):
  import importlib.util as iu

  from kvax_plugin.errors import FlagError
  from kvax_plugin.integrations.maxtext import launch_checks as checks
  real = iu.find_spec
  monkeypatch.setattr(iu, "find_spec",
                      lambda name, *a: None if name == "transformer_engine" else real(name, *a))
  with pytest.raises(FlagError, match=r"--config.attention=cudnn_flash_te: .* TransformerEngine, "
                     "which is not installed"):
    checks.check_attention("cudnn_flash_te", "gpu", "--config.attention=cudnn_flash_te")
  checks.check_attention("cudnn_flash_jax", "gpu", "--config.attention=cudnn_flash_jax")


def test_config_file_must_be_a_family_config(tmp_path):
  from kvax_plugin.errors import FlagError
  from kvax_plugin.integrations.maxtext import launch_checks as checks
  from kvax_plugin import launch
  with pytest.raises(FlagError, match=r"--config=README.md: 'README.md' is not a Python "
                     "config file"):
    checks.check_config_path(["prog", "--config=README.md"])
  with pytest.raises(FlagError, match=r"--config=configs/common.py:tiny: .* is not a "
                     r"family config \(it defines no get_config"):
    checks.check_config_path(["prog", "--config=configs/common.py:tiny"])
  with pytest.raises(FlagError, match="the config has no family, variant"):
    import ml_collections
    launch.run(ml_collections.ConfigDict({"foo": 1}), {}, dry_run=True)
  # A family-shaped file whose get_config fails: one line naming --config, not a traceback.
  bad = tmp_path / "broken.py"
  bad.write_text("def get_config(arg=None):\n  return undefined_name\n")
  r = run_launcher(f"--config={bad}:tiny", "--dry_run", timeout=120)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert f"--config={bad}:tiny: loading it failed (NameError" in r.stderr


def test_raw_keys_get_the_launchers_checks():
  import kvax_plugin
  from kvax_plugin.attention.kernels import availability
  from kvax_plugin.errors import FlagError
  from kvax_plugin.integrations.maxtext import launch_checks as checks
  c = load_family("llama3").get_config("tiny")
  check = lambda **raw: checks.check_raw_overrides(c, raw, "cpu")  # noqa: E731
  with pytest.raises(FlagError, match="attention=cudnn_flash_te: MaxText runs this kernel "
                     "only on GPU/TPU"):
    check(attention="cudnn_flash_te")
  with pytest.raises(FlagError, match="attention=sdpa: choose one of"):
    check(attention="sdpa")
  for bad in ("abc", "0", "-3", "1.5"):
    with pytest.raises(FlagError, match=f"steps={bad}: must be a positive integer"):
      check(steps=bad)
  with pytest.raises(FlagError, match="kvax_backend=cuda: choose one of"):
    check(kvax_backend="cuda")
  if not availability("triton")[0]:
    with pytest.raises(kvax_plugin.BackendUnavailableError, match="kvax_backend=triton: "):
      check(kvax_backend="triton")
  check(attention="dot_product", kvax_backend="triton", steps="3")  # kvax unused: no check


@needs_maxtext
def test_raw_keys_must_be_maxtext_keys_of_the_right_type():
  from kvax_plugin.errors import FlagError
  from kvax_plugin.integrations.maxtext import launch_checks as checks
  from kvax_plugin.integrations.maxtext import settings
  cls = settings.kvax_config_class()
  with pytest.raises(FlagError, match="foo_bar=3: not a MaxText config key$"):
    checks.check_raw_keys({"foo_bar": "3"}, cls)
  with pytest.raises(FlagError, match=r"stesp=3: not a MaxText config key \(did you mean "
                     "steps"):
    checks.check_raw_keys({"stesp": "3"}, cls)
  with pytest.raises(FlagError, match="hardware=tpux: Input should be 'tpu'"):
    checks.check_raw_keys({"hardware": "tpux"}, cls)
  with pytest.raises(FlagError, match="per_device_batch_size=x: Input should be"):
    checks.check_raw_keys({"per_device_batch_size": "x"}, cls)
  with pytest.raises(FlagError, match="kvax_memory_optimized_gqa_backward=maybe: "):
    checks.check_raw_keys({"kvax_memory_optimized_gqa_backward": "maybe"}, cls)
  checks.check_raw_keys({"steps": "3", "log_period": "2", "kvax_backend": "jax", "dtype":
                         "bfloat16", "per_device_batch_size": "0.5", "dataset_type": "hf",
                         "jax_cache_dir": "/tmp/x", "sliding_window_size": "4096",
                         "logical_axis_rules": "[['x', 'y']]"}, cls)


def test_summary_and_progress_report_what_maxtext_ran():
  from types import SimpleNamespace

  from kvax_plugin.integrations.maxtext import run_report, training_hooks
  c = load_family("llama3").get_config("tiny")
  config = SimpleNamespace(hardware="cpu", max_target_length=64, global_batch_size_to_train_on=2,
                           kvax_fwd_query_block_size=64, kvax_fwd_kv_block_size=32)
  stats = SimpleNamespace(skipped={"global": 0.4}, real_tokens=100, rows=2, seq_len=64,
                          documents=6)
  corpus = SimpleNamespace(stats=[stats], global_rows=2, train_rows=2)
  for attention, backend in (("dot_product", None), ("kvax", "jax")):
    progress = training_hooks.Progress(c, {"corpus": corpus}, total_steps=1,
                                       block_skipping=attention == "kvax")
    progress.on_train_metrics({"scalar": {"learning/loss": 2.0,
                                          "perf/step_time_seconds": 0.5}}, 0)
    line = progress.format(progress.records[0])
    summary = run_report.summarize(c, config, progress, corpus, attention, backend,
                                   {"total": 1.0, "training": 0.5, "setup_and_compile": 0.5}, {})
    assert summary["attention"] == attention and summary["kvax_backend"] == backend
    if attention == "kvax":
      assert "blocks skipped (global) 40%" in line and summary["blocks_skipped"] == {"global": 0.4}
      assert summary["kvax_fwd_blocks"] == [64, 32]
    else:  # the config said kvax; a raw key chose dot_product: no kvax numbers are reported
      assert "blocks skipped" not in line and summary["blocks_skipped"] == {}
      assert summary["kvax_fwd_blocks"] is None


def test_summary_notes_remat_policy_and_flash_mask_limit_on_gpus():
  # remat_policy=full reruns kvax's forward in the backward: a GPU run with kvax says so (with
  # the measured ratios). MaxText's flash past its int32 mask offsets (rows per device x S x S >
  # 2^31) is named too. Other attentions, other policies, shorter rows and CPU runs get no note.
  import io
  from types import SimpleNamespace

  from kvax_plugin.integrations.maxtext import run_report, training_hooks
  c = load_family("llama3").get_config("tiny")
  stats = SimpleNamespace(skipped={"global": 0.4}, real_tokens=100, rows=2, seq_len=64,
                          documents=2)
  corpus = SimpleNamespace(stats=[stats], global_rows=2, train_rows=2)
  progress = training_hooks.Progress(c, {"corpus": corpus}, total_steps=1, block_skipping=True)
  progress.on_train_metrics({"scalar": {"learning/loss": 2.0,
                                        "perf/step_time_seconds": 0.5}}, 0)

  def summary(attention, hardware, policy, seq_len=64, per_device=1.0):
    config = SimpleNamespace(hardware=hardware, max_target_length=seq_len,
                             global_batch_size_to_train_on=2, kvax_fwd_query_block_size=64,
                             kvax_fwd_kv_block_size=32, remat_policy=policy,
                             per_device_batch_size=per_device)
    return run_report.summarize(c, config, progress, corpus, attention, "mosaic",
                                {"total": 1.0, "training": 0.5, "setup_and_compile": 0.5},
                                {"mask_png": [], "loss_png": None, "tensorboard_dir": "t",
                                 "summary_json": "s.json", "maxtext_log": "m.log"})

  noted = summary("kvax", "gpu", "full")
  assert noted["remat_policy"] == "full" and noted["notes"] == [run_report.REMAT_FULL_NOTE]
  out = io.StringIO()
  run_report.print_summary(noted, out)
  assert "note: remat_policy=full reruns" in out.getvalue() and "0.93x with full" in out.getvalue()
  # MaxText's flash on a GPU past its int32 mask offsets: B x S x S > 2^31 (one 64k row, or
  # three 32k rows; 46340^2 still fits).
  for seq_len, per_device in ((65536, 1.0), (32768, 3.0), (32768, 2.5)):
    noted = summary("flash", "gpu", "minimal_with_context", seq_len, per_device)
    assert noted["notes"] == [run_report.flash_mask_note(3 if per_device > 1 else 1, seq_len)]
    out = io.StringIO()
    run_report.print_summary(noted, out)
    assert "note: attention=flash: MaxText's GPU flash kernel" in out.getvalue()
  for args in (("kvax", "gpu", "minimal_with_context"), ("kvax", "cpu", "full"),
               ("cudnn_flash_jax", "gpu", "full"), ("flash", "gpu", "full", 46340, 1.0),
               ("flash", "gpu", "full", 32768, 2.0), ("flash", "cpu", "full", 65536, 1.0),
               ("kvax", "gpu", "minimal_with_context", 65536, 4.0)):
    s = summary(*args)
    assert s["notes"] == [], args
    out = io.StringIO()
    run_report.print_summary(s, out)
    assert "note:" not in out.getvalue()


def _summary_of_steps(received, clocks, attention):
  """The launcher's summary of steps of 100 real tokens whose results arrive at `received`
  seconds, with MaxText's dispatch clock reading `clocks`; returns (progress, summary)."""
  from types import SimpleNamespace

  from kvax_plugin.integrations.maxtext import run_report, training_hooks
  c = load_family("llama3").get_config("tiny")
  config = SimpleNamespace(hardware="cpu", max_target_length=64, global_batch_size_to_train_on=2,
                           kvax_fwd_query_block_size=64, kvax_fwd_kv_block_size=32)
  stats = SimpleNamespace(skipped={}, real_tokens=100, rows=2, seq_len=64, documents=2)
  corpus = SimpleNamespace(stats=[stats] * len(received), global_rows=2, train_rows=2)
  progress = training_hooks.Progress(c, {"corpus": corpus}, total_steps=len(received),
                                     block_skipping=False)
  for step, (clock, now) in enumerate(zip(clocks, received)):
    progress.on_train_metrics({"scalar": {"learning/loss": 2.0,
                                          "perf/step_time_seconds": clock}}, step, now=now)
  wall = {"total": received[-1] + 0.5, "training": received[-1], "setup_and_compile": 0.5}
  return progress, run_report.summarize(c, config, progress, corpus, attention, None, wall, {})


def test_summary_times_steps_by_their_results_not_maxtext_dispatch_clock():
  # Steps of 100 real tokens. MaxText's clock times dispatches: with the host a step ahead it
  # reads 0.03 s, then 3 s. The launcher times the steps by when
  # their results arrive (5.0, 6.0, 7.5, 8.5 s). The first two intervals are left out (the
  # second can be short when the first result arrives late, see the next test): 200 tokens in
  # 2.5 s. Tokens/s is total tokens over total time, not a mean of per-step ratios.
  progress, summary = _summary_of_steps((5.0, 6.0, 7.5, 8.5), (5.0, 0.03, 3.0, 0.03),
                                        "dot_product")
  assert [r.step_seconds for r in progress.records] == pytest.approx([5.0, 1.0, 1.5, 1.0])
  assert [r.tokens_per_s for r in progress.records] == pytest.approx([20, 100, 200 / 3, 100])
  assert summary["mean_tokens_per_s"] == pytest.approx(200 / 2.5)
  assert summary["mean_step_seconds"] == pytest.approx(2.5 / 2)
  assert summary["maxtext_step_seconds"] == pytest.approx([5.0, 0.03, 3.0, 0.03])


def test_summary_leaves_out_a_second_step_received_with_the_first():
  # Results at 2.04, 2.06, 3.51, 5.04, 6.63 s: the first two arrive together. Timing
  # from step 2 would give 1.15 s/step; the steps take 1.5 s.
  _, summary = _summary_of_steps((2.04, 2.06, 3.51, 5.04, 6.63), (1.0,) * 5, "cudnn_flash_te")
  assert summary["mean_step_seconds"] == pytest.approx((6.63 - 2.06) / 3)


def test_run_reports_what_maxtext_config_says():
  # Raw keys win over the launcher config; the banner and summary.json read the final MaxText
  # config back (the end-to-end test checks the banner of a real run).
  from types import SimpleNamespace

  from kvax_plugin.errors import FlagError
  from kvax_plugin.integrations.maxtext import launch_checks as checks
  c = load_family("llama3").get_config("tiny")
  final = lambda **kw: SimpleNamespace(**{"attention": "kvax", "kvax_backend": "auto", **kw})
  assert checks.what_maxtext_runs(final(attention="dot_product"), c,
                                  {"attention": "dot_product"}, "cpu") == ("dot_product", None)
  assert checks.what_maxtext_runs(final(kvax_backend="jax"), c, {}, "cpu") == ("kvax", "jax")
  assert checks.what_maxtext_runs(final(), c, {}, "cpu") == ("kvax", checks.resolve_kvax_backend(
      "auto", "x"))
  with pytest.raises(FlagError, match="attention=cudnn_flash_te: MaxText runs this"):
    checks.what_maxtext_runs(final(attention="cudnn_flash_te"), c,
                             {"attention": "cudnn_flash_te"}, "cpu")


def test_unknown_family_lists_the_families():
  r = run_launcher("--config=configs/llama4.py:tiny", timeout=120)
  assert r.returncode == 2 and "unknown family 'llama4'" in r.stderr
  assert all(f in r.stderr for f in FAMILIES)


def test_triton_without_gpu_is_backend_unavailable():
  import kvax_plugin
  from kvax_plugin import launch
  from kvax_plugin.attention.kernels import availability
  if availability("triton")[0]:
    pytest.skip("a usable GPU is present")
  c = load_family("llama3").get_config("tiny")
  with c.unlocked():
    c.kvax.backend = "triton"
  with pytest.raises(kvax_plugin.BackendUnavailableError, match="--config.kvax.backend=triton"):
    launch.run(c, {}, dry_run=True)
  r = run_launcher("--config=configs/llama3.py:tiny", "--config.kvax.backend=triton", "--dry_run",
                   timeout=120)
  assert r.returncode == 2 and "--config.kvax.backend=triton" in r.stderr


def test_mesh_checks_name_the_flag(monkeypatch):
  from types import SimpleNamespace

  import jax

  from kvax_plugin.errors import FlagError
  from kvax_plugin.integrations.maxtext.launch_keys import check_maxtext_config
  monkeypatch.setattr(jax, "device_count", lambda: 8)
  c = load_family("llama3").get_config("tiny")

  def maxtext_config(tensor, ici=None, **kw):
    fields = dict(ici_tensor_parallelism=tensor, dcn_tensor_parallelism=1, num_query_heads=8,
                  num_kv_heads=2, ici_data_parallelism=1, ici_fsdp_parallelism=-1,
                  ici_context_parallelism=1, dcn_context_parallelism=1, num_slices=1,
                  ici_parallelism=ici or [1, -1, tensor, 1], max_target_length=1024)
    fields.update(kw)
    return SimpleNamespace(**fields)

  with pytest.raises(FlagError, match=r"--config.mesh.ici_tensor: .*\(3\).*8 query heads"):
    check_maxtext_config(maxtext_config(3), c, {})
  check_maxtext_config(maxtext_config(4), c, {})  # 2 kv heads < 4 are replicated: fine
  with pytest.raises(FlagError, match="ici_tensor_parallelism=4: .*6 kv heads"):
    check_maxtext_config(maxtext_config(4, num_query_heads=12, num_kv_heads=6), c,
                         {"ici_tensor_parallelism": "4"})
  with pytest.raises(FlagError, match=r"--config.mesh \(.*multiply to 2.*8 devices"):
    check_maxtext_config(maxtext_config(2, ici=[1, 1, 2, 1]), c, {})
  with pytest.raises(FlagError, match="--config.seq_len=1004: context parallelism 4"):
    check_maxtext_config(maxtext_config(1, ici_context_parallelism=4,
                                               max_target_length=1004), c, {})


@needs_maxtext
def test_heads_not_divisible_by_tensor_axis_end_to_end():
  # The check reads MaxText's resolved config (model yml + config + raw keys), so raw head
  # overrides count too; it runs before MaxText builds a mesh.
  r = run_launcher("--config=configs/llama3.py:tiny", "--config.mesh.ici_tensor=4", "--dry_run",
                   "--config.output_dir=/tmp/kvax_launch_test_dry", "base_num_query_heads=6",
                   "base_num_kv_heads=2")
  assert r.returncode == 2, r.stderr[-2000:]
  assert "--config.mesh.ici_tensor" in r.stderr and "6 query heads" in r.stderr, r.stderr[-2000:]


def scalar_tags(path: str) -> dict[str, int]:
  """tag -> number of scalar values in a TensorBoard event file (TFRecord framing)."""
  import struct

  from tensorboardX.proto import event_pb2
  data, i, tags = open(path, "rb").read(), 0, {}
  while i < len(data):
    (n,) = struct.unpack("<Q", data[i:i + 8])
    event = event_pb2.Event()
    event.ParseFromString(data[i + 12:i + 12 + n])  # 8 length + 4 crc, payload, 4 crc
    i += 12 + n + 4
    for value in event.summary.value:
      if value.WhichOneof("value") == "simple_value":
        tags[value.tag] = tags.get(value.tag, 0) + 1
  return tags


# ---------------------------------------------------------------------------------------------
# End to end: MaxText's own train loop, a few steps
# ---------------------------------------------------------------------------------------------


@needs_maxtext
def test_tiny_launch_end_to_end(tmp_path):
  out = tmp_path / "run"
  # 3 steps: the loss falls after the first (each step is ~2.5 s of CPU at LLVM -O0).
  r = run_launcher("--config=configs/llama3.py:tiny", "--config.steps=3", "--config.seq_len=256",
                   f"--config.output_dir={out}", "log_period=2",
                   # A cold compilation cache of its own: the run is what CI's first run sees.
                   f"jax_cache_dir={tmp_path / 'jax_cache'}")
  assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
  lines = [l for l in r.stdout.splitlines() if l.startswith("step ")]
  assert len(lines) == 3 and "tok/s" in lines[0] and "blocks skipped" in lines[0]
  assert "log_period=2 (config:" not in r.stdout  # not a config-derived key: nothing replaced
  # A quiet console (cfg.quiet): the banner, the model line, a line per step and the summary;
  # MaxText's notices, absl / JAX logging and its print()s are in maxtext.log instead.
  console = r.stdout.splitlines()
  assert console[0].startswith("kvax_plugin.launch: llama3:tiny (") and console[1].startswith(
      "model: "), r.stdout
  assert lines == console[2:5] and console[5] == "", r.stdout
  assert console[6].startswith("== llama3:tiny") and all(
      l.startswith("   ") for l in console[7:]), r.stdout
  assert all(l.startswith("warning: ") for l in r.stderr.splitlines()), r.stderr[-3000:]
  maxtext_log = (out / "maxtext.log").read_text()
  assert "Num_devices" in maxtext_log and "Per train step" in maxtext_log  # absl, print()
  summary = json.loads((out / "summary.json").read_text())
  losses = summary["losses"]
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
  assert min(losses[1:]) < losses[0], losses  # lr 3e-3 on bytes: falls within a few steps
  assert summary["kvax_backend"] == "jax" and summary["attention"] == "kvax"
  assert "attention=kvax kvax backend=jax on cpu" in r.stdout  # the banner, read back
  assert 0.0 < summary["blocks_skipped"]["global"] < 1.0
  # Where setup+compile went: parts >= 0 that add up to it, JAX's compile stages among them.
  breakdown, wall = summary["compile_breakdown"], summary["wall_seconds"]
  parts = breakdown["parts"]
  assert all(v >= 0 for v in parts.values()) and not breakdown["notes"], breakdown
  assert sum(parts.values()) == pytest.approx(wall["setup_and_compile"], abs=0.01)
  assert min(parts["jax_trace"], parts["xla_compile"], parts["imports_and_config"]) > 0, parts
  assert "jit(train_step)" in {name for _, name, _, _ in breakdown["top_functions"]}
  assert min(wall["first_step"], wall["first_step_result"], wall["reporting"]) > 0, wall
  assert "setup+compile" in r.stdout and "xla_compile" in r.stdout  # the printed breakdown
  for png in ("mask.png", "loss.png"):
    data = (out / png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
  events = summary["tensorboard_files"]
  if importlib.util.find_spec("tensorboardX") is None:
    # MaxText writes TensorBoard through tensorboardX; without it the launcher must say so.
    assert not events and "tensorboardX is not installed" in r.stderr
    return
  assert events and all(os.path.getsize(e) > 0 for e in events)
  tags = scalar_tags(events[-1])
  # MaxText's own scalars, and the launcher's added to them.
  for tag in ("learning/loss", "perf/step_time_seconds", "kvax/blocks_skipped_global",
              "perf/real_tokens_per_sec", "data/real_token_share"):
    assert tags.get(tag) == 3, (tag, tags.get(tag))
  assert "completed step" in maxtext_log  # MaxText's own log, kept


def test_quiet_console_sends_all_else_to_the_log(tmp_path):
  """console.Console (cfg.quiet): the launcher's lines reach the console; print()s, logging
  records, Python warnings and raw writes to descriptor 2 (as XLA's C++ makes) go to the log,
  those from before the log opened too. An exception after the log opened leaves its traceback
  there and names the log; one before it gets what was printed replayed on the console."""
  log = tmp_path / "run" / "maxtext.log"
  script = f"""
import logging, os, warnings
from kvax_plugin.integrations.maxtext import console
try:
  with console.Console(True) as con:
    print("early print"); os.write(2, b"early fd 2\\n")
    con.open_log({str(log)!r})
    print("maxtext print"); os.write(2, b"c++ fd 2\\n")
    logging.getLogger("maxtext").warning("a logging record")
    warnings.warn("a python warning")
    print("step line", file=con.out); print("our warning", file=con.err)
    raise RuntimeError("boom")
except RuntimeError as e:
  print("log:", getattr(e, console.log_path_attr))
try:
  with console.Console(True):
    print("before any log")
    raise ValueError("a bad flag")
except ValueError as e:
  print("no log:", getattr(e, console.log_path_attr, None))
"""
  r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.splitlines() == ["step line", f"log: {log}", "no log: None"], r.stdout
  assert r.stderr.splitlines() == ["our warning", "before any log"], r.stderr
  text = log.read_text()
  for line in ("early print", "early fd 2", "maxtext print", "c++ fd 2", "a logging record",
               "a python warning", "Traceback", "RuntimeError: boom"):
    assert line in text, (line, text)
  assert text.count("a logging record") == 1, text  # absl's handler adds no second copy


def test_feeder_mask_statistics_switch(monkeypatch):
  """KVAX_FEED_MASK_STATS (a diagnostic): 0 turns the feeder's per-batch mask statistics off,
  unset or 1 keeps them, anything else is refused by name."""
  from kvax_plugin.errors import FlagError
  from kvax_plugin.integrations.maxtext import training_hooks
  monkeypatch.delenv("KVAX_FEED_MASK_STATS", raising=False)
  assert training_hooks._mask_stats_on()
  monkeypatch.setenv("KVAX_FEED_MASK_STATS", "0")
  assert not training_hooks._mask_stats_on()
  monkeypatch.setenv("KVAX_FEED_MASK_STATS", "no")
  with pytest.raises(FlagError, match="KVAX_FEED_MASK_STATS='no'"):
    training_hooks._mask_stats_on()


@needs_maxtext
def test_maxtexts_trainer_gets_its_base_config_unless_one_is_given():
  from kvax_plugin.integrations.maxtext.launch_keys import maxtext_dir
  from kvax_plugin.integrations.maxtext.train import with_config_file
  base = os.path.join(maxtext_dir(), "configs", "base.yml")
  assert os.path.isfile(base)
  assert with_config_file(["train", "attention=kvax"]) == ["train", base, "attention=kvax"]
  assert with_config_file(["train"]) == ["train", base]
  assert with_config_file(["train", "my.yml", "steps=2"]) == ["train", "my.yml", "steps=2"]
