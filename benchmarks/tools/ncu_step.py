"""The kernels of one jax step and their durations, from ncu's per-metric CSV.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 -m benchmarks.tools.ncu_kernels --impl cudnn --case causal --seq 65536 \
        --steps 2 > step.csv
    python -m benchmarks.tools.ncu_step step.csv --steps 2 [--min-ms 0.1]

ncu_kernels.py compiles one forward+backward and runs it --steps times; give this tool the same
--steps. With two, the step is the longest kernel sequence the process ends with twice over (by
name). With one, it is everything after XLA's last buffer check (its redzone and delay kernels,
which end the compile's autotuning); that also takes in the benchmark's random inputs when
nothing was autotuned after them (cuDNN's process: four multiply fusions, 1.4 / 0.36 / 0.36 /
1.4 ms at 64k, q / k / v / the cotangent). Kernels shorter than --min-ms (XLA's small fusions)
are left out. Prints one line per kernel and the total; the per-kernel tables of
docs/history/performance-2026-11.md come from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.tools.ncu_summary import csv_rows

# XLA's allocator checks and autotuning delays: the step starts after the last of them
SETUP_KERNELS = ("RedzoneAllocatorKernel", "DelayKernel")
MS_PER_UNIT = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


def step_kernels(path: Path, steps: int = 1, min_ms: float = 0.1) -> list[tuple[str, float]]:
  """[(kernel name, ms)] of the last step in an ncu CSV (`--csv`, the default details page,
  gpu__time_duration.sum among its metrics) of a process that ran `steps` steps (1 or 2); ncu's
  own messages before the header skipped."""
  if steps not in (1, 2):
    raise ValueError(f"steps={steps}: expected 1 or 2 (ncu_kernels.py --steps)")
  launches = []
  for row in csv_rows(path):
    if row.get("Metric Name") != "gpu__time_duration.sum":
      continue
    unit = row["Metric Unit"]
    if unit not in MS_PER_UNIT:
      raise ValueError(f"{path}: duration in {unit!r}; expected one of {sorted(MS_PER_UNIT)}")
    value = float(row["Metric Value"].replace(",", ""))
    launches.append((row["Kernel Name"], value * MS_PER_UNIT[unit]))
  names = [name for name, _ in launches]
  if steps == 2:
    period = next((k for k in range(len(names) // 2, 0, -1) if names[-k:] == names[-2 * k:-k]),
                  None)
    if period is None:
      raise ValueError(f"{path}: the process does not end with a kernel sequence run twice; "
                       "was it ncu_kernels.py --steps 2?")
    first = len(launches) - period
  else:
    setup = [i for i, name in enumerate(names) if any(k in name for k in SETUP_KERNELS)]
    first = setup[-1] + 1 if setup else 0
  return [(name, ms) for name, ms in launches[first:] if ms >= min_ms]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("csv", type=Path)
  ap.add_argument("--steps", type=int, default=1, choices=(1, 2),
                  help="the steps ncu_kernels.py ran (--steps)")
  ap.add_argument("--min-ms", type=float, default=0.1)
  ap.add_argument("--json", action="store_true", help="print the kernels as JSON")
  args = ap.parse_args(argv)
  kernels = step_kernels(args.csv, args.steps, args.min_ms)
  if args.json:
    print(json.dumps({"kernels": [{"name": n[:80], "ms": round(ms, 3)} for n, ms in kernels],
                      "total_ms": round(sum(ms for _, ms in kernels), 2)}, indent=1))
    return 0
  for name, ms in kernels:
    print(f"{ms:10.3f} ms  {name[:100]}")
  print(f"{sum(ms for _, ms in kernels):10.3f} ms  total")
  return 0


if __name__ == "__main__":
  sys.exit(main())
