"""Train an upstream model family in MaxText with attention=kvax on packed real text.

    python -m kvax_plugin.launch --config=configs/llama3.py:tiny
    python -m kvax_plugin.launch --config=configs/gemma2.py:tiny --config.attention=dot_product
    python -m kvax_plugin.launch --config=configs/llama3.py:8b --config.seq_len=8192 \\
        --config.kvax.backend=triton --config.mesh.ici_tensor=2  steps=200 log_period=10

`--config` names a family file and a variant (configs/<family>.py:<variant>), `--config.<field>`
changes a field of it (the config is locked: a misspelt field is an error), and trailing
`key=value` arguments are raw MaxText keys, applied last (they win over the config; the run
prints which config-derived keys they replaced). `--dry_run` prints the MaxText keys and exits.

What happens:
  1. The config is checked; a bad value is an error that names its flag (unknown family or
     variant, unknown MaxText model, heads not divisible by the mesh's tensor axis,
     kvax.backend="triton" without a usable GPU -> kvax_plugin.BackendUnavailableError).
  2. The plugin is installed (kvax_plugin.integrations.maxtext.install(): attention=kvax becomes
     a MaxText kernel, the kvax_* keys join MaxText's config class) and the config is translated
     into MaxText's own keys and handed to MaxText's training entry point
     (maxtext.trainers.pre_train.train: initialize, then its train loop, unchanged).
  3. Data: MaxText builds its iterator in input_pipeline_interface.create_data_iterator, which
     has no registry for new sources; for the duration of the run that one function is replaced
     by one returning our packed stream (kvax_plugin.data: shipped corpus, byte tokens,
     first-fit packing, segment ids 1..n / 0 padding, per-document positions), wrapped in
     MaxText's own MultiHostDataLoadIterator so host-to-device placement, context-parallel
     reordering and the rest of MaxText's data loader run as for its own sources.
  4. Progress: MetricLogger.write_metrics is wrapped (again only for the run) to print one line
     per step with loss, tokens/s and the share of attention blocks the batch's kvax mask skips,
     and to add those numbers to MaxText's TensorBoard scalars.
  5. At the end: a summary (printed and summary.json), loss.png and mask.png (the first batch's
     block mask, kvax_plugin.draw_mask) under the output directory, next to MaxText's own
     tensorboard/ folder. MaxText's full log is in maxtext.log there.

Exit status: 0 after a finished run, 2 for a bad flag (the message names it), 1 otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "configs/<family>.py:<variant>, e.g. configs/llama3.py:tiny",
    lock_config=True)
_DRY_RUN = flags.DEFINE_bool("dry_run", False,
                             "check the config, print the MaxText keys it becomes, and exit")

FAMILIES = ("llama3", "mistral", "gemma2", "qwen3", "gpt_oss", "deepseek")
ATTENTIONS = ("kvax", "dot_product", "flash", "cudnn_flash_te", "cudnn_flash_jax", "autoselected")
KVAX_BACKENDS = ("auto", "jax", "triton", "reference")
# config.mesh field -> MaxText key
MESH_KEYS = {f"{net}_{axis}": f"{net}_{axis}_parallelism"
             for net in ("ici", "dcn") for axis in ("data", "fsdp", "tensor", "context")}
KVAX_KEYS = ("fwd_query_block_size", "fwd_kv_block_size", "bwd_query_block_size",
             "bwd_kv_block_size", "memory_optimized_gqa_backward", "skip_pad_tokens")

class FlagError(ValueError):
  """A flag (or raw MaxText key) has a value the launcher cannot run; the message names it."""


class SetupError(RuntimeError):
  """The environment lacks what the launcher needs (MaxText, a supported version of it)."""


def _configs_dir() -> str:
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


# ----------------------------------------------------------------------------------------------
# Flags -> checked config -> MaxText keys
# ----------------------------------------------------------------------------------------------


def check_config_path(argv: Sequence[str]) -> None:
  """Name the family when --config points at no file (config_flags would defer a vague error)."""
  if any(a in ("-h", "--help", "--helpshort", "--helpfull", "-?") for a in argv):
    return  # help needs no config
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      value = argv[i + 1]
    elif arg.startswith("--config="):
      value = arg.split("=", 1)[1]
    else:
      continue
    path = value.split(":", 1)[0]
    if not os.path.isfile(path):
      family = os.path.splitext(os.path.basename(path))[0]
      raise FlagError(
          f"--config={value}: no config file {path!r} (unknown family {family!r}?). Families: "
          f"{', '.join(FAMILIES)}, as configs/<family>.py:<variant> (in {_configs_dir()})")
    return
  raise FlagError("--config is required, e.g. --config=configs/llama3.py:tiny")


def maxtext_dir() -> str:
  import maxtext
  return os.path.dirname(maxtext.__file__)


def detect_platform() -> str:
  """"gpu" or "cpu": the platform of this process's default JAX devices."""
  import jax
  platform = jax.default_backend()
  if platform not in ("gpu", "cpu"):
    raise FlagError(f"--config.hardware=auto: JAX runs on {platform!r}; set --config.hardware "
                    "to MaxText's name for it (e.g. tpu)")
  return platform


