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


def _pack(lengths, seq_len: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
  """Documents of the given lengths back to back from token 0, padding after them."""
  lengths = [int(x) for x in lengths if int(x) > 0]
  if sum(lengths) > seq_len:
    raise ValueError(f"document lengths sum to {sum(lengths)} > seq_len {seq_len}")
  pos = np.zeros((batch, seq_len), np.int32)
  seg = np.full((batch, seq_len), PADDING_SEGMENT_ID, np.int32)
  start = 0
  for d, ln in enumerate(lengths):
    seg[:, start:start + ln] = d
    pos[:, start:start + ln] = np.arange(ln)
    start += ln
  return pos, seg


def two_documents(seq_len: int, first_fraction: float = 0.75,
                  batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Two documents filling the row: the first `first_fraction` of it, then the rest."""
  first = int(round(seq_len * first_fraction))
  return _pack([first, seq_len - first], seq_len, batch)


def power_law_documents(seq_len: int, *, pad_fraction: float = 0.05, alpha: float = 1.2,
                        min_len: int = 64, batch: int = 1,
                        seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Pareto-distributed document lengths (shape `alpha`, at least `min_len`) packed until
  (1 - pad_fraction) of the row is full, the last one cut to fit; padding after them."""
  rng = np.random.default_rng(seed)
  body = int(seq_len * (1.0 - pad_fraction))
  lengths = []
  while sum(lengths) < body:
    ln = int(min_len * (1.0 + rng.pareto(alpha)))
    lengths.append(min(ln, body - sum(lengths)))
  return _pack(lengths, seq_len, batch)


def tiny_documents(seq_len: int, *, max_len: int = 96, batch: int = 1,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Many tiny documents (uniform lengths 1..max_len) filling the row."""
  rng = np.random.default_rng(seed)
  lengths = []
  while sum(lengths) < seq_len:
    lengths.append(min(int(rng.integers(1, max_len + 1)), seq_len - sum(lengths)))
  return _pack(lengths, seq_len, batch)


def long_plus_short(seq_len: int, *, long_fraction: float = 0.5, short_max: int = 512,
                    batch: int = 1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """One long document of `long_fraction` of the row, then short ones (lengths 16..short_max)."""
  rng = np.random.default_rng(seed)
  first = int(seq_len * long_fraction)
  lengths = [first]
  while sum(lengths) < seq_len:
    lengths.append(min(int(rng.integers(16, short_max + 1)), seq_len - sum(lengths)))
  return _pack(lengths, seq_len, batch)


def balance_layouts(seq_len: int, *, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """The layouts benchmarks/cp_balance.py and tests/test_token_order.py measure, by name."""
  return {
      "one document": one_document(seq_len),
      "two docs 3/4 + 1/4": two_documents(seq_len),
      "power-law + 5% pad": power_law_documents(seq_len, seed=seed),
      "tiny docs": tiny_documents(seq_len, seed=seed),
      "long + many short": long_plus_short(seq_len, seed=seed),
      "12 docs + pad": random_documents(seq_len, 12, seq_len // 128, seed=seed),
  }
