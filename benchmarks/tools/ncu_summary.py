"""Nsight Compute raw CSVs (`ncu --import X.ncu-rep --csv --page raw`) as one table: a row per
metric, a column per kernel launch.

    python -m benchmarks.tools.ncu_summary outputs/ncu/*.csv [--match REGEX ...] [--out table.md]

Each CSV is one process of benchmarks/tools/ncu_kernels.py (file name ncu_<impl>_<case>.csv); its
kernels are labelled <impl>/<case>/<n>:<short kernel name>. Without --match, the metrics that
decide where an attention kernel's time goes are kept: duration, launch shape, the tensor
(gmma) pipe, shared memory, L2 / DRAM throughput and the warp-stall breakdown.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

DEFAULT_MATCH = (
    r"^gpu__time_duration\.sum$",
    r"^launch__(registers_per_thread|shared_mem_per_block_(dynamic|static)|grid_size|block_size)$",
    r"gmma",
    r"^sm__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^sm__inst_executed_pipe_tensor",
    r"^sm__pipe_tensor.*pct_of_peak_sustained_(active|elapsed)$",
    r"mem_shared.*(sum|pct_of_peak_sustained_elapsed)$",
    r"^l1tex__data_bank_(reads|writes)\.avg\.pct_of_peak_sustained_elapsed$",
    r"^(lts|dram|l1tex)__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^smsp__average_warp_latency_issue_stalled_.*\.ratio$",
    r"^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$",
    r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
    r"^sm__warps_active\.avg\.pct_of_peak_sustained_active$",
)


def short_name(name: str) -> str:
  name = re.sub(r"^void ", "", name)
  name = re.sub(r"\(.*$", "", name)
  for long, short in (("cudnn_generated_fort_native_sdpa_sm90_flash_", "cudnn_"),
                      ("_mosaic_gpu_kernel", "")):
    name = name.replace(long, short)
  return name[:40]


def csv_rows(path: Path) -> list[dict]:
  """Every row of an ncu CSV (`--csv`, any page) as a dict by column name; anything before the
  header, e.g. ncu's own messages, is skipped. Raises ValueError when there is no header."""
  lines = Path(path).read_text(errors="replace").splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
  if start is None:
    raise ValueError(f"{path}: no ncu CSV header (a line starting with \"ID\")")
  return list(csv.DictReader(lines[start:]))


def read(path: Path) -> list[dict]:
  """Rows of one raw CSV (ncu writes a header row, then a units row, then one row per launch),
  one per launch; none when the file is not an ncu CSV."""
  try:
    rows = csv_rows(path)
  except ValueError:
    return []
  return [r for r in rows if r.get("ID", "").isdigit()]


def table(paths: list[Path], patterns: list[str]) -> str:
  columns, launches = [], []
  for path in paths:
    tag = path.stem.removeprefix("ncu_").replace("_causal", "/causal").replace("_docs", "/docs")
    for n, row in enumerate(read(path)):
      columns.append(f"{tag}/{n}:{short_name(row.get('Kernel Name', '?'))}")
      launches.append(row)
  if not launches:
    return "no kernel rows found\n"
  regexes = [re.compile(p) for p in patterns]
  names = [m for m in launches[0] if any(r.search(m) for r in regexes)]
  for row in launches[1:]:
    names += [m for m in row if m not in names and any(r.search(m) for r in regexes)]
  out = ["| metric | " + " | ".join(columns) + " |",
         "|---|" + "---:|" * len(columns)]
  for m in names:
    values = [row.get(m, "") for row in launches]
    if all(v in ("", "n/a") for v in values):
      continue
    out.append(f"| {m} | " + " | ".join(v.replace(",", "") for v in values) + " |")
  return "\n".join(out) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("csv", nargs="+", type=Path)
  ap.add_argument("--match", action="append", default=None,
                  help="regex of metric names to keep (repeatable; default: see DEFAULT_MATCH)")
  ap.add_argument("--out", type=Path)
  args = ap.parse_args(argv)
  text = table(args.csv, args.match or list(DEFAULT_MATCH))
  if args.out:
    args.out.write_text(text)
  sys.stdout.write(text)


if __name__ == "__main__":
  main()