def check_config(cfg) -> None:
  """Checks that need no MaxText config; each error names the flag at fault."""
  if cfg.family not in FAMILIES:
    raise FlagError(f"--config: family {cfg.family!r} is not one of {FAMILIES}")
  if cfg.attention not in ATTENTIONS:
    raise FlagError(f"--config.attention={cfg.attention!r}: choose one of {ATTENTIONS}")
  if cfg.kvax.backend not in KVAX_BACKENDS:
    raise FlagError(f"--config.kvax.backend={cfg.kvax.backend!r}: choose one of {KVAX_BACKENDS}")
  for key in KVAX_KEYS[:4]:
    value = cfg.kvax[key]
    if not isinstance(value, int) or value < 16 or value & (value - 1):
      raise FlagError(f"--config.kvax.{key}={value!r}: must be a power of two >= 16")
  for key in ("seq_len", "per_device_batch_size", "steps", "log_every"):
    if not isinstance(cfg[key], int) or cfg[key] < 1:
      raise FlagError(f"--config.{key}={cfg[key]!r}: must be a positive int")
  if not cfg.learning_rate >= 0:
    raise FlagError(f"--config.learning_rate={cfg.learning_rate!r}: must be >= 0")
  if cfg.data.source != "shipped_corpus":
    raise FlagError(f"--config.data.source={cfg.data.source!r}: only 'shipped_corpus' is built in; "
                    "for MaxText's own pipelines pass its keys raw (dataset_type=hf hf_path=...)")
  if not 1 <= cfg.data.min_doc_chars <= cfg.data.max_doc_chars:
    raise FlagError(f"--config.data.min_doc_chars={cfg.data.min_doc_chars} and "
                    f"--config.data.max_doc_chars={cfg.data.max_doc_chars}: need "
                    "1 <= min_doc_chars <= max_doc_chars")
  for key, value in cfg.mesh.items():
    if not isinstance(value, int) or (value < 1 and value != -1):
      raise FlagError(f"--config.mesh.{key}={value!r}: must be a positive int or -1")
  if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
    raise FlagError(f"--config.dtype={cfg.dtype!r}: choose auto, float32, bfloat16 or float16")


def check_model(cfg) -> None:
  """MaxText is installed in a supported version and ships configs/models/<cfg.model>.yml."""
  from kvax_plugin.integrations.maxtext import versions
  try:
    versions.check_version()
  except (ImportError, versions.MaxTextVersionError) as e:
    raise SetupError(f"the launcher trains through MaxText: {e}") from e
  yml = os.path.join(maxtext_dir(), "configs", "models", f"{cfg.model}.yml")
  if not os.path.isfile(yml):
    raise FlagError(f"--config.model={cfg.model!r}: MaxText has no configs/models/{cfg.model}.yml "
                    f"(in {maxtext_dir()})")


def check_backend(cfg) -> str:
  """The kvax backend the run will use; an explicit one that cannot run here is an error."""
  import kvax_plugin
  try:
    return kvax_plugin.resolve_backend(cfg.kvax.backend)
  except kvax_plugin.BackendUnavailableError as e:
    raise kvax_plugin.BackendUnavailableError(
        f"--config.kvax.backend={cfg.kvax.backend}: {e}") from e


def parse_raw_overrides(args: Sequence[str]) -> dict[str, str]:
  """Trailing `key=value` arguments (MaxText keys); anything else is an error."""
  raw = {}
  for arg in args:
    key, sep, value = arg.partition("=")
    if not sep or not key or key.startswith("-"):
      raise FlagError(f"unexpected argument {arg!r}: raw MaxText overrides are key=value, flags "
                      "are --config.<field>=value")
    raw[key] = value
  return raw


