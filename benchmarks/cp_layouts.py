"""Packed-document layouts shared by the context-parallel benchmarks (numpy only, no jax)."""

from __future__ import annotations

import numpy as np

PADDING_SEGMENT_ID = -1  # same value as kvax_plugin.attention.params.PADDING_SEGMENT_ID


def random_documents(seq_len: int, num_docs: int, num_pad: int, *, batch: int = 1,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """`num_docs` contiguous documents of random lengths, then `num_pad` padding tokens.

  Returns (positions, segment_ids), int32 [batch, seq_len]; positions restart at 0 in every
  document, segment ids are 0..num_docs-1 and PADDING_SEGMENT_ID for the padding tail.
  Lengths: seq_len - num_pad cut at num_docs - 1 distinct random points (seeded).
  """
  body = seq_len - num_pad
  if body < num_docs or num_pad < 0:
    raise ValueError(f"seq_len {seq_len} - num_pad {num_pad} must leave >= num_docs ({num_docs}) "
                     "tokens")
  rng = np.random.default_rng(seed)
  pos = np.zeros((batch, seq_len), np.int32)
  seg = np.full((batch, seq_len), PADDING_SEGMENT_ID, np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, body), size=num_docs - 1, replace=False))
    bounds = [0, *cuts.tolist(), body]
    for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[b, lo:hi] = d
      pos[b, lo:hi] = np.arange(hi - lo)
  return pos, seg


def one_document(seq_len: int, batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """A single causal document filling the sequence: positions 0..seq_len-1, segment id 0."""
  pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy()
  return pos, np.zeros((batch, seq_len), np.int32)
