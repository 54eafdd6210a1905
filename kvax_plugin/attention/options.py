"""The kernels' tuning options, and the environment variables kvax reads.

Each tunable backend has one frozen, validated config (MosaicOptions, HopperOptions,
TritonOptions); KernelOptions is their flat form, so one object serves whichever backend "auto"
picks. No environment variable tunes a kernel. This table is all of them (tests/test_options.py):

    KVAX_CHECK_MASK_INPUTS    attention/validation.py: 1 makes every flash_attention call
                              check its mask against its positions / segment ids.
    KVAX_FEED_MASK_STATS      integrations/maxtext/training_hooks.py: 0 skips the packed-corpus
                              feeder's per-batch blocks-skipped report.
    KVAX_LEVANTER_BACKEND     integrations/levanter/settings.py: Levanter's kvax backend where
                              configure() was not called.
    KVAX_LEVANTER_BLOCK_SIZE  integrations/levanter/settings.py: the block size of both passes.

Names that look alike (KVAX_PATCHED, KVAX_SM90_VARIANTS, KVAX_PROVIDER, ...) are not variables.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

FORWARD_GRIDS = ("auto", "persistent", "per_tile")
HOPPER_BACKWARDS = ("cuda", "by_mask")
TRITON_TILE_KEYS = ("fwd", "dq", "dkv", "gqa")


def producer_registers(consumer_registers, name: str = "consumer_registers") -> int:
  """504 - 2 x consumer_registers; ValueError naming `name` unless a multiple of 8 leaving the
  producer 24..256."""
  regs = consumer_registers
  if (isinstance(regs, bool) or not isinstance(regs, int) or regs % 8 or regs > 256
      or not 24 <= 504 - 2 * regs <= 256):
    raise ValueError(f"{name}={regs!r}: expected a multiple of 8 that leaves the producer "
                     "24..256 registers (504 - 2 x it), e.g. 232 or 240")
  return 504 - 2 * regs


@dataclasses.dataclass(frozen=True)
class KernelOptions:
  """Tuning options of the kernel backends (hashable: part of the static key); checked on init."""

  mosaic_forward_grid: str = "auto"
  """Mosaic forward grid: "persistent" (one CTA per SM taking (tile, head) items longest first;
  raises where it does not fit, head dim 256), "per_tile", or "auto" (persistent up to
  mosaic.backend.PERSISTENT_MAX_KV padded kv rows and where it fits)."""

  mosaic_forward_overlap_blocks: int | None = None
  """Mosaic forward (also "hopper"'s), head dims up to 128: rows visiting at least this many kv
  blocks run the intra-warpgroup overlap, shorter ones the ping-pong. 1: every row that visits a
  block overlaps; 0: ping-pong everywhere; None: 1 where that was timed faster (head dims
  128 / 128 without a soft cap, window or sinks: mosaic.backend.overlap_min_blocks), else 16.
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

  hopper_backward: str | None = None
  """"hopper": its backward. "cuda": the CUDA C++ fused backward; "by_mask": per call, the CUDA
  or the Mosaic backward from the mask's share of partly kept blocks (the measured table
  kernels/backward_choice.json). None: "cuda" when backend="hopper" is asked for, "by_mask" when
  "auto" takes it."""

  triton_tiles: str = ""
  """Triton tiles taken exactly as given ("": the tuned ones): "fwd=BM,BN,warps,stages;dq=...;
  dkv=..." (any subset; tiles must divide the mask's blocks) and "gqa=inplace" / "gqa=perhead"."""

  def __post_init__(self):
    _check_fields(self, "KernelOptions", {name: name for name in _field_names(KernelOptions)})

  @property
  def mosaic_producer_registers(self) -> int:
    """504 - 2 x mosaic_backward_registers."""
    return producer_registers(self.mosaic_backward_registers)

  def for_backend(self, name: str):
    """Backend `name`'s typed config (None for "jax", "reference"); memory_optimized_gqa_backward
    is left to flash_attention's keyword."""
    cls = _options_class(name)
    if cls is None:
      return None
    return cls(**{own: getattr(self, flat) for own, flat in cls.FLAT.items()})

  @classmethod
  def from_backends(cls, *configs) -> "KernelOptions":
    """The flat options holding `configs` (at most one per backend; unset fields keep defaults).
    ValueError: a shared field given two values, or memory_optimized_gqa_backward=True."""
    fields: dict[str, Any] = {}
    source: dict[str, str] = {}
    seen = set()
    for config in configs:
      if type(config) not in BACKEND_OPTIONS.values():
        raise TypeError(f"KernelOptions.from_backends takes {_config_names()}, got "
                        f"{type(config).__name__} {config!r}")
      if type(config) in seen:
        raise ValueError(f"KernelOptions.from_backends: two {type(config).__name__}")
      seen.add(type(config))
      if isinstance(config, TritonOptions) and config.memory_optimized_gqa_backward:
        raise ValueError("TritonOptions.memory_optimized_gqa_backward=True has no KernelOptions "
                         "field: pass memory_optimized_gqa_backward=True to flash_attention, or "
                         "pass the TritonOptions itself as kernel_options")
      where = type(config).__name__
      for own, flat in type(config).FLAT.items():
        value = getattr(config, own)
        if flat in fields and fields[flat] != value:
          raise ValueError(f"KernelOptions.from_backends: {source[flat]}={fields[flat]!r} and "
                           f"{where}.{own}={value!r} set one field, KernelOptions.{flat}")
        fields[flat], source[flat] = value, f"{where}.{own}"
    return cls(**fields)


def _field_names(cls) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls))