def output_dir(cfg) -> str:
  return os.path.abspath(cfg.output_dir or os.path.join(
      "outputs", f"{cfg.family}-{cfg.variant}-{cfg.attention}"))


def maxtext_keys(cfg, platform: str) -> dict[str, Any]:
  """The MaxText keys (name -> value) the config translates to, before raw overrides."""
  out = output_dir(cfg)
  keys: dict[str, Any] = dict(
      model_name=cfg.model,
      # Our variants change model-yml keys (width, depth, experts) on purpose.
      override_model_config=True,
      attention=cfg.attention,
      max_target_length=cfg.seq_len,
      per_device_batch_size=cfg.per_device_batch_size,
      steps=cfg.steps,
      learning_rate=cfg.learning_rate,
      warmup_steps_fraction=cfg.warmup_steps_fraction,
      init_weights_seed=cfg.seed,
      context_parallel_load_balance=cfg.context_parallel_load_balance,
      # Our batches are packed (several documents per row); MaxText reads this flag for its
      # context-parallel checks. dataset_type stays "synthetic" only to pass MaxText's data-key
      # validation: the run replaces MaxText's iterator with the packed corpus (see module doc).
      packing=True,
      dataset_type="synthetic",
      enable_checkpointing=False,
      base_output_directory=os.path.dirname(out),
      run_name=os.path.basename(out),
      enable_tensorboard=True,
      metrics_file=os.path.join(out, "metrics.jsonl"),
      log_config=False,
      dtype=("bfloat16" if platform == "gpu" else "float32") if cfg.dtype == "auto" else cfg.dtype,
  )
  if cfg.hardware == "auto":
    # One process driving this host's devices: jax.distributed would wait for peers.
    keys.update(hardware=platform, skip_jax_distributed_system=True)
  else:
    keys.update(hardware=cfg.hardware)
  for field, key in MESH_KEYS.items():
    keys[key] = cfg.mesh[field]
  keys["kvax_backend"] = cfg.kvax.backend
  for field in KVAX_KEYS:
    keys[f"kvax_{field}"] = cfg.kvax[field]
  keys.update(cfg.model_overrides.to_dict())
  return keys


def _argv_value(value: Any) -> str:
  # MaxText parses key=value with OmegaConf's command-line grammar (YAML-like scalars).
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, float):
    return repr(value)
  return str(value)


def maxtext_argv(keys: dict[str, Any]) -> list[str]:
  """argv for MaxText's train entry: program, base.yml, then key=value."""
  return ["kvax_plugin.launch", os.path.join(maxtext_dir(), "configs", "base.yml")] + [
      f"{k}={_argv_value(v)}" for k, v in keys.items()]


def _flag_for(key: str, raw: dict[str, str]) -> str:
  """The flag a user changes for MaxText key `key` (raw override, or --config field)."""
  if key in raw:
    return f"{key}={raw[key]}"
  for field, mkey in MESH_KEYS.items():
    if mkey == key:
      return f"--config.mesh.{field}"
  return f"--config.model_overrides.{key}"


def check_maxtext_config(config, cfg, raw: dict[str, str]) -> None:
  """Checks on MaxText's resolved config (head counts come from the model yml)."""
  import jax
  tensor = config.ici_tensor_parallelism * max(1, config.dcn_tensor_parallelism)
  heads, kv_heads = config.num_query_heads, config.num_kv_heads
  flag = _flag_for("ici_tensor_parallelism", raw)
  if tensor > 1 and heads % tensor:
    raise FlagError(f"{flag}: the tensor axis ({tensor}) must divide the {heads} query heads of "
                    f"{cfg.model} (as configured)")
  if tensor > 1 and kv_heads >= tensor and kv_heads % tensor:
    raise FlagError(f"{flag}: the tensor axis ({tensor}) must divide the {kv_heads} kv heads of "
                    f"{cfg.model} (as configured)")
  # MaxText fills one -1 axis with what is left; the fixed axes must fit the devices of a slice.
  ici = [int(a) for a in config.ici_parallelism]
  per_slice = jax.device_count() // max(1, int(config.num_slices))
  fixed = math.prod(a for a in ici if a != -1)
  if (per_slice % fixed) if -1 in ici else (fixed != per_slice):
    mesh = ", ".join(f"{f}={getattr(config, k)}" for f, k in MESH_KEYS.items()
                     if f.startswith("ici"))
    raise FlagError(f"--config.mesh ({mesh}): the fixed ici axes multiply to {fixed}, which does "
                    f"not fit the {per_slice} devices here (set one axis to -1 to take the rest)")
  cp = config.ici_context_parallelism * max(1, config.dcn_context_parallelism)
  if cp > 1 and config.max_target_length % (2 * cp):
    raise FlagError(f"--config.seq_len={config.max_target_length}: context parallelism {cp} "
                    f"needs a multiple of {2 * cp} (two chunks per rank)")


