"""The shipped corpus as a stream of MaxText feature batches (`PackedCorpus`), with per-batch
mask statistics (`BatchStats`); training_hooks.packed_corpus_pipeline hands it to MaxText.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

from kvax_plugin.errors import FlagError


@dataclasses.dataclass
class BatchStats:

  real_tokens: int
  rows: int
  seq_len: int
  documents: int
  skipped: dict[str, float]


class PackedCorpus:
  """Iterable of MaxText feature dicts (numpy), one per step. Every host packs the same global
  stream and keeps its own rows. With `mask_stats`, each batch's forward masks (global and any
  sliding window) are built to report the share of blocks skipped; `stats` gets one entry per
  batch, `first` keeps the first. The masks are built on the host's CPU device (on the
  accelerator they would wait for the step just dispatched), their program compiled in a
  background thread from construction on."""

  def __init__(self, cfg, *, seq_len: int, global_rows: int, host_index: int, host_count: int,
               sliding_window: int | None, mask_stats: bool = True,
               train_rows: int | None = None):
    if global_rows % host_count:
      raise FlagError(f"--config.per_device_batch_size: {global_rows} rows do not split over "
                      f"{host_count} loading hosts")
    self.cfg = cfg
    self.seq_len = seq_len
    self.global_rows = global_rows
    self.rows = global_rows // host_count
    # MaxText trains on the first global_batch_size_to_train_on rows: statistics count those.
    self.train_rows = global_rows if train_rows is None else min(train_rows, global_rows)
    self.host_index = host_index
    self.sliding_window = sliding_window
    self.mask_stats = mask_stats
    self.stats: list[BatchStats] = []
    self.first = None
    self._compiling = None
    lo = host_index * self.rows
    self.trained_host_rows = max(0, min(lo + self.rows, self.train_rows) - lo)
    if mask_stats and self.trained_host_rows:
      shape = (self.trained_host_rows, seq_len)
      self._compiling = threading.Thread(
          target=self._compile_masks, args=(shape,), name="kvax-mask-stats-compile", daemon=True)
      self._compiling.start()

  def _compile_masks(self, shape: tuple[int, int]) -> None:
    # Any batch of this shape compiles the same programs; an error recurs on the first batch.
    import numpy as np
    try:
      self._masks(np.zeros(shape, np.int32), np.ones(shape, np.int32))
    except Exception:  # noqa: BLE001
      pass

  def masks(self, batch) -> dict[str, Any]:
    """kvax forward masks of a PackedBatch, {"global": mask[, "local": mask]}, on the CPU device."""
    from kvax_plugin.data import to_kvax
    return self._masks(*to_kvax(batch))

  def _masks(self, pos, seg) -> dict[str, Any]:
    import jax

    import kvax_plugin
    params = kvax_plugin.FlashAttentionParamsConfig(
        query_block_size=self.cfg.kvax.fwd_query_block_size,
        kv_block_size=self.cfg.kvax.fwd_kv_block_size)
    with jax.default_device(_host_device()):
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
        if self._compiling is not None:
          self._compiling.join()
      n = max(0, min(hi, self.train_rows) - lo)
      trained = PackedBatch(batch.tokens[:n], batch.segment_ids[:n], batch.positions[:n],
                            batch.pieces[:n])
      skipped = ({name: kvax_plugin.mask_sparsity(m)["skipped"]
                  for name, m in self.masks(trained).items()} if self.mask_stats and n else {})
      self.stats.append(BatchStats(real_tokens=trained.num_real_tokens, rows=n,
                                   seq_len=batch.seq_len,
                                   documents=int(sum(trained.segments_per_row())),
                                   skipped=skipped))
      yield {k: np.asarray(v) for k, v in maxtext_features(batch).items()}


def _host_device():
  """This process's first CPU device (process-local under jax.distributed), or None (JAX's
  default device) when the CPU backend is not enabled."""
  import jax
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


__all__ = ["BatchStats", "PackedCorpus"]
