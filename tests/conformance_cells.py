"""The conformance matrix: every configuration a kernel backend declares it runs, checked against
the float32 reference (issue "Correct on every configuration a backend accepts").

Nothing here lists what a backend supports. The cells come from the axes below (dtypes, head
dims, heads, batch, lengths, query modes, mask kinds, logit extras, block shapes, kvax options,
the backend's own options from its registry record) and each (backend, cell) is put to the
registry (kernels.supports_inputs: CAPABILITIES + mask_check), so a configuration a backend
starts to claim is exercised without anyone adding it here. A seeded covering design keeps the
product tractable: per backend, every value of every axis, plus pairs of the risky axes (block
shape x batch x heads x dtype, block shape x head dims, block shape x each backend option);
targets no accepted cell can reach get one refused cell each, which checks the refusal.

A cell accepted by the registry runs the public op (flash_attention(..., backend=name)) forward
and backward on fresh random inputs and must match the float32 reference: everything finite,
not all zero where the reference is not, relative L2 within the dtype's tolerance, no single
row far off, and rows with nothing to attend (padding included) exactly 0 in out / dq and kv
tokens nobody attends exactly 0 in dk / dv. A refused cell must raise BackendUnavailableError
naming the registry's reason (never a silent answer).

Cells sharing shapes and static settings differ only in data (layout and seed), so one compile
serves them all: the generator gives every compiled configuration (a "group") several layouts.

Sizes: "quick" (every axis value per backend; a few minutes on one H100), "full" (quick plus the
pairwise cover; run in parallel shards by scripts/test_gpu.sh), "cpu" (small shapes for the
backends that run on this machine: tests/test_conformance_cpu.py).

Command line (no GPU needed):
    python tests/conformance_cells.py count            # cells per backend, quick and full
    python tests/conformance_cells.py list full        # the cell ids
    python tests/conformance_cells.py merge OUT.json PART.jsonl... [--size S] [--part k/n]
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import os
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layouts  # noqa: E402  (tests/layouts.py: the shared layout generators)

# ----------------------------------------------------------------------------- axes

# kvax 0.1.0's block shapes (kvax/utils/common.py get_default_flash_attention_params: on an H100
# forward 128 x 128 and backward 64 x 128, 8 warps, 3 stages; elsewhere 64 x 64, 4 warps; its
# tests add forward 128 x 64) and ours (the library default, 128 x 64, 256 x 128). A name maps
# to (fwd, bwd) as (query block, kv block, warps, stages); None: the library default (no
# params passed, as most callers do).
BLOCKS: dict[str, tuple | None] = {
    "default": None,
    "kvax_h100": ((128, 128, 8, 3), (64, 128, 8, 3)),
    "kvax_64": ((64, 64, 4, 3), (64, 64, 4, 3)),
    "128x64": ((128, 64, 8, 3), (128, 64, 8, 3)),
    "256x128": ((256, 128, 8, 3), (256, 128, 8, 2)),
    # CPU profile only: blocks smaller than its short sequences, so they span several blocks.
    "16x32": ((16, 32, 4, 2), (16, 32, 4, 2)),
    "32x16": ((32, 16, 4, 2), (32, 16, 4, 2)),
}

# The values an option of a registry record (KernelBackend.options) takes in the matrix; the
# public op's keyword of the same name carries it. An option not listed runs at its default
# (None) only, and `count` says so.
OPTION_VALUES: dict[str, tuple] = {
    "deterministic_backward": (None, True, False),
    "memory_optimized_gqa_backward": (False, True),
}

MASKS = {  # name: (causal, sliding window)
    "causal": (True, None),
    "full": (False, None),
    "causal_window": (True, 97),
    "window": (False, 97),
}
LOGITS = {  # name: (soft cap, sinks)
    "plain": (None, False),
    "softcap": (3.0, False),  # small enough that tanh bends the logits (scale is 1/sqrt(d))
    "sinks": (None, True),
    "softcap_sinks": (3.0, True),
}
LAYOUTS = ("one_doc", "docs", "docs_huge_ids", "pad_tail", "pad_middle", "one_token_docs",
           "non_contiguous", "random_positions")

PROFILES: dict[str, dict[str, tuple]] = {
    "gpu": dict(
        dtype=("bfloat16", "float16", "float32"),
        # (qk, v): 16 is kvax 0.1.0's tests' head dim; 192 / 128 DeepSeek's MLA.
        dims=((64, 64), (128, 128), (256, 256), (192, 128), (16, 16)),
        # (query heads, kv heads): MHA at 1, 2, 8; MQA at 2, 8; GQA 4 at 8 and 32 query heads.
        heads=((1, 1), (2, 1), (2, 2), (8, 1), (8, 2), (8, 8), (32, 8)),
        batch=(1, 2, 3),
        # kv length: multiples of 128 and odd ones (kvax's tests use 384; 200 / 777 cut blocks)
        length=(128, 200, 384, 777, 1024),
        qmode=("self", "prefill", "decode"),
        mask=tuple(MASKS),
        logits=tuple(LOGITS),
        blocks=("default", "kvax_h100", "kvax_64", "128x64", "256x128"),
        skip_pad=(True, False),
    ),
    # Small shapes for the CPU (the same generator and checks, seconds per compile).
    "cpu": dict(
        dtype=("float32", "bfloat16", "float16"),
        dims=((16, 16), (32, 32), (32, 16)),
        heads=((1, 1), (2, 1), (4, 2)),
        batch=(1, 2),
        length=(64, 77),
        qmode=("self", "prefill", "decode"),
        mask=tuple(MASKS),
        logits=tuple(LOGITS),
        blocks=("default", "16x32", "32x16"),
        skip_pad=(True, False),
    ),
}

# Pairs of axes whose combinations are covered (full size): the block shape meets batch, heads,
# dtype (tile indexing, GQA grouping, tile sizes per dtype) and head dims (shared memory); dtype
# meets head dims (float32's head-dim limit, shared memory per element size).
RISKY_PAIRS = [("blocks", "batch"), ("blocks", "heads"), ("blocks", "dtype"), ("batch", "heads"),
               ("batch", "dtype"), ("heads", "dtype"), ("blocks", "dims"), ("dtype", "dims")]

# Relative L2 tolerances per dtype. The GPU tests' (tests/gpu/test_*_gpu.py: bf16 1.5e-2, fp16
# 4e-3, fp32 1e-4) passed there with errors of ~3e-3 (bf16) and ~4e-4 (fp16); the matrix sees
# more shapes (head dim 16, 32 heads, one-token rows), hence a little more room in 16 bits.
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-10}
# A single wrong row barely moves the relative L2 of a large tensor; each row's error, divided
# by the tensor's RMS row norm, must stay under this multiple of the tolerance.
ROW_FACTOR = 10.0

SIZES = ("quick", "full", "cpu")


# ----------------------------------------------------------------------------- cells


@dataclasses.dataclass(frozen=True)
class Cell:
  backend: str
  dtype: str
  dims: tuple[int, int]
  heads: tuple[int, int]
  batch: int
  length: int
  qmode: str
  mask: str
  logits: str
  blocks: str
  skip_pad: bool
  options: tuple[tuple[str, Any], ...]
  layout: str
  sizes: tuple[str, ...] = ()  # the sizes that contain it
  predicted: str = ""  # "accept" / "refuse": the registry's answer when generated
  reason: str = ""  # the registry's reason for a refusal
  group: int = 0  # cells of a group share shapes and statics (one compile)

  @property
  def q_len(self) -> int:
    return {"self": self.length, "prefill": max(1, self.length // 4), "decode": 1}[self.qmode]

  @property
  def id(self) -> str:
    dk, dv = self.dims
    h, kh = self.heads
    dims = f"d{dk}" if dk == dv else f"d{dk}v{dv}"
    opts = "".join(f"-{_OPTION_ABBREV.get(k, k)}{_short(v)}" for k, v in self.options)
    return (f"{self.backend}-{_DTYPE_ABBREV.get(self.dtype, self.dtype)}-{dims}-h{h}k{kh}"
            f"-b{self.batch}-q{self.q_len}kv{self.length}-{self.layout}-{self.mask}"
            f"-{self.logits}-{_blocks_id(self.blocks)}{'' if self.skip_pad else '-padvisit'}{opts}")


_DTYPE_ABBREV = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_OPTION_ABBREV = {"deterministic_backward": "det", "memory_optimized_gqa_backward": "memgqa"}


def _blocks_id(name: str) -> str:
  """"blkdefault", or the forward and backward blocks: "f128x128b64x128"."""
  if BLOCKS[name] is None:
    return "blk" + name
  (fq, fk, *_), (bq, bk, *_) = BLOCKS[name]
  return f"f{fq}x{fk}b{bq}x{bk}"


def _short(v) -> str:
  return {None: "None", True: "1", False: "0"}.get(v, str(v))


def block_params(name: str):
  """(fwd_params, bwd_params) FlashAttentionParamsConfig of a BLOCKS name (None, None: defaults)."""
  from kvax_plugin.attention.params import FlashAttentionParamsConfig
  spec = BLOCKS[name]
  if spec is None:
    return None, None
  return tuple(FlashAttentionParamsConfig(*p) for p in spec)


def features_of(cell: Cell) -> tuple[str, ...]:
  """kernels.FEATURES the call needs, as the public op computes them (plan.features), from
  shapes alone."""
  import jax
  from kvax_plugin.attention import plan
  dk, dv = cell.dims
  h, kh = cell.heads
  b, sq, skv = cell.batch, cell.q_len, cell.length
  q = jax.ShapeDtypeStruct((b, sq, h, dk), cell.dtype)
  k = jax.ShapeDtypeStruct((b, skv, kh, dk), cell.dtype)
  v = jax.ShapeDtypeStruct((b, skv, kh, dv), cell.dtype)
  cap, sinks = LOGITS[cell.logits]
  mask = _spec_only(cell)
  return plan.features(q, k, v, mask, cap, object() if sinks else None)


class _SpecOnly:
  """What the registry's mask checks read of a mask (its spec), without building the tables:
  the generator asks the registry about thousands of candidates. The test asks again with the
  real mask."""

  def __init__(self, spec):
    self.spec = spec
    self.has_backward = spec.bwd_params is not None


@functools.lru_cache(maxsize=None)
def _spec_only_cached(batch, q_len, kv_len, mask, blocks, skip_pad):
  from kvax_plugin.attention.block_mask import MaskSpec
  from kvax_plugin.attention.params import DEFAULT_BWD_PARAMS, DEFAULT_FWD_PARAMS
  fwd, bwd = block_params(blocks)
  causal, window = MASKS[mask]
  return _SpecOnly(MaskSpec(batch=batch, q_len=q_len, kv_len=kv_len, causal=causal,
                            sliding_window=window, skip_pad_tokens=skip_pad,
                            fwd_params=fwd or DEFAULT_FWD_PARAMS,
                            bwd_params=bwd or DEFAULT_BWD_PARAMS))


def _spec_only(cell: Cell) -> _SpecOnly:
  return _spec_only_cached(cell.batch, cell.q_len, cell.length, cell.mask, cell.blocks,
                           cell.skip_pad)


def registry_verdict(cell: Cell, mask=None) -> tuple[bool, str]:
  """(accepted, reason) from the registry for this cell (the real mask when given)."""
  from kvax_plugin.attention import kernels
  ok, why = kernels.supports_inputs(cell.backend, cell.dtype, cell.dims[0], cell.dims[1],
                                    features_of(cell), _spec_only(cell) if mask is None else mask)
  if ok:
    why = kernels.refuses_options(cell.backend,
                                  dict(cell.options).get("deterministic_backward"))
    ok = not why
  return ok, why


def matrix_backends() -> tuple[str, ...]:
  """Every registered kernel backend but the reference (it is what the others are checked
  against)."""
  from kvax_plugin.attention import kernels
  return tuple(n for n in kernels.KERNEL_BACKENDS if n != "reference")


def backend_option_axes(backend: str) -> dict[str, tuple]:
  """The registry record's options with values in OPTION_VALUES (the others run at their
  default; `count` lists them)."""
  from kvax_plugin.attention import kernels
  return {name: OPTION_VALUES[name] for name in kernels.KERNEL_BACKENDS[backend].options
          if name in OPTION_VALUES}


# ----------------------------------------------------------------------------- the cover


def _axes_for(backend: str, profile: str) -> dict[str, tuple]:
  axes = dict(PROFILES[profile])
  for name, values in backend_option_axes(backend).items():
    axes["opt:" + name] = values
  return axes


def _targets(axes: dict[str, tuple], pairs: Iterable[tuple[str, str]]) -> list[tuple]:
  """Singles ((axis, value),) for every value of every axis, and pairs of the named axes."""
  out = [((a, v),) for a, values in axes.items() for v in values]
  for a, b in pairs:
    if a in axes and b in axes:
      out += [((a, x), (b, y)) for x in axes[a] for y in axes[b]]
  return out


def _cell_from(backend: str, row: dict[str, Any], layout: str = "") -> Cell:
  options = tuple((k[4:], row[k]) for k in sorted(row) if k.startswith("opt:"))
  return Cell(backend=backend, dtype=row["dtype"], dims=tuple(row["dims"]),
              heads=tuple(row["heads"]), batch=row["batch"], length=row["length"],
              qmode=row["qmode"], mask=row["mask"], logits=row["logits"], blocks=row["blocks"],
              skip_pad=row["skip_pad"], options=options, layout=layout)


def _covers(row: dict[str, Any], target: tuple) -> bool:
  return all(row.get(a) == v for a, v in target)


def _accepts(backend: str, row: dict) -> bool:
  return registry_verdict(_cell_from(backend, row))[0]


def _base_row(backend: str, axes: dict[str, tuple], rng: np.random.Generator) -> dict:
  """A row the registry accepts: the first value of every axis, else the first of seeded
  random draws (a backend that accepts nothing gets the first row, refused)."""
  first = {a: values[0] for a, values in axes.items()}
  if _accepts(backend, first):
    return first
  for _ in range(5000):
    row = {a: values[rng.integers(len(values))] for a, values in axes.items()}
    if _accepts(backend, row):
      return row
  return first


def _cover(backend: str, axes: dict[str, tuple], targets: list[tuple], rng: np.random.Generator,
           rows: list[dict] | None = None, tries: int = 24):
  """AETG-style greedy cover: rows the registry accepts covering every reachable target.

  Starts from `rows` (already chosen: their targets count as covered). Candidates draw each
  free axis from the values the registry accepts next to a base row (most capabilities are
  per axis, so such candidates are mostly accepted; a backend's narrow corner is not found by
  blind draws), greedily towards the open targets. Returns (accepted rows, refused rows): a
  target no accepted candidate reached gets one refused row, the base row with the target's
  values (so the registry's reason names them), except a pair with a value that no accepted
  row holds at all (that value's own refused row shows it).
  """
  base = _base_row(backend, axes, rng)
  domain = {a: [v for v in values if _accepts(backend, dict(base, **{a: v}))] or list(values)
            for a, values in axes.items()}
  rows = list(rows or [])
  uncovered = [t for t in targets if not any(_covers(r, t) for r in rows)]
  order = {t: i for i, t in enumerate(uncovered)}
  open_targets = set(uncovered)
  by_value: dict[tuple, list[tuple]] = {}
  for t in uncovered:
    for av in t:
      by_value.setdefault(av, []).append(t)
  refused: list[dict] = []
  names = list(axes)

  def gain(row: dict, axis: str, value) -> int:
    trial = dict(row, **{axis: value})
    return sum(1 for t in by_value.get((axis, value), ()) if t in open_targets
               and all(trial.get(a, _MISSING) == v for a, v in t))

  while open_targets:
    target = min(open_targets, key=order.__getitem__)
    best, best_gain = None, -1
    candidates = []
    for attempt in range(tries):
      row = dict(target)
      free = [a for a in names if a not in row]
      rng.shuffle(free)
      wide = attempt >= tries * 3 // 4  # a few draws over every value (joint constraints)
      for axis in free:
        values = list(axes[axis] if wide else domain[axis])
        rng.shuffle(values)
        values.sort(key=lambda v, axis=axis: gain(row, axis, v), reverse=True)
        row[axis] = values[0]
      candidates.append(row)
    # The base row with the target's values last: on equal gain the drawn rows win (variety
    # in the axes no target asks for any more).
    candidates.append(dict(base, **dict(target)))
    for row in candidates:
      if not _accepts(backend, row):
        continue
      gained = sum(1 for t in open_targets if _covers(row, t))
      if gained > best_gain:
        best, best_gain = row, gained
    if best is None:
      open_targets.discard(target)
      held = all(any(r.get(a) == v for r in rows) for a, v in target)
      if len(target) == 1 or held:
        refused.append(dict(base, **dict(target)))
      continue
    rows.append(best)
    open_targets -= {t for t in open_targets if _covers(best, t)}
  return rows, refused


_MISSING = object()


def _seed_for(*parts) -> int:
  return zlib.crc32("/".join(map(str, parts)).encode())


def _assign_layouts(backend: str, rows: list[dict], per_group: int,
                    rng: np.random.Generator) -> list[list[str]]:
  """Layouts per row: each backend meets every layout, the least used first."""
  used = {name: 0 for name in LAYOUTS}
  out = []
  for _ in rows:
    names = list(LAYOUTS)
    rng.shuffle(names)
    names.sort(key=used.__getitem__)
    pick = names[:per_group]
    for name in pick:
      used[name] += 1
    out.append(pick)
  return out


# Cells that once failed, kept in the full matrix whatever the cover picks (it picks anew when
# a backend's capabilities change): (why, the configuration), run for every backend whose
# options allow it, each backend option at its first value.
REGRESSIONS: tuple[tuple[str, dict[str, Any], str], ...] = (
    # delta = rowsum(dO * O) reading the float32 cotangent where XLA drops its rounding to bf16
    # puts bf16's rounding into dk on one-key rows ("hopper" / "mosaic")
    ("delta read the unrounded cotangent",
     dict(dtype="bfloat16", dims=(128, 128), heads=(8, 1), batch=2, length=384, qmode="self",
          mask="full", logits="plain", blocks="default", skip_pad=False), "one_token_docs"),
)


def _regression_cells(backend: str) -> list[Cell]:
  """REGRESSIONS as cells of one backend (its options at their first value)."""
  options = {f"opt:{k}": v[0] for k, v in backend_option_axes(backend).items()}
  return [_cell_from(backend, {**row, **options}, layout) for _, row, layout in REGRESSIONS]


@functools.lru_cache(maxsize=None)
def _generate(size: str, seed: int, backends: tuple[str, ...]) -> tuple[Cell, ...]:
  profile = "cpu" if size == "cpu" else "gpu"
  cells: list[Cell] = []
  group = 0
  for backend in backends:
    axes = _axes_for(backend, profile)
    options = [a for a in axes if a.startswith("opt:")]
    # Every value of every axis, and each backend option with every block shape (Mosaic's
    # backward 64 x 128 in both backward modes, say).
    base = _targets(axes, [("blocks", o) for o in options])
    rng = np.random.default_rng(_seed_for(seed, backend, profile))
    quick_rows, quick_refused = _cover(backend, axes, base, rng)
    layers = [("quick" if size != "cpu" else "cpu", quick_rows, quick_refused)]
    if size == "full":
      pairs = [t for t in _targets(axes, RISKY_PAIRS) if len(t) == 2]
      rows, refused = _cover(backend, axes, pairs, rng, rows=quick_rows)
      # Refused pairs: one cell each shows the refusal; refused singles are in quick already.
      layers.append(("full", rows[len(quick_rows):], refused))
    per_group = {"quick": 2, "full": 2, "cpu": 2}
    lrng = np.random.default_rng(_seed_for(seed, backend, "layouts"))
    for tag, rows, refused in layers:
      sizes = ("quick", "full") if tag == "quick" else (tag,)
      for row, names in zip(rows, _assign_layouts(backend, rows, per_group[tag], lrng)):
        group += 1
        for name in names:
          cells.append(dataclasses.replace(_cell_from(backend, row, name), sizes=sizes,
                                           predicted="accept", group=group))
      for row in refused:
        group += 1
        # any layout (the registry's answer does not depend on it), the same in every size
        layout = LAYOUTS[_seed_for(backend, sorted(row.items(), key=str)) % len(LAYOUTS)]
        cell = _cell_from(backend, row, layout)
        _, why = registry_verdict(cell)
        cells.append(dataclasses.replace(cell, sizes=sizes, predicted="refuse", reason=why,
                                         group=group))
  if size == "full":
    for backend in backends:
      for cell in _regression_cells(backend):
        group += 1
        accepted, why = registry_verdict(cell)
        cells.append(dataclasses.replace(
            cell, sizes=("full",), predicted="accept" if accepted else "refuse",
            reason="" if accepted else why, group=group))
  # Duplicate ids (the same configuration and layout reached twice) run once.
  seen, unique = set(), []
  for cell in cells:
    if cell.id not in seen:
      seen.add(cell.id)
      unique.append(cell)
  return tuple(unique)


def generate(size: str = "quick", seed: int = 0,
             backends: Iterable[str] | None = None) -> list[Cell]:
  """The cells of a size ("quick", "full" (quick included) or "cpu"), for the given backends
  (default: every registered one but the reference). Deterministic for a seed; independent of
  the machine (what runs here is decided when a cell runs)."""
  if size not in SIZES:
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")
  backends = tuple(backends) if backends is not None else matrix_backends()
  return list(_generate(size, seed, backends))


def select(cells: list[Cell], part: str | None) -> list[Cell]:
  """The cells of part "k/n" (1-based): whole groups, balanced by their cost (an accepted
  group costs a compile, a refused one next to nothing)."""
  if not part:
    return cells
  k, n = (int(x) for x in part.split("/"))
  if not 1 <= k <= n:
    raise ValueError(f"part must be k/n with 1 <= k <= n, got {part!r}")
  groups: dict[int, list[Cell]] = {}
  for cell in cells:
    groups.setdefault(cell.group, []).append(cell)
  load = [0.0] * n
  keep = []
  for gid, members in groups.items():
    cost = (1.0 if members[0].predicted == "accept" else 0.05) + 0.1 * len(members)
    i = int(np.argmin(load))
    load[i] += cost
    if i == k - 1:
      keep += members
  return keep


# ----------------------------------------------------------------------------- layouts


def make_layout(cell: Cell, rng: np.random.Generator):
  """(q_pos, q_seg, kv_pos, kv_seg) int32 numpy [B, S]: the kv side from the layout, the query
  the last q_len tokens of it (prefill / decode)."""
  b, s = cell.batch, cell.length
  name = cell.layout
  if name == "one_doc":
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    seg = np.zeros((b, s), np.int32)
  elif name == "docs":
    pos, seg = layouts.packed_documents(rng, b, s, num_docs=int(rng.integers(3, 9)))
  elif name == "docs_huge_ids":
    pos, seg = layouts.packed_documents(rng, b, s, num_docs=4, pad_tail=s // 16, huge_ids=True)
  elif name == "pad_tail":
    pos, seg = layouts.packed_documents(rng, b, s, num_docs=3, pad_tail=s // 5 + 1)
  elif name == "pad_middle":
    pos, seg = layouts.packed_documents(rng, b, s, num_docs=4)
    start = int(rng.integers(s // 4, s // 2 + 1))
    stop = min(s - 1, start + max(1, s // 6))
    seg[:, start:stop] = -1
    pos[:, start:stop] = 0
  elif name == "one_token_docs":
    n = max(2, min(s, 3 + s // 16))
    pos, seg = layouts.packed_documents(rng, b, s, num_docs=n, one_token_docs=n - 2,
                                        pad_tail=min(3, s - n))
  elif name == "non_contiguous":
    pos, seg = layouts.non_contiguous_documents(rng, b, s, num_docs=3,
                                                chunk=int(rng.integers(7, 41)))
  elif name == "random_positions":
    pos, seg = layouts.random_positions(rng, b, s, num_docs=3)
  else:
    raise ValueError(f"unknown layout {name!r}")
  sq = cell.q_len
  if sq < s:
    # Prefill / decode: the queries are the newest tokens, so trailing padding moves to the
    # front (each token keeps its position and segment id).
    for row in range(b):
      tail = int(np.argmax(seg[row, ::-1] != -1)) if np.any(seg[row] != -1) else 0
      seg[row], pos[row] = np.roll(seg[row], tail), np.roll(pos[row], tail)
  return (pos[:, s - sq:].copy(), seg[:, s - sq:].copy(), pos.astype(np.int32),
          seg.astype(np.int32))


# ----------------------------------------------------------------------------- running a cell

# cell status values
PASSED, FAILED, REFUSED, REFUSED_LATE, UNAVAILABLE = ("passed", "failed", "refused",
                                                      "refused_late", "unavailable")


def _rel(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def _row_err(a, b, axis_rows: int, scale_rows=None) -> float:
  """max over rows of ||a_r - b_r||, over the RMS row norm of b (rows: the leading axes up to
  `axis_rows`, the rest flattened).

  scale_rows: a boolean mask over the leading two axes ([B, S]) of the rows that count in the
  RMS; None: all. Rows the mask forces to zero (tokens with nothing to attend, checked to be
  exactly zero apart from this) are left out of the scale: counted, they shrink it by the square
  root of their share. With one query against 384 one-token documents (Sq = 1), 383 of 384 dk
  rows are such zeros, and a bf16 rounding of 1% on the one real row reads as about 0.2 of the
  diluted scale.
  """
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  a = a.reshape(a.shape[:axis_rows + 1] + (-1,))
  b = b.reshape(b.shape[:axis_rows + 1] + (-1,))
  err = np.linalg.norm(a - b, axis=-1)
  norms2 = np.sum(b * b, axis=-1)
  if scale_rows is not None and np.any(scale_rows):
    norms2 = norms2[np.asarray(scale_rows, bool)]
  rms = np.sqrt(np.mean(norms2)) + 1e-30
  return float(err.max() / rms)


@functools.lru_cache(maxsize=None)
def _programs():
  """The jitted forward+backward of ours and of the reference, made once per process so that
  cells of one group (same shapes and statics) reuse their compiled programs."""
  import jax
  import jax.numpy as jnp
  from kvax_plugin.attention import kernels
  from kvax_plugin.attention.api import flash_attention
  from kvax_plugin.attention.reference import reference_attention

  def grads(fn, q, k, v, s, cot):
    def loss(q, k, v, s):
      return jnp.sum(fn(q, k, v, s).astype(jnp.float32) * cot)
    argnums = (0, 1, 2, 3) if s is not None else (0, 1, 2)
    return (fn(q, k, v, s),) + tuple(jax.grad(loss, argnums=argnums)(q, k, v, s))

  @functools.partial(jax.jit, static_argnames=("backend", "scale", "cap", "options", "direct"))
  def ours(q, k, v, s, cot, ints, mask, *, backend, scale, cap, options, direct):
    opts = dict(options)
    if direct is not None:
      # Interpreter runs on the CPU (no GPU for the registry's device check): the backend's
      # function with its interpreter switch, over inputs the public op validated (see
      # run_cell: the same call went through the op's checks first).
      fn = kernels.backend_function(backend)
      extra = dict(kernels.backend_options(backend, **opts))
      extra.update(dict(direct))
      call = lambda q, k, v, s: fn(q, k, v, *ints, mask, scale=scale, logits_soft_cap=cap,
                                   sinks=s, **extra)
    else:
      call = lambda q, k, v, s: flash_attention(q, k, v, *ints, mask, scale=scale,
                                                logits_soft_cap=cap, sinks=s, backend=backend,
                                                **opts)
    return grads(call, q, k, v, s, cot)

  @functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "cap"))
  def reference(q, k, v, s, cot, ints, *, causal, window, scale, cap):
    """(out, dq, dk, dv[, dsinks, dsinks_scale]): with sinks, dsinks_scale [H] is the sum of
    the magnitudes of dsinks' terms, sum over rows of p_sink |delta| (dsinks = -sum of
    p_sink delta; p_sink = 1 - the row's attention mass, delta = rowsum(dO O)). A sum is
    accurate relative to its terms, not to itself when they cancel: dsinks is checked against
    this (check_results)."""
    call = lambda q, k, v, s: reference_attention(q, k, v, *ints, causal=causal,
                                                  sliding_window=window, scale=scale,
                                                  logits_soft_cap=cap, sinks=s)
    results = grads(call, q, k, v, s, cot)
    if s is None:
      return results
    return results + (dsinks_terms(call, q, k, v, s, cot, results[0]),)

  return ours, reference


def dsinks_terms(attention, q, k, v, sinks, cot, out):
  """[H] the sum over rows of |p_sink delta|, the magnitudes of dsinks' terms (dsinks = -sum of
  p_sink delta): attention(q, k, v, sinks) is the float32 reference, out its output, cot the
  cotangent; p_sink = 1 - the row's attention mass (attention over values of ones), delta =
  rowsum(cot out)."""
  import jax.numpy as jnp
  p_sink = 1.0 - attention(q, k, jnp.ones_like(v), sinks)[..., 0]  # [B, Sq, H]
  delta = jnp.sum(cot * out, axis=-1)
  return jnp.sum(jnp.abs(p_sink * delta), axis=(0, 1))


def _inputs(cell: Cell, seed: int):
  """q, k, v (cell dtype), sinks (float32 [H] or None), cotangent (float32), drawn in NumPy and
  rounded there (ml_dtypes), so no device program is compiled for them."""
  import jax.numpy as jnp
  dk, dv = cell.dims
  h, kh = cell.heads
  b, sq, skv = cell.batch, cell.q_len, cell.length
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(cell.dtype)
  draw = lambda *shape: rng.standard_normal(shape, np.float32)
  q, k, v = (jnp.asarray(draw(*shape).astype(dtype))
             for shape in ((b, sq, h, dk), (b, skv, kh, dk), (b, skv, kh, dv)))
  cot = jnp.asarray(draw(b, sq, h, dv))
  s = jnp.asarray(draw(h)) if LOGITS[cell.logits][1] else None
  return q, k, v, s, cot


_TOOLCHAIN = ("/jax/", "/jaxlib/", "/triton/", "/jax_triton/", "/mlir/", "/numpy/")


def _explicit_refusal(tb) -> bool:
  """Whether an exception was raised by a backend's own Python code (a deliberate refusal
  that names its reason), not by a compiler or runtime underneath it."""
  frames = traceback.extract_tb(tb)
  if not frames:
    return False
  path = frames[-1].filename.replace(os.sep, "/")
  return "/kvax_plugin/" in path or not any(part in path for part in _TOOLCHAIN)


def run_cell(cell: Cell, seed: int = 0, direct: tuple | None = None) -> dict[str, Any]:
  """Check one cell; returns its record (status, errors, reason, seconds).

  direct: None (the public op), or run the backend's function itself with these extra keywords
  (e.g. (("interpret", True),) for the Mosaic interpreter on the CPU, () for none); the op's
  own checks still run on the same call first, and the registry's verdict is still required.
  """
  import jax
  import jax.numpy as jnp
  from kvax_plugin.attention import kernels
  from kvax_plugin.attention.api import create_attention_mask, flash_attention

  t0 = time.perf_counter()
  record: dict[str, Any] = dict(id=cell.id, backend=cell.backend, group=cell.group,
                                sizes=list(cell.sizes), predicted=cell.predicted,
                                cell=describe(cell), device=jax.devices()[0].device_kind)
  cell_seed = _seed_for(seed, cell.id)
  rng = np.random.default_rng(cell_seed)
  q_pos, q_seg, kv_pos, kv_seg = make_layout(cell, rng)
  ints = tuple(jnp.asarray(x, jnp.int32) for x in (q_pos, q_seg, kv_pos, kv_seg))
  causal, window = MASKS[cell.mask]
  cap, _ = LOGITS[cell.logits]
  fwd, bwd = block_params(cell.blocks)
  mask = create_attention_mask(*ints, fwd_params=fwd, bwd_params=bwd, calc_bwd_mask=True,
                               skip_pad_tokens=cell.skip_pad, causal=causal,
                               sliding_window=window)
  q, k, v, s, cot = _inputs(cell, cell_seed)
  scale = cell.dims[0] ** -0.5
  options = tuple(cell.options)

  def explicit_call():
    return flash_attention(q, k, v, *ints, mask, scale=scale, logits_soft_cap=cap, sinks=s,
                           backend=cell.backend, **dict(options))

  def expect_refusal(status: str, why: str) -> dict[str, Any]:
    record.update(status=status, reason=why)
    try:
      explicit_call()
    except kernels.BackendUnavailableError as e:
      if why and why not in str(e):
        record.update(status=FAILED, error=f"BackendUnavailableError does not name the "
                      f"registry's reason {why!r}: {e}")
      else:
        record["raised"] = str(e)
    except Exception as e:  # noqa: BLE001 - any other outcome is the failure reported
      record.update(status=FAILED, error=f"expected BackendUnavailableError ({why}), got "
                    f"{type(e).__name__}: {e}")
    else:
      record.update(status=FAILED, error=f"expected BackendUnavailableError ({why}); the "
                    "explicit request ran")
    record["seconds"] = round(time.perf_counter() - t0, 3)
    return record

  accepted, why = registry_verdict(cell, mask)
  record["accepted"] = accepted
  available, why_not_here = kernels.availability(cell.backend)
  if not available and direct is None:
    return expect_refusal(UNAVAILABLE, why_not_here)
  if not accepted:
    return expect_refusal(REFUSED, why)

  ours, reference = _programs()
  f32_products = cell.dtype == "float32"
  record["ran"] = True  # attempted: a crash below counts as a run that failed
  try:
    if direct is not None:
      # The public op's validation and the registry's choice on this very call (then the
      # backend's own function runs, with its interpreter switch).
      try:
        explicit_call()
      except kernels.BackendUnavailableError:
        pass  # no device here for the registry's check (the verdict above accepted the inputs)
    # XLA's default GPU precision for float32 products is TF32 (~1e-3): a float32 cell checks
    # float32 arithmetic, so XLA's products (the JAX backend's, the glue around kernels) run
    # at full precision, as a user who wants float32 accuracy sets it. The Triton / Mosaic
    # kernels choose their own precision either way.
    with jax.default_matmul_precision("highest" if f32_products else None):
      mine = ours(q, k, v, s, cot, ints, mask, backend=cell.backend, scale=scale, cap=cap,
                  options=options, direct=direct)
      mine = jax.device_get(mine)
  except (ValueError, NotImplementedError, kernels.BackendUnavailableError) as e:
    if _explicit_refusal(e.__traceback__):
      # The registry said yes and the backend then refused, naming why: not a wrong answer,
      # but a declaration that does not say all (recorded, listed in the report).
      record.update(status=REFUSED_LATE, reason=f"{type(e).__name__}: {e}",
                    seconds=round(time.perf_counter() - t0, 3))
      return record
    record.update(status=FAILED, error=_error_text(e), seconds=round(time.perf_counter() - t0, 3))
    return record
  except Exception as e:  # noqa: BLE001 - a crash in a cell the backend accepted is a failure
    record.update(status=FAILED, error=_error_text(e), seconds=round(time.perf_counter() - t0, 3))
    return record

  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    theirs = jax.device_get(reference(f32(q), f32(k), f32(v), f32(s), cot, ints, causal=causal,
                                      window=window, scale=scale, cap=cap))
  dsinks_scale = None
  if s is not None:
    theirs, dsinks_scale = theirs[:-1], theirs[-1]
  problems, errors = check_results(cell, mine, theirs, q_pos, q_seg, kv_pos, kv_seg,
                                   dsinks_scale=dsinks_scale)
  record.update(errors=errors, status=FAILED if problems else PASSED,
                seconds=round(time.perf_counter() - t0, 3))
  if problems:
    record["error"] = "; ".join(problems)
  return record


def describe(cell: Cell) -> dict[str, Any]:
  """The cell's settings, spelled out for the report."""
  fwd, bwd = BLOCKS[cell.blocks] or (None, None)
  causal, window = MASKS[cell.mask]
  cap, sinks = LOGITS[cell.logits]
  return dict(dtype=cell.dtype, qk_head_dim=cell.dims[0], v_head_dim=cell.dims[1],
              heads=cell.heads[0], kv_heads=cell.heads[1], batch=cell.batch, q_len=cell.q_len,
              kv_len=cell.length, qmode=cell.qmode, layout=cell.layout, causal=causal,
              sliding_window=window, logits_soft_cap=cap, sinks=sinks, blocks=cell.blocks,
              fwd_params=fwd, bwd_params=bwd, skip_pad_tokens=cell.skip_pad,
              options=dict(cell.options))