# ----------------------------------------------------------------------------------------------
# Data: the shipped corpus, packed, through MaxText's data loader
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BatchStats:
  """What the launcher learned about one batch while feeding it (host rows only)."""

  real_tokens: int
  rows: int
  seq_len: int
  documents: int
  skipped: dict[str, float]  # mask name -> share of forward blocks skipped


class PackedCorpus:
  """Iterable of MaxText feature dicts (numpy) from kvax_plugin.data, one per step.

  Every host packs the same global batch stream and keeps its own rows, so batches do not
  depend on the number of hosts. Per batch, the kvax block mask is built (with the run's forward
  block sizes, for the global and, if the model has one, the sliding-window mask) to report the
  share of blocks skipped; `stats` grows by one entry per batch, `first` keeps the first batch.
  """

  def __init__(self, cfg, *, seq_len: int, global_rows: int, host_index: int, host_count: int,
               sliding_window: int | None):
    if global_rows % host_count:
      raise FlagError(f"--config.per_device_batch_size: {global_rows} rows do not split over "
                      f"{host_count} loading hosts")
    self.cfg = cfg
    self.seq_len = seq_len
    self.global_rows = global_rows
    self.rows = global_rows // host_count
    self.host_index = host_index
    self.sliding_window = sliding_window
    self.stats: list[BatchStats] = []
    self.first = None  # the first PackedBatch (host rows)

  def masks(self, batch) -> dict[str, Any]:
    """kvax forward masks of a PackedBatch: {"global": mask[, "local": mask]}."""
    import kvax_plugin
    from kvax_plugin.data import to_kvax
    pos, seg = to_kvax(batch)
    params = kvax_plugin.FlashAttentionParamsConfig(
        query_block_size=self.cfg.kvax.fwd_query_block_size,
        kv_block_size=self.cfg.kvax.fwd_kv_block_size)
    out = {"global": kvax_plugin.create_attention_mask(
        pos, seg, pos, seg, fwd_params=params, skip_pad_tokens=self.cfg.kvax.skip_pad_tokens)}
    if self.sliding_window:
      out["local"] = kvax_plugin.create_attention_mask(
          pos, seg, pos, seg, fwd_params=params, sliding_window=self.sliding_window,
          skip_pad_tokens=self.cfg.kvax.skip_pad_tokens)
    return out

  def __iter__(self) -> Iterator[dict]:
    import numpy as np

    import kvax_plugin
    from kvax_plugin.data import PackedBatch, batch_iterator, maxtext_features
    d = self.cfg.data
    stream = batch_iterator(self.seq_len, self.global_rows, seed=d.seed,
                            window_batches=d.window_batches, min_chars=d.min_doc_chars,
                            max_chars=d.max_doc_chars)
    lo, hi = self.host_index * self.rows, (self.host_index + 1) * self.rows
    for full in stream:
      batch = PackedBatch(full.tokens[lo:hi], full.segment_ids[lo:hi], full.positions[lo:hi],
                          full.pieces[lo:hi])
      if self.first is None:
        self.first = batch
      skipped = {name: kvax_plugin.mask_sparsity(m)["skipped"]
                 for name, m in self.masks(batch).items()}
      self.stats.append(BatchStats(real_tokens=batch.num_real_tokens, rows=batch.num_seqs,
                                   seq_len=batch.seq_len,
                                   documents=int(sum(batch.segments_per_row())), skipped=skipped))
      yield {k: np.asarray(v) for k, v in maxtext_features(batch).items()}


