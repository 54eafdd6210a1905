"""Run Mosaic interpreter cases under Pallas' race detector and summarise its reports (CPU).

    .venv/bin/python scripts/race_report.py window_masked_full_masked_det docs_padding_gqa
    .venv/bin/python scripts/race_report.py --no-release-commit window_masked_full_masked_det

Each case is one of tests/test_mosaic_interpret.py's CASES (forward + backward, checked against
the float32 reference as in that test). The detector prints one "RACE DETECTED" block per
racing access (thousands of lines); this prints each distinct pair once, as
"<access> at <kernel source line>  vs  <access> at <kernel source line>", with its count.
--no-release-commit turns the interpreter-only `released_for_tma` commit (kernels/mosaic/
forward.py) off, which shows the detector's TMA ring-reuse artefact (docs/kernels.md, "The race
detector").
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import sys

import jax.experimental.pallas.mosaic_gpu as plgpu

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "tests"))
import race_reports  # noqa: E402  (tests/race_reports.py)

# "  read of <key>[<range>] from <thread>, <frame>" / "  write of ..." (the detector's format)
_ACCESS = re.compile(r"^\s+(read|write) of .* from (.*?), (\S+:\d+(?: \(\S+\))?)\s*$")


def summarise(text: str) -> collections.Counter:
  """Counter of (first access, second access) over the RACE DETECTED blocks in `text`; an
  access is 'read|write <frame>' where frame is the kernel source line (file:line (function))
  and the thread kind (TMA copies run on the issuing warpgroup's thread)."""
  pairs = collections.Counter()
  lines = text.splitlines()
  for i, line in enumerate(lines):
    if line.startswith("RACE DETECTED"):
      accesses = []
      for nxt in lines[i + 1:i + 6]:
        m = _ACCESS.match(nxt)
        if m:
          kind, _, frame = m.groups()
          frame = re.sub(r"^.*/kvax_plugin/", "", frame)
          accesses.append(f"{kind} {frame}")
      if len(accesses) == 2:
        pairs[tuple(accesses)] += 1
  return pairs


def _with_kernel_source_lines(fn):
  """fn traced with per-operation tracebacks: JAX traces a custom_vjp's backward under the
  forward call's traceback, so without this every backward report names custom_vjp.py."""
  from jax._src import source_info_util

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    ctx = source_info_util._source_info_context
    saved = ctx.context
    ctx.context = source_info_util.SourceInfo(None, saved.name_stack)
    try:
      return fn(*args, **kwargs)
    finally:
      ctx.context = saved
  return wrapped


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("cases", nargs="+")
  ap.add_argument("--no-release-commit", action="store_true",
                  help="turn off the interpreter-only commit after each ring `free` wait")
  args = ap.parse_args(argv)

  plgpu.InterpretGPUParams = race_reports.detector_params()
  from kvax_plugin.attention.kernels.mosaic import backward, forward
  for name in ("dkv_call", "dq_call"):
    setattr(backward, name, _with_kernel_source_lines(getattr(backward, name)))
  if args.no_release_commit:
    for module in (forward, backward):
      module.released_for_tma = lambda interpret: None
  import test_mosaic_interpret

  found = False
  for name in args.cases:
    with race_reports.captured_reports() as buf:
      test_mosaic_interpret.test_kernels_in_interpreter_match_reference(name)
    pairs = summarise(buf.getvalue())
    # (the detector's races_found flag is per kernel launch; its printed reports are not)
    races = "RACE DETECTED" in buf.getvalue()
    found |= races
    print(f"{name}: races_found={races}, {sum(pairs.values())} reports, "
          f"{len(pairs)} distinct pairs (matches the reference)")
    for (a, b), n in pairs.most_common():
      print(f"  {n:5d}  {a}\n         vs {b}")
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main())
