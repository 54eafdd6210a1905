"""Speed gate: a candidate tree against a base commit, on this machine's GPU.

    python -m benchmarks.gate --base <commit> [--candidate <path or commit>] [--rounds N]
        [--threshold 0.03] [--confirm-rounds N] [--cases quick|long|full] [--backend auto]
        [--head-dim 128 | --head-dims 64,128,256 | --head-dims all] [--out FILE]
    python -m benchmarks.gate --base-tree <path> ...     # the base already extracted

The trees: --candidate defaults to this working tree; a commit (for --base always) is extracted
with `git archive <commit> kvax_plugin | tar -x` into a temporary folder, which needs this
checkout's .git. Where the repository arrives without its history (a copy of the working tree on
a GPU machine), extract the base beforehand where the history is and pass the folder:

    mkdir -p .gate/base && git archive <commit> kvax_plugin | tar -x -C .gate/base
    python -m benchmarks.gate --base-tree .gate/base

(.gate/ is git-ignored: a copy of the working tree takes it along only when asked to.)

Only kvax_plugin/ of a tree is used (its CUDA sources included). Each timing process is
benchmarks/gate_worker.py with PYTHONPATH=<tree>, timing the public API that every commit has
(create_attention_mask, flash_attention, jax.grad of sum(out * dO)); it prints the medians
(ms per call) of `--calls` rounds of back-to-back calls (about 20 ms each) after 3 warm-ups, per
case: the mask build alone, then the forward and the forward+backward with the prebuilt mask as
a jit argument. Back to back, not each call waited for: the host's dispatch latency varies
between processes by up to 10% of a 16k documents forward (0.8 ms), and that is not the GPU's.

First one warm-up process per tree, side by side (backend "hopper" compiles its CUDA library
with nvcc on first use, cached under ~/.cache/kvax_plugin/sm90/ by source: two trees, two
libraries; and the processes share a JAX persistent compilation cache of this run, which the
warm-ups fill, unless --no-compilation-cache), then --rounds rounds, each one process of the
base then one of the candidate (A, B, A, B, ...). Per case: ratio = the candidate's median over rounds / the base's;
the gate fails (exit 1) when any forward or forward+backward case is slower by more than
--threshold (the mask build's ratio is reported, not gated). A case that fails after --rounds
is timed again: --confirm-rounds more rounds (default as many as --rounds) of both trees, and
the verdict is taken over all rounds, first and confirming together; one slow round among few
(a 0.6 ms forward varies by several percent between processes) does not fail the gate alone,
a slowdown present in every round still does. Exit 2: a process failed.

Cases (benchmarks/cases.py, the kernel table's shapes): B=1, 32 query / 8 kv heads, head dim 128
(--head-dim 64 or 256 for those kernels; --head-dims 64,128,256 or all: every case at each, in
the same processes, for a change that every kernel family shares), bf16; "quick" = 16k causal
and 16k documents (12 documents, numpy.random.default_rng(0) cuts, then 1000 padding tokens
with positions 0..999), forward and forward+backward; "full" adds 64k; "long" is the 64k cases
alone, for a change that only rows above 16k can reach (each process compiles and times every
case, so "full" takes about twice as long as either).
--smoke: 256 tokens, 2 / 1 heads, head dim 32, float32, 16 padding tokens (a CPU dry run with
--backend jax).

Writes a JSON file (--out; default benchmarks/results/gate/<date>-<gpu>.json): the conditions
(date, GPU, jax / jaxlib, both trees and their commits, rounds, calls, threshold), every round's
medians, each process's wall time (wall_s), the ratios and the verdict; prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages without install
  sys.path.insert(0, str(ROOT))

from benchmarks.cases import layout  # noqa: E402
from benchmarks.gate_worker import RESULT_PREFIX  # noqa: E402
from benchmarks.results import gpu_slug  # noqa: E402

WORKER = Path(__file__).resolve().parent / "gate_worker.py"
CASE_SETS = {"quick": ((16384, "causal"), (16384, "docs")),
             "long": ((65536, "causal"), (65536, "docs")),
             "full": ((16384, "causal"), (16384, "docs"), (65536, "causal"), (65536, "docs"))}
SHAPES = dict(heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", num_docs=12, pad=1000)
SMOKE_SHAPES = dict(heads=2, kv_heads=1, head_dim=32, dtype="float32", num_docs=12, pad=16)
SMOKE_SEQ = 256
HEAD_DIMS = (64, 128, 256)  # --head-dim: the head dims "auto" has one kernel family each for
GATED_PASSES = ("fwd", "fwd_bwd")
WARMUP_CALLS = 3


def case_name(seq: int, case: str) -> str:
  return (f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)) + f"-{case}"


def shapes_for(smoke: bool, head_dim: int | None = None) -> dict:
  """The timed shapes: SHAPES (or SMOKE_SHAPES), with head_dim instead of theirs if given."""
  shapes = dict(SMOKE_SHAPES if smoke else SHAPES)
  if head_dim is not None:
    shapes["head_dim"] = head_dim
  return shapes


def write_spec(folder: Path, cases: str, smoke: bool, backend: str, calls: int,
               head_dim: int | tuple[int, ...] | None = None) -> Path:
  """The workers' spec (shapes, backend, warm-ups, calls) and one .npz layout per case.

  head_dim: one head dim, or several: then every case runs at each, named "<case>-d<head dim>"
  (a change to code that every kernel family shares is timed at each in the same processes)."""
  folder.mkdir(parents=True, exist_ok=True)
  head_dims = head_dim if isinstance(head_dim, tuple) else (head_dim,)
  shapes = shapes_for(smoke, head_dims[0])
  specs = []
  for seq, case in CASE_SETS[cases]:
    seq = SMOKE_SEQ if smoke else seq
    pos, seg, _ = layout(case, seq, seed=0, num_docs=shapes["num_docs"], pad=shapes["pad"],
                         counted_padding=True)
    name = case_name(seq, case)
    path = folder / f"{name}.npz"
    np.savez(path, positions=pos, segment_ids=seg)
    for d in head_dims:
      d = shapes_for(smoke, d)["head_dim"]
      suffix = f"-d{d}" if len(head_dims) > 1 else ""
      specs.append(dict(name=name + suffix, seq=seq, case=case, layout=str(path), head_dim=d))
  spec = dict(backend=backend, heads=shapes["heads"], kv_heads=shapes["kv_heads"],
              head_dim=shapes["head_dim"], dtype=shapes["dtype"], seed=0, warmup=WARMUP_CALLS,
              calls=calls, passes=list(GATED_PASSES), cases=specs)
  path = folder / "spec.json"
  path.write_text(json.dumps(spec, indent=1))
  return path


def run_worker(tree: Path, spec: Path, timeout: float, cache: Path | None = None,
               env_extra: dict | None = None) -> dict:
  """One timing process on `tree`'s kvax_plugin; its GATE_RESULT. cache: JAX's persistent
  compilation cache for the process (None: none); env_extra: more environment variables."""
  env = dict(os.environ, PYTHONPATH=str(tree), **(env_extra or {}))
  if cache is not None:
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  done = subprocess.run([sys.executable, "-P", str(WORKER), str(spec)], env=env, cwd=str(tree),
                        capture_output=True, text=True, timeout=timeout)
  line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith(RESULT_PREFIX)),
              None)
  if done.returncode != 0 or line is None:
    raise RuntimeError(f"gate worker on {tree} failed (exit {done.returncode}):\n"
                       f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
  return json.loads(line[len(RESULT_PREFIX):])


def warm_up(trees, spec: Path, timeout: float, cache: Path | None,
            wall: dict | None = None) -> dict:
  """{name: GATE_RESULT} of one warm-up process per tree, all at once: they compile (the hopper
  library's nvcc build included) into the shared cache before any round, and compiling is the
  host's work, so side by side they take about as long as the slowest alone. Their one timed
  round each is not used. JAX's preallocation is off in them, so that they fit on one GPU.
  wall, if given, gets {name: seconds} of each process."""
  def one(name_tree):
    name, tree = name_tree
    t0 = time.perf_counter()
    got = run_worker(tree, spec, timeout, cache, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    seconds = time.perf_counter() - t0
    if wall is not None:
      wall[name] = round(seconds, 1)
    print(f"warm-up process: {name} ({tree}, {seconds:.0f} s)", flush=True)
    return name, got
  with concurrent.futures.ThreadPoolExecutor(len(trees)) as pool:
    return dict(pool.map(one, trees))


def verdict(base_rounds: list[dict], candidate_rounds: list[dict], threshold: float) -> dict:
  """Per case (the keys of the rounds' medians): the median over rounds of each tree, their
  ratio (candidate / base) and whether it gates; passed = no gated case slower than
  1 + threshold."""
  cases = {}
  for key in base_rounds[0]:
    base = statistics.median(r[key] for r in base_rounds)
    cand = statistics.median(r[key] for r in candidate_rounds)
    ratio = cand / base
    gated = key.rsplit("/", 1)[-1] in GATED_PASSES
    cases[key] = dict(base_ms=base, candidate_ms=cand, ratio=ratio, gated=gated,
                      slower=gated and ratio > 1 + threshold)
  failed = [k for k, c in cases.items() if c["slower"]]
  return dict(cases=cases, failed=failed, passed=not failed, threshold=threshold)


def table(v: dict) -> str:
  lines = ["| case | base ms | candidate ms | candidate / base | |", "|---|---:|---:|---:|---|"]
  for key, c in v["cases"].items():
    mark = "SLOWER" if c["slower"] else ("ok" if c["gated"] else "(not gated)")
    lines.append(f"| {key} | {c['base_ms']:.3f} | {c['candidate_ms']:.3f} | {c['ratio']:.3f} "
                 f"| {mark} |")
  lines.append(f"\nverdict: {'PASS' if v['passed'] else 'FAIL'} (threshold "
               f"{v['threshold']:.1%}"
               + (f"; slower: {', '.join(v['failed'])})" if v["failed"] else ")"))
  return "\n".join(lines)


def extract_commit(commit: str, dest: Path, repo: Path = ROOT) -> Path:
  """kvax_plugin/ of `commit` under dest (git archive | tar -x); dest."""
  dest.mkdir(parents=True, exist_ok=True)
  archive = subprocess.run(["git", "-C", str(repo), "archive", commit, "kvax_plugin"],
                           capture_output=True, check=False)
  if archive.returncode != 0:
    raise SystemExit(f"git archive {commit} failed ({archive.stderr.decode()[-500:].strip()}); "
                     "without this checkout's history, extract the base where it is and pass "
                     "--base-tree (see --help)")
  subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
  return dest


def describe(tree: Path, commit: str | None) -> dict:
  """The tree's path and commit (as asked, or HEAD of a checkout with its dirty state)."""
  if commit:
    return dict(path=str(tree), commit=commit)
  # Only a tree that is itself a checkout's top: an extracted tree inside another checkout (such
  # as .gate/base) would otherwise report that checkout's HEAD.
  top = subprocess.run(["git", "-C", str(tree), "rev-parse", "--show-toplevel"],
                       capture_output=True, text=True)
  if top.returncode != 0 or Path(top.stdout.strip()).resolve() != Path(tree).resolve():
    return dict(path=str(tree), commit="unknown (not a git checkout: name it with --*-name)")
  head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                        text=True)
  if head.returncode != 0:
    return dict(path=str(tree), commit="unknown (no git history)")
  dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "kvax_plugin"],
                         capture_output=True, text=True).stdout.strip()
  return dict(path=str(tree), commit=head.stdout.strip(), kvax_plugin_modified=bool(dirty))