@contextlib.contextmanager
def packed_corpus_pipeline(cfg, holder: dict):
  """Within the block, MaxText's create_data_iterator returns the packed corpus.

  `holder["corpus"]` receives the PackedCorpus so the caller can read its statistics.
  """
  from maxtext.input_pipeline import input_pipeline_interface as ipi
  from maxtext.input_pipeline import multihost_dataloading, synthetic_data_processing

  original = ipi.create_data_iterator

  def create_data_iterator(config, mesh):
    import jax
    if config.eval_interval > 0:
      raise FlagError(f"eval_interval={config.eval_interval}: the shipped corpus has no eval "
                      "split; leave eval_interval unset, or use a MaxText dataset_type for eval")
    loading = ipi.get_process_loading_real_data(
        config.data_sharding, config.global_batch_size_to_load,
        config.global_batch_size_to_train_on, config.max_target_length, mesh)
    window = int(getattr(config, "sliding_window_size", 0) or 0) or None
    if window is not None and window >= config.max_target_length:
      window = None  # the local mask equals the global one at this length: report it once
    if jax.process_index() not in loading:
      # Same as MaxText: hosts that hold no batch rows feed placeholders.
      return synthetic_data_processing.PlaceHolderDataIterator(config, mesh), None
    corpus = PackedCorpus(cfg, seq_len=config.max_target_length,
                          global_rows=config.global_batch_size_to_load,
                          host_index=loading.index(jax.process_index()), host_count=len(loading),
                          sliding_window=window)
    holder["corpus"] = corpus
    return multihost_dataloading.MultiHostDataLoadIterator(corpus, mesh), None

  ipi.create_data_iterator = create_data_iterator
  try:
    yield
  finally:
    ipi.create_data_iterator = original


# ----------------------------------------------------------------------------------------------
# Progress: one line per step, extra TensorBoard scalars
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StepRecord:
  step: int
  loss: float
  step_seconds: float
  tokens_per_s: float  # real (non-padding) tokens per second, all devices
  skipped: dict[str, float]


class Progress:
  """Receives MaxText's per-step train metrics; prints and records them."""

  def __init__(self, cfg, holder: dict, total_steps: int, stream=None):
    self.cfg = cfg
    self.holder = holder
    self.total_steps = total_steps
    self.records: list[StepRecord] = []
    self.stream = stream or sys.stdout
    self.start_step = None

  def on_train_metrics(self, metrics: dict, step: int) -> None:
    scalars = metrics["scalar"]
    loss = float(scalars["learning/loss"])
    seconds = float(scalars.get("perf/step_time_seconds", float("nan")))
    corpus = self.holder.get("corpus")
    if self.start_step is None:
      self.start_step = step
    index = step - self.start_step
    stats = corpus.stats[index] if corpus is not None and index < len(corpus.stats) else None
    if stats is not None:
      # Every loading host packs the same number of real tokens per row on average; scale the
      # host's count to the global batch.
      real = stats.real_tokens * self._host_scale(stats)
      tokens_per_s = real / seconds if seconds > 0 else float("nan")
      skipped = dict(stats.skipped)
      # MaxText writes these scalars to TensorBoard with its own.
      scalars["perf/real_tokens_per_sec"] = tokens_per_s
      scalars["data/real_token_share"] = stats.real_tokens / (stats.rows * stats.seq_len)
      for name, share in skipped.items():
        scalars[f"kvax/blocks_skipped_{name}"] = share
    else:
      tokens_per_s, skipped = float("nan"), {}
    record = StepRecord(step, loss, seconds, tokens_per_s, skipped)
    self.records.append(record)
    if (step + 1) % self.cfg.log_every == 0 or step == 0 or step + 1 == self.total_steps:
      print(self.format(record), file=self.stream, flush=True)

  def _host_scale(self, stats: BatchStats) -> float:
    corpus = self.holder["corpus"]
    return corpus.global_rows / max(1, stats.rows)

  def format(self, r: StepRecord) -> str:
    width = len(str(self.total_steps))
    skip = "/".join(f"{v:.0%}" for v in r.skipped.values()) or "n/a"
    names = "/".join(r.skipped) or "mask"
    return (f"step {r.step + 1:>{width}}/{self.total_steps}  loss {r.loss:7.4f}  "
            f"{r.tokens_per_s:9,.0f} real tok/s  {r.step_seconds:6.2f} s/step  "
            f"blocks skipped ({names}) {skip}")


@contextlib.contextmanager
def progress_hook(progress: Progress):
  """Within the block, MaxText's MetricLogger also hands train metrics to `progress`."""
  from maxtext.common import metric_logger

  original = metric_logger.MetricLogger.write_metrics

  @functools.wraps(original)
  def write_metrics(self, metrics, step, metric_type="train"):
    if metric_type == "train" and metrics:
      progress.on_train_metrics(metrics, int(step))
    return original(self, metrics, step, metric_type)

  metric_logger.MetricLogger.write_metrics = write_metrics
  try:
    yield
  finally:
    metric_logger.MetricLogger.write_metrics = original