def _error_text(e: BaseException, limit: int = 1500) -> str:
  text = f"{type(e).__name__}: {e}"
  return text if len(text) <= limit else text[:limit] + " ..."


def check_results(cell: Cell, mine, theirs, q_pos, q_seg, kv_pos, kv_seg, dsinks_scale=None):
  """(problems, errors): the checks of one accepted cell. mine / theirs: (out, dq, dk, dv[,
  dsinks]) as numpy. dsinks_scale: None, or [H] the sum of the magnitudes of dsinks' terms
  (reference's): dsinks' error is then ||mine - theirs|| / ||dsinks_scale||. dsinks is a sum
  over all rows of terms of both signs; where they cancel (one query row, one head) the plain
  relative error measures the cancellation, not the kernel: on such fp16 cells it exceeds the
  1e-2 tolerance while out / dq / dk / dv are well within it."""
  names = ["out", "dq", "dk", "dv", "dsinks"][:len(theirs)]
  tol = TOLERANCE[cell.dtype]
  causal, window = MASKS[cell.mask]
  keep = layouts.dense_mask_np(q_pos, q_seg, kv_pos, kv_seg, causal=causal, window=window)
  q_empty = ~keep.any(axis=2)  # [B, Sq]: padding and rows with nothing to attend
  kv_unseen = ~keep.any(axis=1)  # [B, Skv]: kv tokens no query attends
  # A query that sees exactly one key has a constant softmax: dS = P (dP - delta) = 0, so its
  # dq, and the dk of keys only such queries see, are 0 in exact arithmetic, and the reference
  # is ~0 while ours holds the inputs' rounding (~1e-3 in bf16): no relative scale exists there
  # (relative L2 can reach ~1e28 on one-token documents at Sq = 1).
  # Those rows are checked absolutely (|x| < tol) and left out of the relative errors.
  single = keep.sum(axis=2) == 1  # [B, Sq]
  only_single = ~(keep & ~single[:, :, None]).any(axis=1) & ~kv_unseen  # [B, Skv]
  # (With sinks the sink's logit joins the denominator, the softmax is not constant: no
  # cancellation.)
  vanishing = {} if LOGITS[cell.logits][1] else {"dq": single, "dk": only_single}
  problems, errors = [], {}
  if len(mine) != len(theirs):
    return [f"{len(mine)} results, expected {len(theirs)}"], errors
  for name, a, b in zip(names, mine, theirs):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if a.shape != b.shape:
      problems.append(f"{name} shape {a.shape} != {b.shape}")
      continue
    if not np.all(np.isfinite(a)):
      problems.append(f"{name} has {int(np.sum(~np.isfinite(a)))} non-finite entries")
      continue
    zero_by_cancel = vanishing.get(name)
    if zero_by_cancel is not None and zero_by_cancel.any():
      worst = float(np.abs(a[zero_by_cancel]).max())
      errors[name + "_cancelled_max"] = float(f"{worst:.3e}")
      if worst >= tol:
        problems.append(f"{name} on rows that vanish by cancellation: max |x| {worst:.3e} >= "
                        f"{tol:g}")
      a, b = a.copy(), b.copy()
      a[zero_by_cancel] = 0.0
      b[zero_by_cancel] = 0.0
    if name == "dsinks" and dsinks_scale is not None:
      scale = float(np.linalg.norm(np.asarray(dsinks_scale, np.float32)))
      rel = float(np.linalg.norm(a - b)) / scale if scale > 0 else _rel(a, b)
      errors["dsinks_plain"] = float(f"{_rel(a, b):.3e}")
    else:
      rel = _rel(a, b)
    errors[name] = float(f"{rel:.3e}")
    zero_rows = {"out": q_empty, "dq": q_empty, "dk": kv_unseen, "dv": kv_unseen}.get(name)
    row = 0.0
    if a.ndim == 4:  # per (token, head) row
      forced_zero = np.zeros(a.shape[:2], bool) if zero_rows is None else zero_rows.copy()
      if zero_by_cancel is not None:
        forced_zero |= zero_by_cancel
      row = _row_err(a, b, 2, scale_rows=~forced_zero)
      errors[name + "_row"] = float(f"{row:.3e}")
    if np.any(b != 0) and not np.any(a != 0):
      problems.append(f"{name} is all zero (the reference is not)")
    elif rel >= tol:
      problems.append(f"{name} relative L2 {rel:.3e} >= {tol:g}")
    elif row >= ROW_FACTOR * tol:
      problems.append(f"{name} worst row {row:.3e} of the RMS row norm >= {ROW_FACTOR * tol:g}")
    if zero_rows is not None and zero_rows.any():
      bad = np.abs(a[zero_rows]).max()
      if bad != 0:
        pad = (q_seg if name in ("out", "dq") else kv_seg) == -1
        where = "padding" if np.abs(a[zero_rows & pad]).max(initial=0) != 0 else "no-pair"
        problems.append(f"{name} not exactly 0 on {where} rows (max |x| {bad:.3e})")
  return problems, errors


