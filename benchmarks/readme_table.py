"""The README's speed table, regenerated from the benchmark results file it cites.

    python -m benchmarks.readme_table benchmarks/results/<date>-<gpu>/<run>/results.json
    python -m benchmarks.readme_table --check        # exit 1 when the table is not its file's

`python -m benchmarks.run --preset full` writes results.json, tables.md and speed.png into a run
folder. Given that results.json, this rewrites README.md's "## Speed" section to show that run:
the kernel table (benchmarks.results.kernel_table of the file's rows, as tables.md has it), the
plot's path and the results link. The prose around the table (conditions, what changed since)
stays the author's. --check (also run by tests/test_docs.py) regenerates the table from the
results file the section links and fails when the README's differs, so a hand-edited or stale
table cannot land.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SECTION = "## Speed"
RESULTS_LINK = re.compile(r"benchmarks/results/[\w./-]+/results\.json")
PLOT_LINK = re.compile(r"benchmarks/results/[\w./-]+/speed\.png")


def speed_section(text: str) -> tuple[int, int]:
  """(start, end) character offsets of the README's speed section: its heading to the next
  heading of the same level (or the end)."""
  start = text.find("\n" + SECTION + "\n")
  if start < 0:
    raise ValueError(f"README: no {SECTION!r} section")
  start += 1
  nxt = text.find("\n## ", start + len(SECTION))
  return start, (nxt + 1 if nxt >= 0 else len(text))


def cited_results(text: str) -> Path:
  """The results.json the speed section links (the first one)."""
  start, end = speed_section(text)
  m = RESULTS_LINK.search(text, start, end)
  if not m:
    raise ValueError(f"README's {SECTION!r} section links no benchmarks/results/.../results.json")
  return ROOT / m.group(0)


def _table_span(section: str) -> tuple[int, int]:
  """The kernel table's lines in the section: from its '| case | pass |' header to the last
  consecutive table line."""
  lines = section.split("\n")
  first = next((i for i, line in enumerate(lines) if line.startswith("| case | pass |")), None)
  if first is None:
    raise ValueError(f"README's {SECTION!r} section has no '| case | pass | ...' table")
  last = first
  while last + 1 < len(lines) and lines[last + 1].startswith("|"):
    last += 1
  return first, last


def render(text: str, results: Path) -> str:
  """README text with its speed section showing `results` (a results.json of benchmarks.run)."""
  from benchmarks.results import kernel_table  # matplotlib: only where a table is made

  rows = json.loads(results.read_text()).get("kernels")
  if not isinstance(rows, list):
    raise ValueError(f"results: {results} has no 'kernels' rows (expected a results.json of "
                     "python -m benchmarks.run)")
  rel = results.resolve().relative_to(ROOT).as_posix()
  start, end = speed_section(text)
  section = text[start:end]
  section = RESULTS_LINK.sub(rel, section)
  section = PLOT_LINK.sub(rel.rsplit("/", 1)[0] + "/speed.png", section)
  lines = section.split("\n")
  first, last = _table_span(section)
  lines[first:last + 1] = kernel_table(rows).split("\n")
  return text[:start] + "\n".join(lines) + text[end:]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("results", nargs="?", type=Path,
                  help="a results.json of benchmarks.run (default: the one the README links)")
  ap.add_argument("--readme", type=Path, default=README)
  ap.add_argument("--check", action="store_true",
                  help="compare instead of writing; exit 1 when the README's table differs")
  args = ap.parse_args(argv)
  text = args.readme.read_text()
  results = args.results or cited_results(text)
  if not results.is_file():
    ap.error(f"results: {results} is not a file (expected a results.json of benchmarks.run)")
  if not results.resolve().is_relative_to(ROOT):
    ap.error(f"results: {results} is outside {ROOT}; the README links the file it shows, so copy "
             "the run's folder under benchmarks/results/<date>-<gpu>/ first")
  new = render(text, results)
  if args.check:
    if new != text:
      print(f"{args.readme}: the speed table is not {results}'s; regenerate it with "
            f"python -m benchmarks.readme_table {results.relative_to(ROOT)}", file=sys.stderr)
      return 1
    print(f"{args.readme}: the speed table is {results}'s")
    return 0
  args.readme.write_text(new)
  print(f"wrote {args.readme}'s speed table from {results}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