@contextlib.contextmanager
def quiet_maxtext(log_path: str, enabled: bool):
  """Send absl/MaxText INFO logs to `log_path` only (warnings still reach the console)."""
  from absl import logging as absl_logging
  os.makedirs(os.path.dirname(log_path), exist_ok=True)
  file_handler = logging.FileHandler(log_path, mode="w")
  file_handler.setLevel(logging.INFO)
  file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
  root = logging.getLogger()
  root.addHandler(file_handler)
  absl_handler = absl_logging.get_absl_handler()
  previous = absl_handler.level
  if enabled:
    absl_handler.setLevel(logging.WARNING)
  try:
    yield
  finally:
    absl_handler.setLevel(previous)
    root.removeHandler(file_handler)
    file_handler.close()


# ----------------------------------------------------------------------------------------------
# Pictures and summary
# ----------------------------------------------------------------------------------------------


def plot_losses(records: Sequence[StepRecord], path: str, title: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot([r.step + 1 for r in records], [r.loss for r in records], marker="o", markersize=3)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats / token)")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def draw_first_mask(corpus: PackedCorpus, out: str) -> list[str]:
  """mask.png: the first batch's global causal block mask (mask_local.png: with the window).

  The row drawn is the one holding the most documents, where skipping is most visible.
  """
  import kvax_plugin
  row = max(range(corpus.first.num_seqs), key=lambda r: len(corpus.first.pieces[r]))
  docs = len(corpus.first.pieces[row])
  paths = []
  for name, mask in corpus.masks(corpus.first).items():
    path = os.path.join(out, "mask.png" if name == "global" else f"mask_{name}.png")
    share = kvax_plugin.mask_sparsity(mask)["skipped"]
    kvax_plugin.draw_mask(mask, path, batch_index=row, title=(
        f"{name} mask, batch 1 row {row + 1} ({docs} document pieces): "
        f"batch skips {share:.0%} of blocks"))
    paths.append(path)
  return paths


def tensorboard_files(config) -> list[str]:
  found = []
  for root, _, files in os.walk(config.tensorboard_dir or ""):
    found += [os.path.join(root, f) for f in files if f.startswith("events.out.tfevents")]
  return sorted(found)


def summarize(cfg, config, progress: Progress, corpus: PackedCorpus | None, backend: str,
              wall: dict[str, float], files: dict[str, Any]) -> dict[str, Any]:
  recs = progress.records
  timed = recs[1:] if len(recs) > 1 else recs  # step 1 carries dispatch warm-up
  mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
  skipped = {}
  if corpus is not None and corpus.stats:
    for name in corpus.stats[0].skipped:
      skipped[name] = mean([s.skipped[name] for s in corpus.stats])
  return {
      "family": cfg.family, "variant": cfg.variant, "model": cfg.model,
      "attention": cfg.attention,
      "kvax_backend": backend if cfg.attention == "kvax" else None,
      "hardware": config.hardware, "devices": _device_count(),
      "seq_len": config.max_target_length, "global_batch": config.global_batch_size_to_train_on,
      "steps": len(recs),
      "first_loss": recs[0].loss if recs else None, "last_loss": recs[-1].loss if recs else None,
      "min_loss": min(r.loss for r in recs) if recs else None,
      "losses": [r.loss for r in recs],
      "mean_step_seconds": mean([r.step_seconds for r in timed]),
      "mean_tokens_per_s": mean([r.tokens_per_s for r in timed]),
      "real_token_share": (mean([s.real_tokens / (s.rows * s.seq_len) for s in corpus.stats])
                           if corpus is not None and corpus.stats else None),
      "documents_per_row": (mean([s.documents / s.rows for s in corpus.stats])
                            if corpus is not None and corpus.stats else None),
      "blocks_skipped": skipped,
      "kvax_fwd_blocks": [cfg.kvax.fwd_query_block_size, cfg.kvax.fwd_kv_block_size],
      "wall_seconds": wall,
      **files,
  }


def _device_count() -> int:
  import jax
  return jax.device_count()