def _check_fields(config, where: str, names: dict[str, str]) -> None:
  """Check `config`'s fields `names` (own -> KernelOptions field whose rule applies)."""
  for own, flat in names.items():
    value, field = getattr(config, own), f"{where}.{own}"
    if flat == "mosaic_forward_grid":
      if value not in FORWARD_GRIDS:
        raise ValueError(f"{field}={value!r}: expected one of {FORWARD_GRIDS}")
    elif flat == "mosaic_forward_overlap_blocks":
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 0):
        raise ValueError(f"{field}={value!r}: expected None (the measured default) or an "
                         "integer >= 0 (0: never overlap)")
    elif flat in ("mosaic_forward_registers", "mosaic_backward_registers"):
      producer_registers(value, field)
    elif flat == "hopper_backward":
      if value is not None and value not in HOPPER_BACKWARDS:
        raise ValueError(f"{field}={value!r}: expected one of {HOPPER_BACKWARDS} or None")
    elif flat == "triton_tiles":
      if not isinstance(value, str):
        raise TypeError(f"{field}={value!r}: expected a string "
                        '"fwd=BM,BN,warps,stages;dq=...;dkv=...;gqa=inplace|perhead" or ""')
      triton_tile_parts(value, field)
    elif not isinstance(value, bool):  # the flags
      raise TypeError(f"{field}={value!r}: expected True or False")


@dataclasses.dataclass(frozen=True)
class MosaicOptions:
  """The "mosaic" backend's tuning: KernelOptions' fields (FLAT maps them), documented there."""

  FLAT: ClassVar[dict[str, str]] = {
      "forward_grid": "mosaic_forward_grid",
      "forward_overlap_blocks": "mosaic_forward_overlap_blocks",
      "forward_registers": "mosaic_forward_registers",
      "backward_registers": "mosaic_backward_registers",
      "paired_products": "mosaic_paired_products",
      "backward_id_rings": "mosaic_backward_id_rings",
      "dq_after_dkv": "dq_after_dkv"}

  forward_grid: str = "auto"
  forward_overlap_blocks: int | None = None
  forward_registers: int = 240
  backward_registers: int = 232
  paired_products: bool = True
  backward_id_rings: bool = False
  dq_after_dkv: bool = False

  def __post_init__(self):
    _check_fields(self, "MosaicOptions", self.FLAT)


