"""The kernels' tuning options (`KernelOptions`), and the environment variables kvax reads.

Every tuning choice a caller may change lives in `KernelOptions`, passed as
`flash_attention(..., kernel_options=KernelOptions(...))` (None: the defaults). The defaults
are what the measurements in docs/performance.md chose; each field's docstring gives the
numbers. Options of one backend are ignored by the others (like memory_optimized_gqa_backward),
so one object can serve a whole model whichever backend "auto" picks. Switches that were
measured and settled are no longer options: docs/tuning-history.md lists them.

Environment variables. kvax reads no environment variable that tunes a kernel. The ones it
does read pass settings into a stack whose configuration kvax does not own (Levanter's parser
rejects unknown keys) or turn on checks and reports. This table is all of them
(tests/test_options.py compares it with the reads in kvax_plugin/):

    KVAX_CHECK_MASK_INPUTS    attention/validation.py: 1 makes every flash_attention call
                              check that its mask was built from its positions / segment ids
                              (raises on a mismatch; results unchanged).
    KVAX_FEED_MASK_STATS      integrations/maxtext/training_hooks.py: 0 makes the launcher's
                              packed-corpus feeder skip its per-batch blocks-skipped report
                              (1, the default, builds it; results unchanged).
    KVAX_LEVANTER_BACKEND     integrations/levanter/settings.py: Levanter's kvax kernel backend
                              where configure() was not called (Levanter's config parser
                              rejects unknown keys).
    KVAX_LEVANTER_BLOCK_SIZE  integrations/levanter/settings.py: the block size of both passes
                              there (a launch detail; the float32 summation order, hence the
                              rounding, follows it).

Names that look alike but are not environment variables: KVAX_PATCHED (an attribute the MaxText
patch sets on its attention module), KVAX_SM90_VARIANTS (a macro of the CUDA source), and the
Python constants KVAX_PROVIDER, KVAX_CONFIG_FIELDS, KVAX_KEYS, KVAX_BACKENDS,
KVAX_PADDING_SEGMENT_ID.
"""

from __future__ import annotations

import dataclasses

FORWARD_GRIDS = ("auto", "persistent", "per_tile")
TRITON_TILE_KEYS = ("fwd", "dq", "dkv", "gqa")


def producer_registers(consumer_registers, name: str = "consumer_registers") -> int:
  """The producer warpgroup's registers per thread in the Mosaic kernels' CTA (two consumer
  warpgroups and a producer, launched with 168 each: 504 to share) when both consumers take
  `consumer_registers` (setmaxnreg): 504 - 2 x it. ValueError naming `name` unless that is an
  int, a multiple of 8 and leaves the producer 24..256."""
  regs = consumer_registers
  if (isinstance(regs, bool) or not isinstance(regs, int) or regs % 8 or regs > 256
      or not 24 <= 504 - 2 * regs <= 256):
    raise ValueError(f"{name}={regs!r}: expected a multiple of 8 that leaves the producer "
                     "24..256 registers (504 - 2 x it), e.g. 232 or 240")
  return 504 - 2 * regs