def print_summary(s: dict[str, Any], stream=None) -> None:
  stream = stream or sys.stdout
  w = s["wall_seconds"]
  lines = [
      "",
      f"== {s['family']}:{s['variant']} ({s['model']}), attention={s['attention']}"
      + (f" (kvax backend {s['kvax_backend']})" if s["kvax_backend"] else "")
      + f", {s['hardware']} x{s['devices']}",
      f"   {s['steps']} steps of {s['global_batch']} x {s['seq_len']} tokens"
      + (f"; {s['real_token_share']:.1%} real tokens, {s['documents_per_row']:.1f} document "
         "pieces per row" if s["real_token_share"] is not None else ""),
      f"   loss {s['first_loss']:.4f} -> {s['last_loss']:.4f} (min {s['min_loss']:.4f})",
      f"   {s['mean_tokens_per_s']:,.0f} real tok/s, {s['mean_step_seconds']:.2f} s/step "
      f"(after step 1); blocks skipped: "
      + (", ".join(f"{k} {v:.1%}" for k, v in s["blocks_skipped"].items()) or "n/a"),
      f"   wall: setup+compile {w['setup_and_compile']:.1f} s, training {w['training']:.1f} s, "
      f"total {w['total']:.1f} s",
      f"   mask:        {', '.join(s['mask_png']) or 'n/a'}",
      f"   loss plot:   {s['loss_png'] or 'n/a'}",
      f"   tensorboard: tensorboard --logdir {s['tensorboard_dir']}",
      f"   summary:     {s['summary_json']}   MaxText log: {s['maxtext_log']}",
  ]
  print("\n".join(lines), file=stream, flush=True)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def run(cfg, raw: dict[str, str], *, dry_run: bool = False) -> dict[str, Any] | None:
  """Check, translate and train; returns the summary (None for a dry run)."""
  t0 = time.perf_counter()
  check_config(cfg)
  platform = detect_platform() if cfg.hardware == "auto" else cfg.hardware
  if platform == "cpu" and cfg.attention not in ("kvax", "dot_product", "autoselected"):
    # MaxText's fused kernels are Pallas TPU / Triton GPU / cuDNN programs: they fail on CPU
    # deep inside tracing. Say so up front.
    raise FlagError(f"--config.attention={cfg.attention}: MaxText runs this kernel only on "
                    "GPU/TPU; on CPU use kvax or dot_product")
  backend = check_backend(cfg) if cfg.attention == "kvax" else None
  check_model(cfg)
  keys = maxtext_keys(cfg, platform)
  replaced = {k: (keys[k], v) for k, v in raw.items() if k in keys and _argv_value(keys[k]) != v}
  keys.update(raw)
  argv = maxtext_argv(keys)
  out = output_dir(cfg) if "base_output_directory" not in raw and "run_name" not in raw else None
  if replaced:
    print("raw MaxText overrides replace config-derived keys: " + ", ".join(
        f"{k}={new} (config: {_argv_value(old)})" for k, (old, new) in replaced.items()))

  from kvax_plugin.integrations import maxtext as kvax_maxtext
  kvax_maxtext.install()
  from maxtext.trainers.pre_train import train as mt_train

  out = out or os.path.join(keys["base_output_directory"], keys["run_name"])
  os.makedirs(out, exist_ok=True)
  log_path = os.path.join(out, "maxtext.log")
  holder: dict[str, Any] = {}
  with quiet_maxtext(log_path, cfg.quiet):
    # MaxText's own initialisation: its config (our keys + raw overrides), validated by it.
    config, recorder = mt_train.initialize(argv)
    check_maxtext_config(config, cfg, raw)
    if dry_run:
      print("\n".join(argv[1:]))
      return None
    print(f"kvax_plugin.launch: {cfg.family}:{cfg.variant} ({cfg.model}) attention={cfg.attention}"
          + (f" kvax backend={backend}" if backend else "") + f" on {platform}; output {out}",
          flush=True)
    can_draw = importlib.util.find_spec("matplotlib") is not None
    if not can_draw:
      # A bare GPU image may lack it (kvax-plugin's own install requires it): train anyway,
      # and say now, not after the run, that there will be no pictures.
      print("warning: matplotlib is not installed, so no mask.png / loss.png will be drawn "
            "(pip install matplotlib)", file=sys.stderr, flush=True)
    if importlib.util.find_spec("tensorboardX") is None:
      # MaxText's summary writer is tensorboardX; without it MaxText silently writes nothing.
      print("warning: tensorboardX is not installed, so MaxText writes no TensorBoard logs "
            "(pip install tensorboardX)", file=sys.stderr, flush=True)
    progress = Progress(cfg, holder, total_steps=config.steps)
    print(f"model: {config.num_query_heads} query / {config.num_kv_heads} kv heads, head dim "
          f"{config.head_dim}, {config.num_decoder_layers} layers, emb {config.emb_dim}"
          + (f", window {config.sliding_window_size}" if config.sliding_window_size else "")
          + (f", soft cap {config.attn_logits_soft_cap}" if config.attn_logits_soft_cap else "")
          + (", sinks" if getattr(config, "attention_sink", False) else "")
          + (", MLA" if str(config.attention_type) in ("mla", "AttentionType.MLA") else "")
          + f"; batch {config.global_batch_size_to_train_on} x {config.max_target_length}; "
          "compiling ...", flush=True)
    # An explicit raw dataset_type is the user choosing MaxText's own pipeline: honour it (and
    # say so) instead of replacing it with the corpus.
    data = (contextlib.nullcontext() if "dataset_type" in raw
            else packed_corpus_pipeline(cfg, holder))
    if "dataset_type" in raw:
      print(f"data: MaxText dataset_type={raw['dataset_type']} (the shipped corpus is not used; "
            "no mask statistics)", flush=True)
    with data, progress_hook(progress):
      mt_train.record_goodput(recorder, mt_train.RECORD_JOB_START_TIME)
      train_func = mt_train.get_train_func(config, recorder, argv)
      with mt_train.maybe_monitor_goodput(config):
        train_func()
  t_end = time.perf_counter()
  corpus = holder.get("corpus")
  if not progress.records:
    raise RuntimeError(f"MaxText ran no training step (steps={config.steps}); see {log_path}")
  first_step_done = sum(r.step_seconds for r in progress.records)
  files = {
      "loss_png": plot_losses(progress.records, os.path.join(out, "loss.png"),
                              f"{cfg.family}:{cfg.variant} ({cfg.model}), attention="
                              f"{cfg.attention}, packed corpus") if can_draw else None,
      "mask_png": draw_first_mask(corpus, out) if corpus is not None and can_draw else [],
      "tensorboard_dir": config.tensorboard_dir,
      "tensorboard_files": tensorboard_files(config),
      "maxtext_log": log_path,
      "summary_json": os.path.join(out, "summary.json"),
  }
  wall = {"total": t_end - t0, "training": first_step_done,
          "setup_and_compile": max(0.0, (t_end - t0) - first_step_done)}
  summary = summarize(cfg, config, progress, corpus, backend, wall, files)
  with open(files["summary_json"], "w") as f:
    json.dump(summary, f, indent=2)
  print_summary(summary)
  bad = [r.step for r in progress.records if not math.isfinite(r.loss)]
  if bad:
    raise RuntimeError(f"non-finite loss at steps {bad[:5]}")
  return summary