@dataclasses.dataclass(frozen=True)
class HopperOptions:
  """The "hopper" backend's tuning: MosaicOptions' forward fields and which backward runs."""

  FLAT: ClassVar[dict[str, str]] = {
      "forward_grid": "mosaic_forward_grid",
      "forward_overlap_blocks": "mosaic_forward_overlap_blocks",
      "forward_registers": "mosaic_forward_registers",
      "backward": "hopper_backward"}

  forward_grid: str = "auto"
  forward_overlap_blocks: int | None = None
  forward_registers: int = 240
  backward: str | None = None

  def __post_init__(self):
    _check_fields(self, "HopperOptions", self.FLAT)

  def mosaic_forward(self) -> MosaicOptions:
    """The MosaicOptions its Mosaic forward runs with."""
    return MosaicOptions(forward_grid=self.forward_grid,
                         forward_overlap_blocks=self.forward_overlap_blocks,
                         forward_registers=self.forward_registers)


@dataclasses.dataclass(frozen=True)
class TritonOptions:
  """The "triton" backend's tuning: KernelOptions' fields (FLAT), and
  memory_optimized_gqa_backward (flash_attention's keyword of that name)."""

  FLAT: ClassVar[dict[str, str]] = {"tiles": "triton_tiles", "dq_after_dkv": "dq_after_dkv"}

  tiles: str = ""
  dq_after_dkv: bool = False
  memory_optimized_gqa_backward: bool = False

  def __post_init__(self):
    _check_fields(self, "TritonOptions",
                  dict(self.FLAT, memory_optimized_gqa_backward="memory_optimized_gqa_backward"))


# "jax" and "reference" take no config.
BACKEND_OPTIONS: dict[str, type] = {"mosaic": MosaicOptions, "hopper": HopperOptions,
                                    "triton": TritonOptions}


def _config_names() -> str:
  return ", ".join(c.__name__ for c in BACKEND_OPTIONS.values())


def _options_class(name: str):
  from_name = BACKEND_OPTIONS.get(name)
  if from_name is None and name not in ("jax", "reference"):
    raise ValueError(f"no kernel backend {name!r}: expected one of "
                     f"{tuple(BACKEND_OPTIONS) + ('jax', 'reference')}")
  return from_name


def triton_tile_parts(tiles: str, name: str = "KernelOptions.triton_tiles") -> dict[str, str]:
  """triton_tiles as {"fwd": "BM,BN,warps,stages", ..., "gqa": "inplace"}; malformed: ValueError
  naming `name`."""
  where = f"{name}={tiles!r}"
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


def kernel_options(options):
  """`options` checked: a KernelOptions, a per-backend config or a tuple of them (one per
  backend); None: KernelOptions(). Anything else: TypeError."""
  if options is None:
    return KernelOptions()
  configs = tuple(BACKEND_OPTIONS.values())
  if isinstance(options, (KernelOptions,) + configs):
    return options
  if (isinstance(options, tuple) and all(type(o) in configs for o in options)
      and len({type(o) for o in options}) == len(options)):
    return options
  raise TypeError(f"kernel_options must be a kvax_plugin.KernelOptions, a per-backend config "
                  f"({_config_names()}), a tuple of per-backend configs (one per backend) or "
                  f"None, got {type(options).__name__} {options!r}")


def backend_config(options, name: str, *, memory_optimized_gqa_backward: bool = False):
  """Backend `name`'s config from kernel_options: KernelOptions.for_backend, the matching
  per-backend config or its defaults; None without tuning. memory_optimized_gqa_backward sets
  the Triton field."""
  options = kernel_options(options)
  cls = _options_class(name)
  if cls is None:
    return None
  if isinstance(options, KernelOptions):
    config = options.for_backend(name)
  else:
    config = next((o for o in (options if isinstance(options, tuple) else (options,))
                   if type(o) is cls), None) or cls()
  if memory_optimized_gqa_backward and cls is TritonOptions:
    config = dataclasses.replace(config, memory_optimized_gqa_backward=True)
  return config
