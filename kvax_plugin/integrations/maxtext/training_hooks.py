"""Hooks the launcher sets on MaxText for one run (each restores on exit): packed_corpus_pipeline
(MaxText's data iterator returns the packed corpus, with per-batch mask statistics for kvax
runs) and progress_hook (train metrics also go to a Progress printing one line per step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time

from kvax_plugin.data.feeding import BatchStats, PackedCorpus
from kvax_plugin.errors import FlagError


def _mask_stats_on() -> bool:
  """KVAX_FEED_MASK_STATS: 1 (default) builds each batch's mask for the report, 0 not."""
  raw = os.environ.get("KVAX_FEED_MASK_STATS", "") or "1"
  if raw not in ("1", "0"):
    raise FlagError(f"environment variable KVAX_FEED_MASK_STATS={raw!r}: expected 1 (default) "
                    "or 0")
  return raw == "1"


@contextlib.contextmanager
def packed_corpus_pipeline(cfg, holder: dict):
  """MaxText's create_data_iterator returns the packed corpus within the block; holder["corpus"]
  receives the PackedCorpus."""
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
      window = None
    if jax.process_index() not in loading:
      # As MaxText: hosts that hold no batch rows feed placeholders.
      return synthetic_data_processing.PlaceHolderDataIterator(config, mesh), None
    corpus = PackedCorpus(cfg, seq_len=config.max_target_length,
                          global_rows=config.global_batch_size_to_load,
                          host_index=loading.index(jax.process_index()), host_count=len(loading),
                          sliding_window=window, train_rows=config.global_batch_size_to_train_on,
                          mask_stats=str(config.attention) == "kvax" and _mask_stats_on())
    holder["corpus"] = corpus
    return multihost_dataloading.MultiHostDataLoadIterator(corpus, mesh), None

  ipi.create_data_iterator = create_data_iterator
  try:
    yield
  finally:
    ipi.create_data_iterator = original


@dataclasses.dataclass
class StepRecord:
  """One training step as the launcher reports it. step_seconds: time between this step's
  result and the previous one's (device throughput; the first step has MaxText's clock).
  maxtext_step_seconds: MaxText's dispatch clock, which runs up to a step ahead of the device."""
  step: int
  loss: float
  step_seconds: float
  tokens_per_s: float
  skipped: dict[str, float]
  received: float = 0.0
  maxtext_step_seconds: float = float("nan")  # MaxText's perf/step_time_seconds
  real_tokens: float = float("nan")


class Progress:

  def __init__(self, cfg, holder: dict, total_steps: int, stream=None,
               block_skipping: bool = True):
    # block_skipping: False when another kernel ran (the mask statistics say nothing then).
    self.cfg = cfg
    self.block_skipping = block_skipping
    self.holder = holder
    self.total_steps = total_steps
    self.records: list[StepRecord] = []
    self.stream = stream or sys.stdout
    self.start_step = None

  def on_train_metrics(self, metrics: dict, step: int, now: float | None = None) -> None:
    """MaxText's metrics of `step`, handed over one step late; `now`: time.time() (tests pass
    their own)."""
    scalars = metrics["scalar"]
    loss = float(scalars["learning/loss"])
    received = time.time() if now is None else now
    maxtext_seconds = float(scalars.get("perf/step_time_seconds", float("nan")))
    seconds = received - self.records[-1].received if self.records else maxtext_seconds
    corpus = self.holder.get("corpus")
    if self.start_step is None:
      self.start_step = step
    index = step - self.start_step
    stats = corpus.stats[index] if corpus is not None and index < len(corpus.stats) else None
    if stats is not None:
      # Scale the host's real tokens to the global batch.
      real = stats.real_tokens * self._host_scale(stats)
      tokens_per_s = real / seconds if seconds > 0 else float("nan")
      scalars["perf/step_result_seconds"] = seconds
      skipped = dict(stats.skipped) if self.block_skipping else {}
      scalars["perf/real_tokens_per_sec"] = tokens_per_s
      scalars["data/real_token_share"] = stats.real_tokens / max(1, stats.rows * stats.seq_len)
      for name, share in skipped.items():
        scalars[f"kvax/blocks_skipped_{name}"] = share
    else:
      real, tokens_per_s, skipped = float("nan"), float("nan"), {}
    record = StepRecord(step, loss, seconds, tokens_per_s, skipped, received=received,
                        maxtext_step_seconds=maxtext_seconds, real_tokens=real)
    self.records.append(record)
    if (step + 1) % self.cfg.log_every == 0 or step == 0 or step + 1 == self.total_steps:
      print(self.format(record), file=self.stream, flush=True)

  def _host_scale(self, stats: BatchStats) -> float:
    corpus = self.holder["corpus"]
    return corpus.train_rows / max(1, stats.rows)

  def format(self, r: StepRecord) -> str:
    width = len(str(self.total_steps))
    skip = "/".join(f"{v:.0%}" for v in r.skipped.values()) or "n/a"
    names = "/".join(r.skipped) or "mask"
    line = (f"step {r.step + 1:>{width}}/{self.total_steps}  loss {r.loss:7.4f}  "
            f"{r.tokens_per_s:9,.0f} real tok/s  {r.step_seconds:6.2f} s/step")
    return line + (f"  blocks skipped ({names}) {skip}" if self.block_skipping else "")


@contextlib.contextmanager
def progress_hook(progress: Progress):
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

