"""Several trees timed against each other on this machine's GPU, alternated in one call: where
along a line of commits a case got slower.

    python -m benchmarks.bisect_commits --tree NAME=PATH --tree NAME=PATH [...] [--rounds 3]
        [--cases quick|full] [--only 16k-docs] [--backend hopper] [--deadline SECONDS] [--out FILE]

Each PATH holds a kvax_plugin/ (extract a commit with `git archive <commit> kvax_plugin | tar -x
-C .gate/<commit>`; prebuild its CUDA library there with `PYTHONPATH=.gate/<commit> python -m
kvax_plugin.attention.kernels.cuda_sm90.build` so that no round compiles it). The timing
processes are the speed gate's (benchmarks/gate_worker.py, one process per tree and round, the
trees in the order given in every round; one warm-up process per tree first, sharing a JAX
persistent compilation cache). --deadline stops starting rounds after that many seconds and
reports the rounds that finished.

Writes a JSON file (--out; default benchmarks/results/bisect/<date>-<gpu>.json): the conditions,
the warm-up processes' medians (timed as a round's, after the compile), every round's medians
per tree, and per case each tree's median over rounds and its ratio to the
first tree's; prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.gate import CASE_SETS, SHAPES, SMOKE_SHAPES, gpu_name, run_worker, write_spec
from benchmarks.results import gpu_slug

ROOT = Path(__file__).resolve().parents[1]


def parse_tree(text: str) -> tuple[str, Path]:
  """NAME=PATH -> (NAME, absolute PATH); PATH must hold kvax_plugin/__init__.py."""
  name, sep, path = text.partition("=")
  if not sep or not name or not path:
    raise argparse.ArgumentTypeError(f"--tree {text!r}: expected NAME=PATH")
  tree = Path(path).resolve()
  if not (tree / "kvax_plugin" / "__init__.py").exists():
    raise argparse.ArgumentTypeError(f"--tree {text!r}: {tree} has no kvax_plugin/__init__.py")
  return name, tree


def summarize(rounds: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
  """Per case, per tree: the median over rounds (ms) and its ratio to the first tree's."""
  names = list(rounds)
  cases = {}
  for key in rounds[names[0]][0]:
    first = statistics.median(r[key] for r in rounds[names[0]])
    cases[key] = {}
    for name in names:
      ms = statistics.median(r[key] for r in rounds[name])
      cases[key][name] = dict(ms=ms, ratio=ms / first)
  return cases


def table(cases: dict[str, dict[str, dict]]) -> str:
  names = list(next(iter(cases.values())))
  lines = ["| case | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
  for key, per in cases.items():
    lines.append(f"| {key} | " + " | ".join(
        f"{per[n]['ms']:.3f} ({per[n]['ratio']:.3f})" for n in names) + " |")
  return "\n".join(lines) + "\n\nms, median over rounds (ratio to the first tree)"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog="\n".join(__doc__.splitlines()[1:]))
  ap.add_argument("--tree", type=parse_tree, action="append", required=True,
                  metavar="NAME=PATH", help="a tree to time (at least two; the first is the "
                  "reference of the ratios)")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--calls", type=int, default=10,
                  help="timed rounds of back-to-back calls per case and process")
  ap.add_argument("--cases", choices=tuple(CASE_SETS), default="quick")
  ap.add_argument("--only", action="append", default=None, metavar="CASE",
                  help="keep only these cases of the set (e.g. 16k-docs); repeatable")
  ap.add_argument("--backend", default="hopper")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU dry run)")
  ap.add_argument("--deadline", type=float, default=None,
                  help="start no round after this many seconds")
  ap.add_argument("--timeout", type=float, default=900, help="seconds per process")
  ap.add_argument("--out")
  args = ap.parse_args(argv)
  if len(args.tree) < 2:
    ap.error("give at least two --tree")
  names = [n for n, _ in args.tree]
  if len(set(names)) != len(names):
    ap.error(f"--tree names must differ (got {names})")
  if args.rounds < 1 or args.calls < 1:
    ap.error("--rounds and --calls must be at least 1")

  start = time.monotonic()
  work = Path(tempfile.mkdtemp(prefix="kvax-bisect-"))
  try:
    spec_path = write_spec(work, args.cases, args.smoke, args.backend, args.calls)
    if args.only:
      spec = json.loads(spec_path.read_text())
      known = [c["name"] for c in spec["cases"]]
      unknown = sorted(set(args.only) - set(known))
      if unknown:
        ap.error(f"--only {unknown}: not among the cases {known}")
      spec["cases"] = [c for c in spec["cases"] if c["name"] in args.only]
      spec_path.write_text(json.dumps(spec, indent=1))
    cache = work / "jax_cache"
    info, rounds = {}, {n: [] for n in names}
    try:
      for name, tree in args.tree:
        print(f"warm-up process: {name} ({tree})", flush=True)
        info[name] = run_worker(tree, spec_path, args.timeout, cache)
      for r in range(args.rounds):
        if args.deadline is not None and time.monotonic() - start > args.deadline and r > 0:
          print(f"deadline: {r} rounds", flush=True)
          break
        for name, tree in args.tree:
          got = run_worker(tree, spec_path, args.timeout, cache)
          rounds[name].append(got["medians_ms"])
          print(f"round {r + 1} {name}: " + ", ".join(
              f"{k} {v:.3f}" for k, v in got["medians_ms"].items()), flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
      print(str(e), flush=True)
      if not all(rounds.values()):
        return 2
    done = min(len(v) for v in rounds.values())
    rounds = {n: v[:done] for n, v in rounds.items()}
    cases = summarize(rounds)
    first = info[names[0]]
    gpu = gpu_name(first) if first["platform"] == "gpu" else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out) if args.out else (
        ROOT / "benchmarks" / "results" / "bisect" / f"{date:%Y-%m-%d}-{gpu_slug(gpu)}.json")
    result = dict(
        conditions=dict(
            date=date.isoformat(timespec="seconds"), gpu=gpu, jax=first["jax"],
            jaxlib=first["jaxlib"], trees={n: str(t) for n, t in args.tree},
            backend=args.backend, cases=list(cases),
            rounds=done, calls=args.calls, smoke=args.smoke,
            shapes=dict(SMOKE_SHAPES if args.smoke else SHAPES, batch=1, seed=0),
            seconds=round(time.monotonic() - start)),
        warmup={n: info[n]["medians_ms"] for n in names}, rounds=rounds, cases=cases)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("\n" + table(cases))
    print(f"wrote {out}")
    return 0
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  raise SystemExit(main())
