"""The kernels' tuning options (`KernelOptions`), and the environment variables kvax reads.

Options of one backend are ignored by the others; the measurements behind the defaults are in
docs/performance.md. No environment variable tunes a kernel. This table is all of them
(tests/test_options.py compares it with the reads in kvax_plugin/):

    KVAX_CHECK_MASK_INPUTS    attention/validation.py: 1 makes every flash_attention call
                              check its mask against its positions / segment ids.
    KVAX_FEED_MASK_STATS      integrations/maxtext/training_hooks.py: 0 skips the packed-corpus
                              feeder's per-batch blocks-skipped report.
    KVAX_LEVANTER_BACKEND     integrations/levanter/settings.py: Levanter's kvax backend where
                              configure() was not called.
    KVAX_LEVANTER_BLOCK_SIZE  integrations/levanter/settings.py: the block size of both passes.

Names that look alike but are not environment variables: KVAX_PATCHED, KVAX_SM90_VARIANTS (a
CUDA macro), KVAX_PROVIDER, KVAX_CONFIG_FIELDS, KVAX_KEYS, KVAX_BACKENDS, KVAX_PADDING_SEGMENT_ID.
"""

from __future__ import annotations

import dataclasses

FORWARD_GRIDS = ("auto", "persistent", "per_tile")
TRITON_TILE_KEYS = ("fwd", "dq", "dkv", "gqa")


def producer_registers(consumer_registers, name: str = "consumer_registers") -> int:
  """The Mosaic producer's registers when both consumers take `consumer_registers`: 504 - 2 x
  it. ValueError naming `name` unless an int, a multiple of 8, leaving the producer 24..256."""
  regs = consumer_registers
  if (isinstance(regs, bool) or not isinstance(regs, int) or regs % 8 or regs > 256
      or not 24 <= 504 - 2 * regs <= 256):
    raise ValueError(f"{name}={regs!r}: expected a multiple of 8 that leaves the producer "
                     "24..256 registers (504 - 2 x it), e.g. 232 or 240")
  return 504 - 2 * regs


@dataclasses.dataclass(frozen=True)
class KernelOptions:
  """Tuning options of the kernel backends; every default is the measured choice. Hashable
  (part of the compiled function's static key); fields are checked on construction."""

  mosaic_forward_grid: str = "auto"
  """Mosaic forward grid: "persistent" (one CTA per SM taking (tile, head) items longest first;
  raises where it does not fit, head dim 256), "per_tile", or "auto" (persistent up to
  mosaic.backend.PERSISTENT_MAX_KV padded kv rows and where it fits)."""

  mosaic_forward_overlap_blocks: int = 16
  """Mosaic forward (also "hopper"'s), head dims up to 128: rows visiting at least this many kv
  blocks run the intra-warpgroup overlap, shorter ones the ping-pong. 0: ping-pong everywhere.
  Bitwise the same output."""

  mosaic_forward_registers: int = 240
  """Mosaic forward (also "hopper"'s): registers per consumer thread (setmaxnreg); the producer
  gets 504 - 2 x this. A multiple of 8 leaving the producer 24..256. Same output either way."""

  dq_after_dkv: bool = False
  """Mosaic and Triton, deterministic backward: run the dq kernel after the dk/dv kernel (same
  gradients), so context parallelism's dk / dv reduce-scatter can run behind it."""

  mosaic_backward_registers: int = 232
  """Mosaic backward: registers per consumer thread; the producer gets 504 - 2 x this. A
  multiple of 8 leaving the producer 24..256."""

  mosaic_paired_products: bool = True
  """Mosaic backward: issue two independent products together and await them once. False also
  runs the deterministic dk/dv step's products in their plain order."""

  mosaic_backward_id_rings: bool = False
  """Mosaic backward: TMA-load each ring block's positions and segment ids with it (helps
  packed documents, costs causal attention)."""

  triton_tiles: str = ""
  """Triton tiles taken exactly as given ("": the tuned ones): "fwd=BM,BN,warps,stages;dq=...;
  dkv=..." (any subset; tiles must divide the mask's blocks) and "gqa=inplace" / "gqa=perhead"."""

  def __post_init__(self):
    if self.mosaic_forward_grid not in FORWARD_GRIDS:
      raise ValueError(f"KernelOptions.mosaic_forward_grid={self.mosaic_forward_grid!r}: "
                       f"expected one of {FORWARD_GRIDS}")
    blocks = self.mosaic_forward_overlap_blocks
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
      raise ValueError(f"KernelOptions.mosaic_forward_overlap_blocks={blocks!r}: expected an "
                       "integer >= 0 (0: never overlap)")
    for name in ("dq_after_dkv", "mosaic_paired_products", "mosaic_backward_id_rings"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"KernelOptions.{name}={getattr(self, name)!r}: expected True or False")
    for name in ("mosaic_forward_registers", "mosaic_backward_registers"):
      producer_registers(getattr(self, name), f"KernelOptions.{name}")
    if not isinstance(self.triton_tiles, str):
      raise TypeError(f"KernelOptions.triton_tiles={self.triton_tiles!r}: expected a string "
                      '"fwd=BM,BN,warps,stages;dq=...;dkv=...;gqa=inplace|perhead" or ""')
    triton_tile_parts(self.triton_tiles)

  @property
  def mosaic_producer_registers(self) -> int:
    """504 - 2 x mosaic_backward_registers."""
    return producer_registers(self.mosaic_backward_registers)


def triton_tile_parts(tiles: str) -> dict[str, str]:
  """KernelOptions.triton_tiles as {"fwd": "BM,BN,warps,stages", ..., "gqa": "inplace"}; a
  malformed string is an error naming the field."""
  where = f"KernelOptions.triton_tiles={tiles!r}"
  parts = {}
  for part in filter(None, tiles.split(";")):
    key, sep, value = part.partition("=")
    if not sep or key not in TRITON_TILE_KEYS:
      raise ValueError(f"{where}: {part!r} is not KEY=VALUE with KEY one of {TRITON_TILE_KEYS}")
    if key == "gqa":
      if value not in ("inplace", "perhead"):
        raise ValueError(f"{where}: gqa={value!r}: expected inplace or perhead")
    else:
      fields = value.split(",")
      if len(fields) != 4 or not all(f.strip().isdigit() and int(f) > 0 for f in fields):
        raise ValueError(f"{where}: {key}={value!r}: expected four positive integers "
                         "BM,BN,warps,stages")
    parts[key] = value
  return parts


def kernel_options(options: KernelOptions | None) -> KernelOptions:
  """`options`, or the defaults for None; anything else is a TypeError naming the argument."""
  if options is None:
    return KernelOptions()
  if not isinstance(options, KernelOptions):
    raise TypeError(f"kernel_options must be a kvax_plugin.KernelOptions or None, got "
                    f"{type(options).__name__} {options!r}")
  return options