def gpu_name(worker: dict) -> str:
  """nvidia-smi's name of GPU 0, else JAX's device kind."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode == 0 and out.stdout.strip():
      return out.stdout.strip().splitlines()[0]
  except (OSError, subprocess.SubprocessError):
    pass
  return worker["device_kind"]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog="\n".join(__doc__.splitlines()[1:]))
  base = ap.add_mutually_exclusive_group(required=True)
  base.add_argument("--base", metavar="COMMIT", help="the base commit (git archive)")
  base.add_argument("--base-tree", metavar="PATH", help="the base, already extracted")
  ap.add_argument("--candidate", default=None, metavar="PATH|COMMIT",
                  help="the candidate: a folder or a commit (default: this working tree)")
  ap.add_argument("--base-name", help="what the base is (recorded; e.g. its commit when "
                  "--base-tree has no git history)")
  ap.add_argument("--candidate-name", help="what the candidate is (recorded)")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--calls", type=int, default=10,
                  help="timed rounds of back-to-back calls per case and process")
  ap.add_argument("--threshold", type=float, default=0.03)
  ap.add_argument("--confirm-rounds", type=int, default=None,
                  help="rounds added when a case fails after --rounds, the verdict then taken "
                  "over all rounds (default: as many as --rounds; 0: none)")
  ap.add_argument("--cases", choices=tuple(CASE_SETS), default="quick")
  ap.add_argument("--backend", default="auto", help="flash_attention's backend (default auto)")
  dims = ap.add_mutually_exclusive_group()
  dims.add_argument("--head-dim", type=int, choices=HEAD_DIMS, default=None,
                    help="q / k / v head dim (default 128; the smoke run's 32)")
  dims.add_argument("--head-dims", default=None, metavar="D,D,...",
                    help="several head dims of " + ", ".join(map(str, HEAD_DIMS)) + " (or "
                    "'all'), each case timed at each in the same processes: for a change to "
                    "what every kernel family shares (about as long as one gate per head dim)")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU dry run)")
  ap.add_argument("--timeout", type=float, default=1800, help="seconds per process")
  ap.add_argument("--no-compilation-cache", action="store_true",
                  help="every process compiles (default: the warm-up processes fill a JAX "
                       "persistent compilation cache of this run that the rounds load from)")
  ap.add_argument("--out", help="results file (default benchmarks/results/gate/<date>-<gpu>.json)")
  args = ap.parse_args(argv)
  if args.rounds < 1 or args.calls < 1:
    ap.error("--rounds and --calls must be at least 1")
  confirm_rounds = args.rounds if args.confirm_rounds is None else args.confirm_rounds
  if confirm_rounds < 0:
    ap.error(f"--confirm-rounds: expected 0 or more, got {confirm_rounds}")
  head_dim = args.head_dim
  if args.head_dims is not None:
    try:
      head_dim = (HEAD_DIMS if args.head_dims == "all"
                  else tuple(int(d) for d in args.head_dims.split(",")))
    except ValueError:
      head_dim = ()
    if not head_dim or any(d not in HEAD_DIMS for d in head_dim) or len(set(head_dim)) != len(
        head_dim):
      ap.error(f"--head-dims {args.head_dims!r}: expected distinct values of {HEAD_DIMS}, "
               "comma-separated, or 'all'")

  work = Path(tempfile.mkdtemp(prefix="kvax-gate-"))
  try:
    if args.base_tree:
      base_tree, base_desc = Path(args.base_tree).resolve(), describe(Path(args.base_tree), None)
    else:
      base_tree = extract_commit(args.base, work / "base")
      base_desc = describe(base_tree, args.base)
    if args.candidate is None:
      cand_tree, cand_desc = ROOT, describe(ROOT, None)
    elif Path(args.candidate).is_dir():
      cand_tree = Path(args.candidate).resolve()
      cand_desc = describe(cand_tree, None)
    else:
      cand_tree = extract_commit(args.candidate, work / "candidate")
      cand_desc = describe(cand_tree, args.candidate)
    for desc, label in ((base_desc, args.base_name), (cand_desc, args.candidate_name)):
      if label:
        desc["name"] = label
    for name, tree in (("base", base_tree), ("candidate", cand_tree)):
      if not (tree / "kvax_plugin" / "__init__.py").exists():
        raise SystemExit(f"{name} tree {tree} has no kvax_plugin/__init__.py")
    spec = write_spec(work, args.cases, args.smoke, args.backend, args.calls, head_dim)
    trees = (("base", base_tree), ("candidate", cand_tree))
    cache = None if args.no_compilation_cache else work / "jax_cache"
    rounds = {"base": [], "candidate": []}
    # seconds of each process: the warm-ups (side by side), then every round's, in order
    wall = {"warm_up": {}, "rounds": {"base": [], "candidate": []}}
    t_start = time.perf_counter()

    def time_rounds(n: int, label: str):
      for r in range(n):
        for name, tree in trees:
          t0 = time.perf_counter()
          got = run_worker(tree, spec, args.timeout, cache)
          seconds = time.perf_counter() - t0
          rounds[name].append(got["medians_ms"])
          wall["rounds"][name].append(round(seconds, 1))
          print(f"{label} {r + 1}/{n} {name} ({seconds:.0f} s): " + ", ".join(
              f"{k} {v:.3f}" for k, v in got["medians_ms"].items()), flush=True)

    first = None
    try:
      info = warm_up(trees, write_spec(work / "warm_up", args.cases, args.smoke, args.backend, 1,
                                       head_dim), args.timeout, cache, wall["warm_up"])
      time_rounds(args.rounds, "round")
      v = verdict(rounds["base"], rounds["candidate"], args.threshold)
      if not v["passed"] and confirm_rounds:
        first = v
        print(f"slower after {args.rounds} rounds: {', '.join(v['failed'])}; "
              f"{confirm_rounds} confirming rounds", flush=True)
        time_rounds(confirm_rounds, "confirming round")
        v = verdict(rounds["base"], rounds["candidate"], args.threshold)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
      print(str(e), file=sys.stderr)
      return 2
    date = datetime.datetime.now(datetime.timezone.utc)
    gpu = gpu_name(info["candidate"]) if info["candidate"]["platform"] == "gpu" else "cpu"
    out = Path(args.out) if args.out else (
        ROOT / "benchmarks" / "results" / "gate" / f"{date:%Y-%m-%d}-{gpu_slug(gpu)}.json")
    shapes = shapes_for(args.smoke, head_dim[0] if isinstance(head_dim, tuple) else head_dim)
    if isinstance(head_dim, tuple):
      shapes["head_dims"] = [shapes_for(args.smoke, d)["head_dim"] for d in head_dim]
    result = dict(
        conditions=dict(
            date=date.isoformat(timespec="seconds"), gpu=gpu,
            jax=info["candidate"]["jax"], jaxlib=info["candidate"]["jaxlib"],
            base=dict(base_desc, kvax_plugin_file=info["base"]["kvax_plugin_file"]),
            candidate=dict(cand_desc, kvax_plugin_file=info["candidate"]["kvax_plugin_file"]),
            backend=args.backend, cases=args.cases, smoke=args.smoke, rounds=args.rounds,
            calls=args.calls, warmup_calls=WARMUP_CALLS, threshold=args.threshold,
            confirm_rounds=confirm_rounds,
            compilation_cache=cache is not None,
            shapes=dict(shapes, batch=1, seed=0),
            command="python -m benchmarks.gate " + " ".join(
                argv if argv is not None else sys.argv[1:])),
        wall_s=dict(wall, total=round(time.perf_counter() - t_start, 1)),
        rounds=rounds, ratios={k: c["ratio"] for k, c in v["cases"].items()}, verdict=v,
        # the verdict after --rounds alone, where it failed and confirming rounds followed
        first_verdict=first)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("\n" + table(v))
    print(f"wrote {out}")
    return 0 if v["passed"] else 1
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  raise SystemExit(main())
