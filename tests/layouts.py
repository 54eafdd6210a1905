"""Seeded generators of packed-sequence layouts (positions, segment ids), shared by the tests.

Every generator returns int32 numpy arrays [B, S] in kvax convention (padding = -1).
"""

from __future__ import annotations

import numpy as np

INT32_MAX = np.iinfo(np.int32).max


def packed_documents(rng: np.random.Generator, batch: int, length: int, *, num_docs: int,
                     pad_tail: int = 0, one_token_docs: int = 0, huge_ids: bool = False,
                     first_id: int = 0):
  """Contiguous documents with positions 0..len-1 each, optional padding at the end.

  one_token_docs: how many of the documents are forced to length 1.
  huge_ids: segment ids near int32 max instead of small integers.
  """
  seg = np.full((batch, length), -1, np.int32)
  pos = np.zeros((batch, length), np.int32)
  body = length - pad_tail
  for b in range(batch):
    n = max(1, min(num_docs, body))
    lengths = np.ones(n, np.int64)
    rest = body - n
    if rest > 0:
      free = n - min(one_token_docs, n - 1)
      weights = rng.dirichlet(np.ones(free))
      extra = np.floor(weights * rest).astype(np.int64)
      extra[0] += rest - extra.sum()
      lengths[n - free:] += extra
    rng.shuffle(lengths)
    start = 0
    for d, ln in enumerate(lengths):
      sid = (INT32_MAX - 2 * n + d) if huge_ids else first_id + d
      seg[b, start:start + ln] = sid
      pos[b, start:start + ln] = np.arange(ln)
      start += ln
  return pos, seg


def non_contiguous_documents(rng: np.random.Generator, batch: int, length: int, *,
                             num_docs: int, chunk: int, pad_fraction: float = 0.1):
  """Documents cut into chunks and interleaved: a segment id reappears after other segments.

  Positions keep counting up within each document across its chunks; padding chunks are mixed in.
  """
  seg = np.empty((batch, length), np.int32)
  pos = np.empty((batch, length), np.int32)
  for b in range(batch):
    counters = np.zeros(num_docs, np.int64)
    for start in range(0, length, chunk):
      stop = min(length, start + chunk)
      if rng.random() < pad_fraction:
        seg[b, start:stop] = -1
        pos[b, start:stop] = 0
        continue
      d = rng.integers(num_docs)
      seg[b, start:stop] = 7 * d + 3
      pos[b, start:stop] = counters[d] + np.arange(stop - start)
      counters[d] += stop - start
  return pos, seg


def random_positions(rng: np.random.Generator, batch: int, length: int, *, num_docs: int):
  """Arbitrary (non-monotone) positions and random segment ids, some padding: no assumption holds."""
  seg = rng.integers(0, num_docs, size=(batch, length)).astype(np.int32)
  seg[rng.random((batch, length)) < 0.1] = -1
  pos = rng.integers(0, length, size=(batch, length)).astype(np.int32)
  return pos, seg


def dense_mask_np(qpos, qseg, kpos, kseg, causal=True, window=None):
  """bool [B, Sq, Skv] computed in numpy with int64 arithmetic (an independent oracle)."""
  qp = qpos[:, :, None].astype(np.int64)
  kp = kpos[:, None, :].astype(np.int64)
  qs, ks = qseg[:, :, None], kseg[:, None, :]
  keep = (qs == ks) & (qs != -1)
  if causal:
    keep &= kp <= qp
  if window is not None:
    keep &= (qp - kp) < window
    if not causal:
      keep &= (kp - qp) < window
  return keep