def _main(argv: Sequence[str]) -> None:
  raw = parse_raw_overrides(argv[1:])
  run(_CONFIG.value, raw, dry_run=_DRY_RUN.value)


def _parse_flags(argv: Sequence[str]) -> list[str]:
  # Errors while loading the config file or applying --config.<field> overrides name the flag
  # instead of ending in a traceback from ml_collections.
  check_config_path(argv)
  try:
    return flags.FLAGS(list(argv))
  except flags.Error as e:
    text = str(e).strip()
    if "Traceback" in text:
      # config_flags wraps the config file's exception with its traceback; its last line is
      # what the config file said (e.g. the unknown variant and the valid ones).
      text = text.splitlines()[-1].split(": ", 1)[-1]
    raise FlagError(text) from e
  except (AttributeError, KeyError) as e:
    field = next((a for a in argv if a.startswith("--config.")), "--config.<field>")
    raise FlagError(f"{field.split('=')[0]}: no such config field ({e}); see the config file's "
                    "fields with --dry_run, or pass a raw MaxText key as key=value") from e


def main(argv: Sequence[str] | None = None) -> int:
  import kvax_plugin
  argv = list(sys.argv if argv is None else argv)
  try:
    app.run(_main, argv=argv, flags_parser=_parse_flags)
  except SystemExit as e:
    return int(e.code or 0)
  except (FlagError, kvax_plugin.BackendUnavailableError) as e:
    print(f"kvax_plugin.launch: error: {e}", file=sys.stderr)
    return 2
  except SetupError as e:
    print(f"kvax_plugin.launch: error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
