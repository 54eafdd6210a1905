"""benchmarks/tools/transformer_engine/fatbin_keep_arch.py on a hand-made ELF: the kept
architecture's entries survive byte for byte, the others are gone, offsets stay."""

import struct

import pytest

from benchmarks.tools.transformer_engine import fatbin_keep_arch as fk


def entry(sm: int, payload: bytes) -> bytes:
  header = struct.pack("<HHIQ", 2, 0x101, 64, len(payload)) + bytes(12)
  header += struct.pack("<I", sm) + bytes(64 - 32)
  return header + payload


def fatbin(*entries: bytes) -> bytes:
  body = b"".join(entries)
  return struct.pack("<IHHQ", fk.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(section_data: bytes) -> bytearray:
  """ELF64 with sections: null, .nv_fatbin (section_data), .shstrtab."""
  names = b"\0.nv_fatbin\0.shstrtab\0"
  data_off = 64
  names_off = data_off + len(section_data)
  shoff = names_off + len(names)
  head = bytearray(64)
  head[:4] = b"\x7fELF"
  struct.pack_into("<Q", head, 0x28, shoff)
  struct.pack_into("<HHH", head, 0x3A, 64, 3, 2)
  sh = lambda name, off, size: struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, off, size, 0, 0, 1, 0)
  return bytearray(bytes(head) + section_data + names + sh(0, 0, 0)
                   + sh(1, data_off, len(section_data)) + sh(12, names_off, len(names)))


def test_keeps_one_architecture():
  first = fatbin(entry(80, b"a" * 16), entry(90, b"b" * 24), entry(100, b"c" * 8))
  second = fatbin(entry(90, b"d" * 8), entry(120, b"e" * 40))
  data = first + bytes(8) + second  # zero padding between fatbins
  blob = elf(data)
  per_sm = fk.keep_arch(blob, 90)
  assert per_sm == {80: 16, 90: 32, 100: 8, 120: 40}
  out = bytes(blob[64:64 + len(data)])
  assert out[:16 + 88] == fatbin(entry(90, b"b" * 24))  # the kept entry moved to the front
  assert out[16 + 88:len(first)] == bytes(len(first) - 16 - 88)  # the rest are zeros
  start = len(first) + 8  # the second fatbin did not move
  assert out[start:start + 16 + 72] == fatbin(entry(90, b"d" * 8))
  assert set(out[start + 88:]) == {0}


def test_inconsistent_fatbin_is_an_error():
  bad = bytearray(fatbin(entry(90, b"x" * 8)))
  struct.pack_into("<Q", bad, 8, 50)  # the header claims more than its entries hold
  with pytest.raises(SystemExit, match="entries end at"):
    fk.keep_arch(elf(bytes(bad) + bytes(64)), 90)