# ----------------------------------------------------------------------------- reports

STATUSES = (PASSED, FAILED, REFUSED, REFUSED_LATE, UNAVAILABLE, "not_run")


def environment() -> dict[str, Any]:
  """Date, device and library versions of this process."""
  info: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")}
  try:
    import jax
    info["jax"] = jax.__version__
    import jaxlib
    info["jaxlib"] = jaxlib.__version__
    devices = jax.devices()
    info["platform"] = devices[0].platform
    info["device"] = devices[0].device_kind
    info["device_count"] = len(devices)
  except Exception as e:  # noqa: BLE001 - the report says what it could not learn
    info["device"] = f"unknown ({type(e).__name__}: {e})"
  for module in ("triton", "jax_triton"):
    try:
      info[module] = __import__(module).__version__
    except Exception as e:  # noqa: BLE001
      info[module] = f"not importable ({type(e).__name__})"
  try:
    from kvax_plugin.attention import kernels
    info["availability"] = {n: list(kernels.availability(n)) for n in matrix_backends()}
  except Exception as e:  # noqa: BLE001
    info["availability"] = f"unknown ({type(e).__name__}: {e})"
  return info


def report(records: list[dict], expected: list[Cell] | None = None,
           extra: dict | None = None) -> dict[str, Any]:
  """The machine-readable result: environment, per-backend counts, failing cells, the cells
  the registry accepted and the backend then refused, and every record."""
  records = list(records)
  if expected is not None:
    seen = {r["id"] for r in records}
    records += [dict(id=c.id, backend=c.backend, group=c.group, sizes=list(c.sizes),
                     predicted=c.predicted, status="not_run") for c in expected
                if c.id not in seen]
  counts: dict[str, dict[str, int]] = {}
  for r in records:
    c = counts.setdefault(r["backend"], {s: 0 for s in ("cells", "run") + STATUSES})
    c["cells"] += 1
    c[r["status"]] += 1
    c["run"] += bool(r.get("ran")) and r["status"] in (PASSED, FAILED)
  out = dict(environment(), **(extra or {}))
  # the devices the cells ran on (a report merged elsewhere describes that machine above)
  out["cell_devices"] = sorted({r["device"] for r in records if r.get("device")})
  out.update(
      counts=counts,
      failures=[{k: r.get(k) for k in ("id", "error", "errors", "seconds")}
                for r in records if r["status"] == FAILED],
      refused_late=[{"id": r["id"], "reason": r.get("reason")} for r in records
                    if r["status"] == REFUSED_LATE],
      not_run=[r["id"] for r in records if r["status"] == "not_run"],
      # the registry's answer with the real mask differs from the one the generator got
      registry_mismatch=[r["id"] for r in records if "accepted" in r
                         and r["accepted"] != (r.get("predicted") == "accept")],
      cells=records)
  return out


