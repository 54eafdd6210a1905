"""Summarise Nsight Compute source pages (SASS) of kernels side by side: warp instructions
executed per opcode, stall reasons and where the warp-state samples land.

Input: the CSV that `ncu --import X.ncu-rep --page source --csv --print-source sass` writes
(gzipped or not), one per kernel, e.g. of our backward and cuDNN's (docs/kernels.md, "Profiling"):

  python -m benchmarks.tools.ncu_sass_summary outputs/ncu/hopper.sass.csv.gz \
      outputs/ncu/cudnn.sass.csv.gz
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
from pathlib import Path


def read_rows(path: Path) -> tuple[list[str], list[list[str]]]:
  """(header, rows) of one source page; the first line names the kernel."""
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt") as f:
    rows = list(csv.reader(f))
  header = rows[1]
  return header, [r for r in rows[2:] if len(r) >= len(header)]


def opcode(source: str) -> str:
  """'@!P0 ISETP.NE.AND P2, ...' -> 'ISETP' (predicate and modifiers dropped)."""
  text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
  return text.split(" ")[0].split(".")[0]


def summarise(path: Path) -> dict:
  header, rows = read_rows(path)
  col = {h: i for i, h in enumerate(header)}
  stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
  executed, sampled, stalls = collections.Counter(), collections.Counter(), collections.Counter()
  for r in rows:
    op = opcode(r[col["Source"]])
    executed[op] += int(r[col["Instructions Executed"]] or 0)
    sampled[op] += int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
    for h in stall_cols:
      stalls[h[len("stall_"):]] += int(r[col[h]] or 0)
  return dict(executed=executed, sampled=sampled, stalls=stalls)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("csv", nargs="+", type=Path, help="source-page CSVs (.csv or .csv.gz)")
  ap.add_argument("--top", type=int, default=20, help="opcodes to list")
  args = ap.parse_args(argv)
  for path in args.csv:
    s = summarise(path)
    total = sum(s["executed"].values())
    samples = max(sum(s["sampled"].values()), 1)
    print(f"== {path.name}: {total / 1e6:.1f} M warp instructions executed, {samples} samples")
    print("  stalls: " + ", ".join(f"{k} {v / samples:.1%}"
                                   for k, v in s["stalls"].most_common(9)))
    print("  executed (M): " + ", ".join(f"{k} {v / 1e6:.1f}"
                                         for k, v in s["executed"].most_common(args.top)))
    print("  samples at: " + ", ".join(f"{k} {v / samples:.1%}"
                                       for k, v in s["sampled"].most_common(12)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
