"""What ptxas does with a kernel's setmaxnreg register split, tried offline on its PTX.

    python -m benchmarks.tools.ptxas_splits --ptx dump/entry_1.ptx --split 216,56,24 --split 208,72,24

Mosaic GPU dumps each kernel's PTX on the GPU machine (MOSAIC_GPU_DUMP_PTX=1 with
MOSAIC_GPU_DUMP_TO=DIR). This program rewrites only the values of the kernel's setmaxnreg
instructions, in the order they appear in the PTX (for the backward kernels: the consumers'
increase first, then the other warpgroups' decreases), runs ptxas -v for sm_90a on each
variant and tabulates what decides a split:
  - C7507: ptxas ignored every setmaxnreg ("to maintain minimum register requirements"), so
    the whole kernel is compiled at the launch's register count;
  - C7511 / C7512: wgmma serialized for lack of registers;
  - spill stores / loads in bytes, registers used.
A split is valid on the GPU only if the warpgroups' registers sum to at most 512 per thread slot
(64K registers / 128 threads) for four warpgroups, 504 for three (the launch rounds 65536 / 384
down to 168); --launch-total sets that sum, and invalid rows are marked.

ptxas: --ptxas, else `ptxas` on PATH, else the PyPI package nvidia-cuda-nvcc (CUDA 13:
`pip install nvidia-cuda-nvcc`). Its ptxas reproduces the GPU image's report on the same PTX to
within a few bytes of spills (docs/history/performance-2026-11.md has the comparison).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);")


def setmaxnreg_values(ptx: str) -> list[tuple[str, int]]:
  """The kernel's setmaxnreg instructions in PTX order: [(inc | dec, registers)]."""
  return [(m.group(1), int(m.group(2))) for m in SETMAXNREG.finditer(ptx)]


def with_split(ptx: str, values: list[int]) -> str:
  """The PTX with its setmaxnreg values replaced, in order, by `values` (one per instruction;
  each a multiple of 8 in 24..256, what the instruction takes)."""
  found = setmaxnreg_values(ptx)
  if len(values) != len(found):
    raise ValueError(f"split {values}: the PTX has {len(found)} setmaxnreg instructions "
                     f"({found}); give one value per instruction, in that order")
  for v in values:
    if v % 8 or not 24 <= v <= 256:
      raise ValueError(f"split {values}: {v} is not a multiple of 8 in 24..256")
  it = iter(values)
  return SETMAXNREG.sub(lambda m: f"setmaxnreg.{m.group(1)}.sync.aligned.u32 {next(it)};", ptx)


def parse_report(text: str) -> dict:
  """The parts of a `ptxas -v` report that decide a register split."""
  spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
  used = re.search(r"Used (\d+) registers", text)
  return {
      "setmaxnreg_ignored": "C7507" in text,
      "wgmma_serialized": "C7511" in text or "C7512" in text,
      "spill_stores": int(spill.group(1)) if spill else None,
      "spill_loads": int(spill.group(2)) if spill else None,
      "registers": int(used.group(1)) if used else None,
  }


def find_ptxas(explicit: str | None) -> str:
  if explicit:
    return explicit
  on_path = shutil.which("ptxas")
  if on_path:
    return on_path
  try:
    import nvidia.cu13  # the PyPI package nvidia-cuda-nvcc
    candidate = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "ptxas"
    if candidate.exists():
      return str(candidate)
  except ImportError:
    pass
  raise SystemExit("ptxas_splits.py: no ptxas found; pass --ptxas PATH or "
                   "`pip install nvidia-cuda-nvcc` (CUDA 13, sm_90a)")


def run_split(ptxas: str, ptx: str, values: list[int], arch: str) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    src = Path(tmp) / "kernel.ptx"
    src.write_text(with_split(ptx, values))
    cmd = [ptxas, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  if done.returncode != 0:
    raise SystemExit(f"ptxas failed on split {values}:\n{done.stderr[-2000:]}")
  return parse_report(done.stdout + done.stderr)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--ptx", required=True, type=Path, help="a kernel's dumped PTX")
  ap.add_argument("--split", action="append", default=[],
                  help="comma-separated registers, one per setmaxnreg in PTX order (repeatable); "
                       "none: the PTX as dumped")
  ap.add_argument("--launch-total", type=int, default=512,
                  help="the most the warpgroups' registers may sum to (512: four warpgroups, "
                       "504: three)")
  ap.add_argument("--warpgroups", default="",
                  help="comma-separated warpgroups per setmaxnreg value for the sum (e.g. 2,1,1: "
                       "the first value holds for two consumers); default one each")
  ap.add_argument("--ptxas")
  ap.add_argument("--arch", default="sm_90a")
  ap.add_argument("--out", type=Path, help="write the rows as JSON here")
  args = ap.parse_args(argv)
  ptx = args.ptx.read_text()
  found = setmaxnreg_values(ptx)
  splits = [[int(v) for v in s.split(",")] for s in args.split] or [[v for _, v in found]]
  weights = [int(w) for w in args.warpgroups.split(",")] if args.warpgroups else [1] * len(found)
  if len(weights) != len(found):
    ap.error(f"--warpgroups: one count per setmaxnreg ({len(found)})")
  ptxas = find_ptxas(args.ptxas)
  rows = []
  print(f"{args.ptx}: setmaxnreg in PTX order {found}; ptxas {ptxas}")
  for values in splits:
    total = sum(v * w for v, w in zip(values, weights))
    row = {"split": values, "sum": total, "valid": total <= args.launch_total,
           **run_split(ptxas, ptx, values, args.arch)}
    rows.append(row)
    flags = ", ".join(f for f, on in (("setmaxnreg IGNORED", row["setmaxnreg_ignored"]),
                                      ("wgmma serialized", row["wgmma_serialized"]),
                                      (f"over {args.launch_total}", not row["valid"])) if on)
    print(f"  {','.join(map(str, values)):>16} (sum {total}): {row['registers']} registers, "
          f"{row['spill_stores']} B spill stores, {row['spill_loads']} B loads"
          + (f"; {flags}" if flags else ""))
  if args.out:
    args.out.write_text(json.dumps({"ptx": str(args.ptx), "setmaxnreg": found, "rows": rows},
                                   indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