def read_records(paths: Iterable[str]) -> list[dict]:
  records = []
  for path in paths:
    p = Path(path)
    if not p.exists():
      continue
    for line in p.read_text().splitlines():
      if line.strip():
        records.append(json.loads(line))
  return records


def summary_lines(rep: dict[str, Any]) -> list[str]:
  lines = [f"{rep.get('device')} jax {rep.get('jax')} triton {rep.get('triton')} "
           f"jax_triton {rep.get('jax_triton')}"]
  for backend, c in rep["counts"].items():
    lines.append(f"  {backend:8s} cells {c['cells']:4d}  run {c['run']:4d}  passed "
                 f"{c['passed']:4d}  failed {c['failed']:3d}  refused {c['refused']:4d}  "
                 f"refused_late {c['refused_late']:3d}  unavailable {c['unavailable']:4d}  "
                 f"not_run {c['not_run']:3d}")
  late: dict[tuple, int] = {}
  for r in rep["refused_late"]:
    key = (r["id"].split("-")[0], (r["reason"] or "")[:160])
    late[key] = late.get(key, 0) + 1
  for (backend, reason), n in sorted(late.items()):
    lines.append(f"  refused_late x{n} {backend}: {reason}")
  if rep.get("registry_mismatch"):
    lines.append(f"  registry answers that differ from the generator's: "
                 f"{len(rep['registry_mismatch'])} cells")
  for f in rep["failures"]:
    lines.append(f"  FAILED {f['id']}: {f['error']}")
  return lines