@dataclasses.dataclass(frozen=True)
class KernelOptions:
  """Tuning options of the kernel backends; every default is the measured choice.

  Hashable (it is part of the compiled function's static key): a changed option means a new
  trace, never a stale compiled kernel. Fields are checked when the object is made.
  """

  mosaic_forward_grid: str = "auto"
  """Mosaic: the forward kernel's grid. "persistent": one CTA per SM, each taking (tile, head)
  items dealt longest first as a snake draft, the next item's Q and K / V loaded behind the
  current one; "per_tile": one CTA per (batch, query tile, head). "auto": persistent up to
  mosaic.backend.PERSISTENT_MAX_KV (65536) padded kv rows, per-tile above, and per-tile where
  the persistent kernel's second Q buffer would cost the kv tile (MLA 192 / 128). Measured on an
  H200 (2026-11-24, persistent vs per-tile, ms): documents forward 16k 0.778 vs 0.835, 64k 9.64
  vs 9.83, 128k 28.9 vs 29.7; causal 128k 268.4 vs 236.6 (per-tile 13% faster); 64k causal
  flips between two modes either way; MLA 64k causal 88.4 vs 70.9 (2026-11-24). Left open: a
  persistent kernel holds every SM until its last item, so a collective launched beside it
  (context parallelism's k / v exchange) may prefer "per_tile". "persistent" where its shared
  memory does not fit (head dim 256) raises."""

  mosaic_forward_overlap_blocks: int = 16
  """Mosaic forward (also "hopper"'s), head dims up to 128: a query tile whose table row visits
  at least this many kv blocks (of the kernel's kv tile, 128 rows at these head dims) runs
  FlashAttention-3's intra-warpgroup overlap: each consumer issues Q K^T of a block and P V of
  the previous one back to back and computes the block's softmax while P V runs. Shorter rows
  run the two consumers' ping-pong (one's softmax under the other's products), which costs less
  on a row of few blocks. 0: the ping-pong everywhere. Both give bitwise the same output.
  Measured on an H200 (2026-11-28, forward ms, same run; docs/performance.md, "late
  morning"): this default / 0 / 1 / tokamax Mosaic, causal 16k 3.65 / 3.79 / 3.67 / 3.77, 64k
  58.59 / 61.38 / 59.17 / 59.40; 12 documents 16k 0.81 / 0.80 / 0.83 / 0.82, 64k 9.84 / 9.94 /
  9.88 / 9.95."""

  mosaic_forward_registers: int = 240
  """Mosaic forward (also "hopper"'s): registers per thread of the two consumer warpgroups
  (setmaxnreg); the producer gets 504 - 2 x this (240 -> 24, FlashAttention 3's split; 232 ->
  40). A multiple of 8 leaving the producer 24..256. At 240 the overlapped kernels spill 4-20
  bytes instead of 96-116, with bitwise the same output. Measured on an H200 (2026-11-28,
  forward ms, 240 / 232 / tokamax Mosaic, same run; docs/performance.md, "afternoon"): causal
  16k 3.79 / 3.70 / 3.79, 64k 57.30 / 58.86 / 60.01; 12 documents 16k 0.78 / 0.81 / 0.81, 64k
  9.53 / 9.83 / 9.91. 232 is faster on short causal rows (16k causal 2-7% in two runs)."""

  dq_after_dkv: bool = False
  """Mosaic and Triton, deterministic backward: run the dq kernel after the dk/dv kernel (its
  query input passes a barrier with dk / dv) instead of before. Same gradients. Meant for
  context parallelism, where the dk / dv reduce-scatter (2.04 ms at 128k on 2 x H200,
  2026-11-23) could then run behind the dq kernel; not yet measured on GPUs."""

  mosaic_backward_registers: int = 232
  """Mosaic backward: registers per thread of the two consumer warpgroups (setmaxnreg); the
  producer gets 504 - 2 x this (232 -> 40, 240 -> 24, FlashAttention 3's split). A multiple of
  8 leaving the producer 24..256. 240 measured (2026-11-23, H200, 64k causal, kernels alone,
  ms): dk/dv 111.7 vs 111.8, dq 76.9 vs 76.6, fused dk/dv + dq 201.5 vs 209.3; 2026-11-25 (H100,
  16k fwd+bwd): causal 15.54 vs 15.90, documents 3.896 vs 3.748. Mixed: the default stays."""

  mosaic_paired_products: bool = True
  """Mosaic backward: issue two independent matrix products together and await them once (one
  wgmma wait for two). False awaits each alone; the deterministic dk/dv kernel's two-pair step
  needs pairing, so False also runs its products in their plain order. Measured on an H200:
  the fused backward (deterministic_backward=False) was faster unpaired, 16k fwd+bwd 16.84 vs
  17.77 ms (2026-11-23, called noise then) and 64k kernel alone at 240 registers 197.8 vs 201.5
  (2026-11-23); the deterministic default was timed paired only."""

  mosaic_backward_id_rings: bool = False
  """Mosaic backward: the producers TMA-load each ring block's positions and segment ids with it
  (q blocks in the dk/dv kernel, kv blocks in the dq kernel), so masked steps read them from
  shared memory instead of global memory. Measured with the forward's twin (removed: no change)
  on an H200 (2026-11-24, 64k fwd+bwd, interleaved, ms): documents 41.46 vs 43.26 (alone 41.61
  vs 42.57), causal 253.4 vs 249.2 (the producer copies ids for every block, masked or not).
  Off: it helps packed documents and costs causal attention."""

  triton_tiles: str = ""
  """Triton: the kernels' tiles, taken exactly as given instead of the tuned per-GPU choice:
  "fwd=BM,BN,warps,stages;dq=...;dkv=..." (any subset; tiles must divide the mask's blocks),
  and "gqa=inplace" / "gqa=perhead" for the dk/dv launch's GQA accumulation. "" (default): the
  tuned tiles (triton.backend._tuned, from the sweeps in docs/performance.md). The format
  triton.backend.autotune_tiles returns its winner in."""

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
    triton_tile_parts(self.triton_tiles)  # the format, checked now rather than at trace time

  @property
  def mosaic_producer_registers(self) -> int:
    """The Mosaic backward's producer registers (504 - 2 x mosaic_backward_registers); the
    forward's producer gets 504 - 2 x mosaic_forward_registers."""
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
