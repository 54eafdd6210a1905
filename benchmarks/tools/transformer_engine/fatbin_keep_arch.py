"""Keep only one GPU architecture's cubins in the CUDA fatbins of an ELF shared object.

    python fatbin_keep_arch.py SRC DST 90

Why: TransformerEngine's libtransformer_engine.so carries cubins for eight architectures
(sm_75 ... sm_120, 263 MB of its 343 MB) and does not compress; one device call carries at
most 64 MiB. The H100 / H200 machines load only the sm_90 entries.

How: the .nv_fatbin section is a run of fatbins (header: magic 0xBA55ED50, u16 version, u16
header size, u64 payload size), each a list of entries (u16 kind, u16 version, u32 header size,
u64 padded payload size, ..., u32 SM number at byte 28). In every fatbin the kept entries move
to the front and the header's size shrinks to them; the freed bytes become zeros, which
compress to nothing. Offsets of the fatbins themselves do not change, so the registration
records that point at them stay valid. `cuobjdump -lelf DST` lists what is left.
"""

from __future__ import annotations

import struct
import sys

FATBIN_MAGIC = 0xBA55ED50


def section(blob: bytes, wanted: str) -> tuple[int, int]:
  """(file offset, size) of the ELF64 section named `wanted`."""
  shoff, = struct.unpack_from("<Q", blob, 0x28)
  shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
  headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize)
             for i in range(shnum)]
  names = headers[shstrndx][4]
  for h in headers:
    start = names + h[0]
    if blob[start:blob.index(b"\0", start)].decode() == wanted:
      return h[4], h[5]
  raise SystemExit(f"no section {wanted!r}")


def keep_arch(blob: bytearray, sm: int) -> dict[int, int]:
  """Rewrites `blob` in place; returns bytes of payload per SM number before the change."""
  offset, size = section(blob, ".nv_fatbin")
  end, pos, per_sm = offset + size, offset, {}
  while pos < end:
    magic, _, header, payload = struct.unpack_from("<IHHQ", blob, pos)
    if magic != FATBIN_MAGIC:
      pos += 8  # fatbins are 8-byte aligned, zero padding between them
      continue
    entry, stop, kept = pos + header, pos + header + payload, []
    while entry < stop:
      _, _, entry_header, padded = struct.unpack_from("<HHIQ", blob, entry)
      entry_sm, = struct.unpack_from("<I", blob, entry + 28)
      per_sm[entry_sm] = per_sm.get(entry_sm, 0) + padded
      if entry_sm == sm:
        kept.append(bytes(blob[entry:entry + entry_header + padded]))
      entry += entry_header + padded
    if entry != stop:
      raise SystemExit(f"fatbin at {pos:#x}: entries end at {entry:#x}, header says {stop:#x}")
    packed = b"".join(kept)
    blob[pos + header:stop] = packed + bytes(payload - len(packed))
    struct.pack_into("<Q", blob, pos + 8, len(packed))
    pos = stop
  return per_sm


def main(src: str, dst: str, sm: str) -> None:
  blob = bytearray(open(src, "rb").read())
  per_sm = keep_arch(blob, int(sm))
  open(dst, "wb").write(blob)
  print("MiB of cubins per SM before:", {k: v >> 20 for k, v in sorted(per_sm.items())},
        f"kept sm_{sm}")


if __name__ == "__main__":
  main(*sys.argv[1:])