# ----------------------------------------------------------------------------- command line


def _counts(cells: list[Cell]) -> dict[str, dict[str, int]]:
  out: dict[str, dict[str, int]] = {}
  for c in cells:
    d = out.setdefault(c.backend, {"cells": 0, "accept": 0, "refuse": 0, "groups": 0})
    d["cells"] += 1
    d[c.predicted] += 1
  for backend in out:
    out[backend]["groups"] = len({c.group for c in cells
                                  if c.backend == backend and c.predicted == "accept"})
  return out


def main(argv: list[str]) -> int:
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("count", help="cells per backend (what the registry accepts / refuses)")
  p.add_argument("sizes", nargs="*", default=["quick", "full"])
  p.add_argument("--seed", type=int, default=0)
  p = sub.add_parser("list", help="the cell ids of a size")
  p.add_argument("size")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--part", default=None)
  p = sub.add_parser("merge", help="records (jsonl) -> the report (json)")
  p.add_argument("out")
  p.add_argument("parts", nargs="*")
  p.add_argument("--size", default=None, help="mark the cells of this size not run as not_run")
  p.add_argument("--part", default=None)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--extra", default=None, help="a JSON file merged into the report")
  args = parser.parse_args(argv)
  if args.cmd == "count":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # counting needs no device
    for size in args.sizes:
      cells = generate(size, args.seed)
      print(f"{size}: {len(cells)} cells")
      for backend, d in _counts(cells).items():
        print(f"  {backend:8s} {d['cells']:4d} cells: {d['accept']:4d} accepted by the registry "
              f"in {d['groups']:3d} compiled groups, {d['refuse']:3d} refused")
    from kvax_plugin.attention import kernels
    for backend in matrix_backends():
      missing = [n for n in kernels.KERNEL_BACKENDS[backend].options if n not in OPTION_VALUES]
      if missing:
        print(f"note: {backend} options {missing} run at their default only (OPTION_VALUES)")
    return 0
  if args.cmd == "list":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for c in select(generate(args.size, args.seed), args.part):
      print(f"{c.id}  [{c.predicted}{': ' + c.reason if c.reason else ''}]")
    return 0
  if args.cmd == "merge":
    expected = select(generate(args.size, args.seed), args.part) if args.size else None
    extra = json.loads(Path(args.extra).read_text()) if args.extra else None
    rep = report(read_records(args.parts), expected, extra)
    Path(args.out).write_text(json.dumps(rep, indent=1, default=str))
    print("\n".join(summary_lines(rep)))
    return 1 if rep["failures"] else 0
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
