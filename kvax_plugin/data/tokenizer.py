"""A byte-level tokenizer: 0 = pad (MaxText's padding), 1 = bos, 2 = eos, byte b -> b + 3 (259
ids). Every str round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_OFFSET = 3
VOCAB_SIZE = 256 + BYTE_OFFSET


class ByteTokenizer:

  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  vocab_size = VOCAB_SIZE

  def encode_bytes(self, data: bytes, *, add_bos: bool = True, add_eos: bool = True) -> np.ndarray:
    """bytes of length n -> int32 [n + add_bos + add_eos]."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
      raise TypeError(f"data must be bytes, got {type(data).__name__}")
    body = np.frombuffer(bytes(data), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
    parts = ([np.array([BOS_ID], np.int32)] if add_bos else []) + [body] + (
        [np.array([EOS_ID], np.int32)] if add_eos else [])
    return np.concatenate(parts)

  def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = True) -> np.ndarray:
    """str -> int32 [len(text.encode('utf-8')) + add_bos + add_eos]."""
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__} (use encode_bytes)")
    return self.encode_bytes(text.encode("utf-8"), add_bos=add_bos, add_eos=add_eos)

  def decode_bytes(self, ids: Iterable[int] | np.ndarray) -> bytes:
    """ids -> bytes, dropping pad/bos/eos. Ids outside [0, vocab_size) are an error."""
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
      raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64).ravel()
    bad = (arr < 0) | (arr >= VOCAB_SIZE)
    if bad.any():
      raise ValueError(f"ids must lie in [0, {VOCAB_SIZE}), got {int(arr[bad][0])}")
    return (arr[arr >= BYTE_OFFSET] - BYTE_OFFSET).astype(np.uint8).tobytes()

  def decode(self, ids: Iterable[int] | np.ndarray, *, errors: str = "replace") -> str:
    """ids -> str; a piece cut in the middle of a multi-byte character decodes with U+FFFD."""
    return self.decode_bytes(ids).decode("utf-8", errors=errors)


__all__ = ["ByteTokenizer", "PAD_ID", "BOS_ID", "EOS_ID", "BYTE_OFFSET", "VOCAB_SIZE"]
