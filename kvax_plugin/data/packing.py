"""Packing tokenized documents into fixed-length rows: first-fit decreasing, with segment ids.

MaxText's conventions: tokens, segment_ids (1..n per row, 0 = padding) and positions int32
[num_seqs, seq_len], padding a suffix; `to_kvax` converts to kvax's padding id -1. Documents
longer than seq_len are cut into pieces, each its own segment. Deterministic for a given seed.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from kvax_plugin.data.tokenizer import PAD_ID, ByteTokenizer

# Restated so data code runs without JAX.
KVAX_PADDING_SEGMENT_ID = -1
MAXTEXT_PADDING_SEGMENT_ID = 0


@dataclasses.dataclass(frozen=True)
class Piece:
  """The slice [start, start + length) of document number `document` (its index in the input)."""

  document: int
  start: int
  length: int


@dataclasses.dataclass(frozen=True, eq=False)
class PackedBatch:
  """Packed rows: row r holds pieces[r][0], pieces[r][1], ... as segments 1, 2, ...; tokens,
  segment_ids, positions int32 [num_seqs, seq_len]."""

  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  pieces: tuple[tuple[Piece, ...], ...]

  @property
  def num_seqs(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def seq_len(self) -> int:
    return int(self.tokens.shape[1])

  @property
  def num_real_tokens(self) -> int:
    return int(np.count_nonzero(self.segment_ids))

  @property
  def fill(self) -> float:
    """Share of the [num_seqs, seq_len] slots holding real tokens."""
    return self.num_real_tokens / max(1, self.tokens.size)

  def segments_per_row(self) -> list[int]:
    return [len(p) for p in self.pieces]


def split_into_pieces(lengths: Sequence[int], seq_len: int) -> list[Piece]:
  """Cut documents into pieces of at most seq_len tokens, in order (none for empty ones)."""
  _check_seq_len(seq_len)
  pieces = []
  for doc, length in enumerate(lengths):
    if length < 0:
      raise ValueError(f"lengths must be >= 0, got {length} for document {doc}")
    for start in range(0, int(length), seq_len):
      pieces.append(Piece(doc, start, min(seq_len, int(length) - start)))
  return pieces


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
  """First-fit decreasing: one list of item indices per bin (increasing, so a row reads in
  arrival order), bins in opening order. sizes: each in [1, capacity]."""
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  for i, s in enumerate(sizes):
    if not 1 <= s <= capacity:
      raise ValueError(f"sizes[{i}] = {s} must lie in [1, capacity={capacity}]")
  # Stable sort: deterministic.
  order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
  free: list[int] = []
  bins: list[list[int]] = []
  for i in order:
    s = sizes[i]
    for b, room in enumerate(free):
      if s <= room:
        bins[b].append(i)
        free[b] -= s
        break
    else:
      bins.append([i])
      free.append(capacity - s)
  return [sorted(b) for b in bins]


def _assemble(rows: Sequence[Sequence[tuple[Piece, np.ndarray]]], seq_len: int,
              num_seqs: int | None = None, pad_id: int = PAD_ID) -> PackedBatch:
  """Write rows of (piece, piece tokens) into arrays; rows past len(rows) are all padding."""
  n = len(rows) if num_seqs is None else num_seqs
  if n < len(rows):
    raise ValueError(f"num_seqs ({n}) is smaller than the number of rows ({len(rows)})")
  tokens = np.full((n, seq_len), pad_id, np.int32)
  segment_ids = np.full((n, seq_len), MAXTEXT_PADDING_SEGMENT_ID, np.int32)
  positions = np.zeros((n, seq_len), np.int32)
  all_pieces = []
  for r, row in enumerate(rows):
    offset = 0
    for seg, (piece, toks) in enumerate(row, start=1):
      end = offset + piece.length
      if end > seq_len:
        raise ValueError(f"row {r} overflows: its pieces need more than seq_len={seq_len} tokens")
      tokens[r, offset:end] = toks
      segment_ids[r, offset:end] = seg
      positions[r, offset:end] = np.arange(piece.length, dtype=np.int32)
      offset = end
    all_pieces.append(tuple(p for p, _ in row))
  all_pieces += [()] * (n - len(rows))
  return PackedBatch(tokens, segment_ids, positions, tuple(all_pieces))


def pack_documents(documents: Sequence[np.ndarray], seq_len: int, *,
                   pad_id: int = PAD_ID) -> PackedBatch:
  """Pack every token of `documents` (1-D integer token arrays, empty ones skipped) into as few
  [num_rows, seq_len] rows as first-fit decreasing finds; pad_id fills padding."""
  docs = [_as_tokens(d, f"documents[{i}]") for i, d in enumerate(documents)]
  pieces = split_into_pieces([len(d) for d in docs], seq_len)
  rows = first_fit_decreasing([p.length for p in pieces], seq_len)
  return _assemble([[(pieces[i], _slice(docs, pieces[i])) for i in row] for row in rows],
                   seq_len, pad_id=pad_id)


def to_kvax_segment_ids(segment_ids: np.ndarray) -> np.ndarray:
  """MaxText segment ids (0 = padding) -> kvax segment ids (-1 = padding); int32, same shape."""
  seg = np.asarray(segment_ids)
  if not np.issubdtype(seg.dtype, np.integer):
    raise TypeError(f"segment_ids must hold integers, got dtype {seg.dtype}")
  if seg.size and seg.min() < 0:
    raise ValueError("segment_ids must be in MaxText convention (>= 0, 0 = padding); got a "
                     f"negative id {int(seg.min())}: already in kvax convention?")
  return np.where(seg == MAXTEXT_PADDING_SEGMENT_ID, KVAX_PADDING_SEGMENT_ID,
                  seg).astype(np.int32)


def to_kvax(batch: PackedBatch) -> tuple[np.ndarray, np.ndarray]:
  """(positions, segment_ids) int32 [num_seqs, seq_len] in kvax convention (-1 = padding), for
  both the query and the key/value side."""
  return batch.positions.astype(np.int32), to_kvax_segment_ids(batch.segment_ids)


def maxtext_features(batch: PackedBatch) -> dict[str, np.ndarray]:
  """MaxText's packed-input feature dict, int32 [num_seqs, seq_len]: targets[t] = tokens[t + 1]
  within a segment, else PAD_ID with targets_segmentation 0 (so the loss skips it)."""
  tok, seg, pos = batch.tokens, batch.segment_ids, batch.positions
  next_tok = np.concatenate([tok[:, 1:], np.full_like(tok[:, :1], PAD_ID)], axis=1)
  next_seg = np.concatenate([seg[:, 1:], np.zeros_like(seg[:, :1])], axis=1)
  has_target = (seg != 0) & (next_seg == seg)
  return {
      "inputs": tok, "inputs_segmentation": seg, "inputs_position": pos,
      "targets": np.where(has_target, next_tok, PAD_ID).astype(np.int32),
      "targets_segmentation": np.where(has_target, seg, 0).astype(np.int32),
      "targets_position": pos,
  }


def batch_iterator(seq_len: int, batch_size: int, *, seed: int = 0,
                   num_epochs: int | None = None, documents: Sequence[str] | None = None,
                   tokenizer: ByteTokenizer | None = None, window_batches: int = 8,
                   drop_remainder: bool = True, min_row_fill: float = 0.9,
                   min_chars: int = 64, max_chars: int = 4096) -> Iterator[PackedBatch]:
  """Endless (or num_epochs) stream of packed [batch_size, seq_len] batches of the corpus.

  Each epoch visits the documents in a new seeded order; windows of window_batches batches are
  packed by FFD and the fullest rows emitted, shuffled; rows that miss a batch or min_row_fill go
  back to the next window, so no token is dropped before the last epoch. documents: texts instead
  of the shipped corpus; tokenizer: default ByteTokenizer; drop_remainder: drop the last epoch's
  rows that do not fill a batch (else pad with empty rows); min_chars, max_chars: the corpus's
  document lengths.
  """
  _check_seq_len(seq_len)
  for name, value in (("batch_size", batch_size), ("window_batches", window_batches)):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if not 0.0 <= min_row_fill <= 1.0:
    raise ValueError(f"min_row_fill must lie in [0, 1], got {min_row_fill}")
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs must be None (endless) or >= 1, got {num_epochs}")
  if documents is None:
    from kvax_plugin.data.corpus import load_documents
    documents = load_documents(seed=seed, min_chars=min_chars, max_chars=max_chars)
  tok = tokenizer or ByteTokenizer()
  encoded = [tok.encode(d) for d in documents]
  if not any(len(e) for e in encoded):
    raise ValueError("documents must hold at least one non-empty document")
  window_tokens = window_batches * batch_size * seq_len
  row_rng = np.random.default_rng((seed, 1))

  def piece_stream() -> Iterator[tuple[Piece, np.ndarray]]:
    epochs = itertools.count() if num_epochs is None else range(num_epochs)
    for epoch in epochs:
      order = np.random.default_rng((seed, 0, epoch)).permutation(len(encoded))
      for d in order:
        for start in range(0, len(encoded[d]), seq_len):
          piece = Piece(int(d), start, min(seq_len, len(encoded[d]) - start))
          yield piece, encoded[d][start:start + piece.length]

  stream = piece_stream()
  pending: list[tuple[Piece, np.ndarray]] = []
  exhausted = False
  while True:
    size = sum(p.length for p, _ in pending)
    while size < window_tokens and not exhausted:
      item = next(stream, None)
      if item is None:
        exhausted = True
      else:
        pending.append(item)
        size += item[0].length
    if not pending:
      return
    rows = first_fit_decreasing([p.length for p, _ in pending], seq_len)
    fills = [sum(pending[i][0].length for i in row) for row in rows]
    # Fullest first; rows under min_row_fill wait for the next window (unless none would emit).
    order = sorted(range(len(rows)), key=lambda r: -fills[r])
    if exhausted:
      n_emit = len(rows) if not drop_remainder else len(rows) // batch_size * batch_size
    else:
      good = sum(f >= min_row_fill * seq_len for f in fills)
      n_emit = max(good // batch_size, 1) * batch_size
    emit = [rows[r] for r in order[:n_emit]]
    rest = [rows[r] for r in order[n_emit:]]
    row_rng.shuffle(emit)
    for b in range(0, len(emit), batch_size):
      yield _assemble([[pending[i] for i in row] for row in emit[b:b + batch_size]], seq_len,
                      num_seqs=batch_size)
    if exhausted:
      return
    pending = [pending[i] for i in sorted(i for row in rest for i in row)]


def _check_seq_len(seq_len: int) -> None:
  if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
    raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")


def _as_tokens(x, name: str) -> np.ndarray:
  arr = np.asarray(x)
  if arr.ndim != 1:
    raise ValueError(f"{name} must be a 1-D token array, got shape {arr.shape}")
  if arr.size and not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
  return arr.astype(np.int32)


def _slice(docs: Sequence[np.ndarray], piece: Piece) -> np.ndarray:
  return docs[piece.document][piece.start:piece.start + piece.length]


__all__ = ["Piece", "PackedBatch", "split_into_pieces", "first_fit_decreasing", "pack_documents",
           "to_kvax_segment_ids", "to_kvax", "maxtext_features", "batch_iterator",
           "KVAX_PADDING_SEGMENT_ID", "MAXTEXT_PADDING_SEGMENT_ID"]
