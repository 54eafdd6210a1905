"""kvax 0.1.0's own test suite, run against kvax_plugin: an outside check of the drop-in claim.

kvax's tests are not copied into this repository. `prepare` takes them from a copy of kvax
(github:nebius/kvax as a bare git dir, a checked-out tree, or an sdist .tar.gz) into the
git-ignored folder .kvax_suite/, and rewrites every `from kvax... import` name for name: kvax's
op and its public helpers go to kvax_plugin.ops / kvax_plugin.utils (table below), kvax's own test
helpers (its cuDNN reference, input generators, output checks) stay kvax's and are copied too.
`run` runs pytest there and writes a short JSON result. Nothing in .kvax_suite/ is ours except
the files this program writes itself (package stubs, a spec bridge, a JAX shim, conftest.py).

    # once, here (the fetch tool gives /work/.mirror/nebius+kvax/repo for github:nebius/kvax)
    .venv/bin/python scripts/kvax_suite.py prepare /work/.mirror/nebius+kvax/repo --rev v0.1.0

    # CPU (2 cores, 24 GiB), as recorded in tests/outside/kvax_0.1.0_suite_cpu_2026-11-26.json:
    # 8 simulated devices (the suite shards over all devices) for the op's cases, leaving out the
    # 30 at 32k tokens with head dim 128 (--cpu-subset: hours here); one device for the 6
    # test_attention_mask cases, whose reference is a dense [2, 32k, 32k] mask (~15 GB; with 8
    # devices its eager ops run on every device and the process is killed). Pytest args after --.
    .venv/bin/python scripts/kvax_suite.py run --cpu-subset --out /tmp/op.json \
      -- -k "not test_attention_mask"
    .venv/bin/python scripts/kvax_suite.py run --cpu-devices 1 --out /tmp/mask.json \
      -- -k test_attention_mask
    .venv/bin/python scripts/kvax_suite.py merge /tmp/op.json /tmp/mask.json --out OUT.json

    # 4 GPUs through the device tool (no network there): carry .whl (jax-triton, from
    # `bash ../shared/gpu/wheels.sh .whl core`) and .kvax_suite; kind nvidia-h100-x4:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site:$PWD \
      python3 scripts/kvax_suite.py run --timeout 540 --out $OUT/kvax_suite_gpu.json

    # if 540 s is not enough for all 91 cases: two calls, `-- -k "not context_parallelism"` and
    # `-- -k context_parallelism` (different --out names), then `merge` them here.

What `prepare` changes in kvax's files, and nothing else:
  * imports, name for name (MAP below); kvax's per-view `AttentionMask` (four bound arrays) is
    kvax_plugin.ops.BlockTable, as kvax_plugin's AttentionMask is the whole mask;
  * kvax/utils/specs.py is replaced by a bridge: kvax's helpers read the specs of
    kvax_plugin.utils.attention_specs (the context the rewritten tests enter);
  * two JAX-version shims: jax.experimental.shard_map.Specs and jax.sharding.PositionalSharding
    are gone from JAX 0.11 (a NamedSharding stand-in places arrays the same way);
  * the reference's `implementation="cudnn"` reads `run --reference`: auto (the default) keeps
    cuDNN on GPUs and uses XLA's dot_product_attention elsewhere (cuDNN does not exist on CPU).
`run` records the reference it used, the devices, the JAX version and, per failing test, one line
(exception, file:line). --timeout stops pytest and records what ran; tests never reached count as
not_run.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEST = os.path.join(ROOT, ".kvax_suite")

# kvax name (imported from any kvax module) -> (kvax_plugin module, our name).
MAP = {
    "flash_attention_triton": ("kvax_plugin.ops", "flash_attention"),
    "flash_attention": ("kvax_plugin.ops", "flash_attention"),
    "create_attention_mask": ("kvax_plugin.ops", "create_attention_mask"),
    "print_mask": ("kvax_plugin.ops", "print_mask"),
    "calculate_mask_sparsity": ("kvax_plugin.ops", "calculate_mask_sparsity"),
    "AttentionMask": ("kvax_plugin.ops", "BlockTable"),
    "PADDING_SEGMENT_ID": ("kvax_plugin.utils", "PADDING_SEGMENT_ID"),
    "FlashAttentionParamsConfig": ("kvax_plugin.utils", "FlashAttentionParamsConfig"),
    "attention_specs": ("kvax_plugin.utils", "attention_specs"),
    "permute_tokens_context_parallelism": ("kvax_plugin.utils",
                                           "permute_tokens_context_parallelism"),
    "unpermute_tokens_context_parallelism": ("kvax_plugin.utils",
                                             "unpermute_tokens_context_parallelism"),
}
# kvax's test helpers, copied as they are (imports rewritten). kvax's implementation modules
# (ops/flash_attention_triton.py, ops/mask_creator.py, utils/permutation.py) are not copied: a
# name the map misses fails at import instead of running kvax's code.
HELPERS = ["kvax/ops/flash_attention_cudnn.py", "kvax/utils/benchmarking.py",
           "kvax/utils/common.py", "kvax/utils/sharding.py", "kvax/utils/typing.py",
           "kvax/utils/math.py"]
# (file, old text, new text): the JAX-version shims and the reference switch. Each must match.
EDITS = [
    ("kvax/utils/typing.py", "Specs = jax.experimental.shard_map.Specs",
     "Specs = getattr(jax.experimental.shard_map, 'Specs', object)  # kvax_suite: not in JAX 0.11"),
    ("kvax/utils/benchmarking.py", "from jax.sharding import Mesh, PositionalSharding",
     "from jax.sharding import Mesh\n"
     "from kvax._suite_compat import PositionalSharding  # kvax_suite: gone in JAX 0.11"),
    ("kvax/ops/flash_attention_cudnn.py", 'implementation="cudnn",',
     "implementation=_suite_compat.reference_implementation(),  # kvax_suite: run --reference"),
    ("kvax/ops/flash_attention_cudnn.py", "from jax.sharding import Mesh\n",
     "from jax.sharding import Mesh\n\nfrom kvax import _suite_compat\n"),
]
# The cases at 32k tokens with head dim 128: hours on 2 CPU cores (and the long-context cases'
# reference needs a dense 32k x 32k score matrix per head). test_attention_mask (32k, mask only)
# stays in.
HEAVY = ["test_flash_multi_head_attention_params_on_long_context",
         "test_flash_multi_head_attention_params_context_parallelism_fwd",
         "test_flash_multi_head_attention_params_context_parallelism_bwd"]

_STUB = '"""Written by scripts/kvax_suite.py: kvax\'s test helpers only (no op here)."""\n'

_SPECS_BRIDGE = '''"""Written by scripts/kvax_suite.py in place of kvax's specs module.

kvax's helpers (its cuDNN reference, get_query_context_mesh_axis_size) read the query / kv specs
of the surrounding attention_specs context; the rewritten tests enter kvax_plugin's, so this
module reads that one and hands the specs back in kvax's form (an axis name, a tuple or None).
"""

import dataclasses
import enum

from kvax_plugin.attention.specs import current_attention_specs
from kvax_plugin.utils import attention_specs  # noqa: F401  (kvax's name, kvax_plugin's context)


class Axes(enum.IntEnum):
  batch = 0
  query_sequence = 1
  kv_sequence = 1
  heads = 2
  kv_heads = 2
  head_dim = 3


@dataclasses.dataclass
class AttentionSpecs:
  query_specs: tuple | None = None
  kv_specs: tuple | None = None


def _entry(axes):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def get_attention_specs() -> AttentionSpecs:
  specs = current_attention_specs()
  if specs is None:
    raise ValueError("no attention_specs context (kvax_plugin.utils.attention_specs)")
  q, kv = specs
  if kv is None:  # kvax_plugin: kv_specs omitted = (query batch, None, query heads, None)
    kv = (q[0], (), q[2], ())
  return AttentionSpecs(tuple(_entry(a) for a in q), tuple(_entry(a) for a in kv))
'''

_COMPAT = '''"""Written by scripts/kvax_suite.py: what kvax 0.1.0's helpers need of current JAX."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

REFERENCE = "auto"  # set by conftest.py from `run --reference`


def reference_implementation() -> str:
  """jax.nn.dot_product_attention's implementation for kvax's reference."""
  if REFERENCE != "auto":
    return REFERENCE
  return "cudnn" if jax.default_backend() == "gpu" else "xla"


class _Placed(NamedSharding):
  """PositionalSharding's two methods kvax's input helpers call."""

  def replicate(self):
    return _Placed(self.mesh, PartitionSpec())

  def reshape(self, *shape):
    if self.spec != PartitionSpec():
      raise NotImplementedError("kvax_suite shim: reshape of a non-replicated sharding")
    return self


try:
  from jax.sharding import PositionalSharding  # noqa: F401  (JAX before 0.6)
except ImportError:
  def PositionalSharding(devices):  # noqa: N802  (kvax's name)
    """Array dimension i split over devices.shape[i], as PositionalSharding placed it."""
    devices = np.asarray(devices)
    names = tuple(f"pos{i}" for i in range(devices.ndim))
    return _Placed(Mesh(devices, names), PartitionSpec(*names))
'''

_CONFTEST = '''"""By scripts/kvax_suite.py: `run`'s options and the per-test log it reads."""

import json

import pytest

from kvax import _suite_compat


def pytest_addoption(parser):
  parser.addoption("--kvax-reference", default="auto", choices=("auto", "cudnn", "xla"))
  parser.addoption("--kvax-log", default=None)


_LOG = []


def pytest_configure(config):
  _suite_compat.REFERENCE = config.getoption("--kvax-reference")
  _LOG[:] = [config.getoption("--kvax-log")]


def _log(record):
  if _LOG and _LOG[0]:
    with open(_LOG[0], "a") as f:
      f.write(json.dumps(record) + "\\n")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: every case of the suite
def pytest_collection_modifyitems(config, items):
  _log({"collected": [item.nodeid for item in items]})


def pytest_deselected(items):
  _log({"deselected": [item.nodeid for item in items]})


def _reason(report):
  crash = getattr(report.longrepr, "reprcrash", None)
  if crash is not None:
    lines = (crash.message or "").strip().splitlines() or [""]
    return f"{lines[0][:240]} ({crash.path.rsplit('/', 1)[-1]}:{crash.lineno})"
  if isinstance(report.longrepr, tuple):  # skips: (path, line, message)
    return str(report.longrepr[2])[:240]
  return str(report.longrepr).strip().splitlines()[-1][:240] if report.longrepr else ""


def pytest_runtest_logstart(nodeid, location):
  _log({"id": nodeid, "when": "start", "outcome": "started", "duration_s": 0.0})


def pytest_runtest_logreport(report):
  record = {"id": report.nodeid, "when": report.when, "outcome": report.outcome,
            "duration_s": round(report.duration, 3)}
  if report.outcome != "passed":
    record["reason"] = _reason(report)
  _log(record)
'''


# ----------------------------------------------------------------------------- reading kvax


def _reader(source: str, rev: str):
  """(list of paths, read(path) -> text, description) for a git dir, a tree or an sdist."""
  if os.path.isfile(source) and source.endswith((".tar.gz", ".tgz")):
    with tarfile.open(source) as tar:
      members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode()
                 for m in tar.getmembers() if m.isfile() and "/" in m.name}
    return sorted(members), members.__getitem__, {"source": source}
  git_dir = None
  if os.path.isdir(os.path.join(source, "objects")) and os.path.isfile(
      os.path.join(source, "HEAD")):
    git_dir = source  # bare
  if git_dir is not None:
    git = ["git", "--git-dir", git_dir]
    commit = subprocess.check_output(git + ["rev-parse", f"{rev}^{{commit}}"], text=True).strip()
    paths = subprocess.check_output(git + ["ls-tree", "-r", "--name-only", commit],
                                    text=True).split()
    read = lambda p: subprocess.check_output(git + ["show", f"{commit}:{p}"], text=True)  # noqa
    return paths, read, {"source": source, "rev": rev, "commit": commit}
  if os.path.isdir(source):
    paths = [os.path.relpath(os.path.join(d, f), source).replace(os.sep, "/")
             for d, _, files in os.walk(source) if "/.git" not in d for f in files]

    def read(p):
      with open(os.path.join(source, p)) as f:
        return f.read()
    return sorted(paths), read, {"source": source}
  raise SystemExit(f"{source}: not a git dir, a kvax tree or an sdist .tar.gz")


def rewrite_imports(text: str, path: str, copied: set[str]) -> tuple[str, list[str]]:
  """`from kvax... import` statements rewritten name for name; returns (text, changes)."""
  tree = ast.parse(text, path)
  lines = text.splitlines(keepends=True)
  edits, changes = [], []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "kvax" for a in node.names):
      raise SystemExit(f"{path}:{node.lineno}: `import kvax...` is not handled; extend MAP")
    if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] == "kvax"):
      continue
    indent = " " * node.col_offset
    keep, moved = [], {}
    for alias in node.names:
      local = alias.asname or alias.name
      if alias.name in MAP:
        module, ours = MAP[alias.name]
        moved.setdefault(module, []).append(ours if ours == local else f"{ours} as {local}")
        changes.append(f"{node.module}.{alias.name} -> {module}.{ours}")
      else:
        keep.append(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")
    module_file = node.module.replace(".", "/") + ".py"
    if keep and module_file not in copied and not all(
        f"{module_file[:-3]}/{name.split()[0]}.py" in copied for name in keep):
      raise SystemExit(f"{path}:{node.lineno}: {keep} from {node.module}, kvax's implementation: "
                       "add them to MAP")
    new = [f"{indent}from {node.module} import {', '.join(keep)}\n"] if keep else []
    new += [f"{indent}from {m} import {', '.join(names)}\n" for m, names in moved.items()]
    edits.append((node.lineno - 1, node.end_lineno, new))
  for start, end, new in sorted(edits, reverse=True):
    lines[start:end] = new
  return "".join(lines), changes


def prepare(source: str, rev: str, dest: str) -> dict:
  paths, read, origin = _reader(source, rev)
  tests = [p for p in paths if p.startswith("tests/") and p.endswith(".py")]
  if not tests:
    raise SystemExit(f"{source}: no tests/*.py (PyPI's kvax 0.1.0 sdist ships none: use the "
                     "git repository)")
  missing = [p for p in HELPERS if p not in paths]
  if missing:
    raise SystemExit(f"{source}: no {missing}")
  if os.path.isdir(dest):
    shutil.rmtree(dest)
  files = {}
  copied = set(HELPERS) | {"kvax/utils/specs.py", "kvax/_suite_compat.py"}
  texts = {p: read(p) for p in HELPERS + tests}
  for p, old, new in EDITS:
    if texts[p].count(old) != 1:
      raise SystemExit(f"{p}: expected one {old!r} to edit (another kvax version?)")
    texts[p] = texts[p].replace(old, new)
  all_changes = {}
  for p, text in texts.items():
    text, changes = rewrite_imports(text, p, copied)
    header = (f"# From kvax {origin.get('rev', '')} ({origin['source']}: {p}), copied by "
              "scripts/kvax_suite.py; imports rewritten onto kvax_plugin.\n")
    files[p] = header + text
    all_changes[p] = changes
  files.update({"kvax/__init__.py": _STUB, "kvax/ops/__init__.py": _STUB,
                "kvax/utils/__init__.py": _STUB, "kvax/utils/specs.py": _SPECS_BRIDGE,
                "kvax/_suite_compat.py": _COMPAT, "conftest.py": _CONFTEST,
                "pytest.ini": "[pytest]\naddopts = -p no:cacheprovider\n"})
  for p, text in files.items():
    os.makedirs(os.path.dirname(os.path.join(dest, p)), exist_ok=True)
    with open(os.path.join(dest, p), "w") as f:
      f.write(text)
  manifest = {**origin, "tests": tests, "helpers": HELPERS, "rewritten": all_changes,
              "sha256": {p: hashlib.sha256(t.encode()).hexdigest()[:16]
                         for p, t in sorted(files.items())}}
  with open(os.path.join(dest, "SOURCE.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  return manifest


# ----------------------------------------------------------------------------- running


def _environment(python: str, env: dict) -> dict:
  probe = ("import json, jax, jaxlib; d = jax.devices(); print(json.dumps({'jax': jax.__version__,"
           " 'jaxlib': jaxlib.__version__, 'backend': jax.default_backend(), 'devices': "
           "{'count': len(d), 'kinds': sorted({x.device_kind for x in d})}}))")
  out = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True)
  try:
    return json.loads(out.stdout.strip().splitlines()[-1])
  except (IndexError, json.JSONDecodeError):
    return {"probe_error": (out.stderr.strip().splitlines() or ["?"])[-1]}


def _git_commit() -> str | None:
  try:
    head = subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                   text=True, stderr=subprocess.DEVNULL).strip()
    dirty = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--", "kvax_plugin"],
                           stderr=subprocess.DEVNULL).returncode != 0
    return head + ("+uncommitted kvax_plugin changes" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return None


def summarise(log_lines: list[dict], exit_code: int | None) -> dict:
  collected, deselected, phases = [], set(), {}
  for rec in log_lines:
    if "collected" in rec:
      collected = rec["collected"]
    elif "deselected" in rec:
      deselected.update(rec["deselected"])
    else:
      phases.setdefault(rec["id"], []).append(rec)
  outcome, failed, skipped, durations = {}, [], [], {}
  for nodeid, recs in phases.items():
    bad = [r for r in recs if r["outcome"] == "failed"]
    if bad:
      outcome[nodeid] = "failed"
      failed.append({"id": nodeid, "reason": bad[0]["reason"],
                     **({"phase": bad[0]["when"]} if bad[0]["when"] != "call" else {})})
    elif any(r["outcome"] == "skipped" for r in recs):
      outcome[nodeid] = "skipped"
      skipped.append({"id": nodeid, "reason": next(r["reason"] for r in recs
                                                   if r["outcome"] == "skipped")})
    elif any(r["when"] == "call" for r in recs):
      outcome[nodeid] = "passed"
    elif exit_code is not None and exit_code < 0:  # started, never reported: pytest died here
      outcome[nodeid] = "failed"
      failed.append({"id": nodeid, "reason": f"the pytest process died here (signal "
                     f"{-exit_code}{': killed, e.g. out of memory' if exit_code == -9 else ''})"})
    durations[nodeid] = round(sum(r["duration_s"] for r in recs), 1)
  ran = [n for n in collected if n not in deselected]
  by_function = {}
  for n in ran:
    row = by_function.setdefault(n.split("::")[-1].split("[")[0], {})
    key = outcome.get(n, "not_run")
    row[key] = row.get(key, 0) + 1
  counts = {"cases": len(collected), "deselected": len(deselected)}
  for key in ("passed", "failed", "skipped"):
    counts[key] = sum(1 for n in ran if outcome.get(n) == key)
  counts["not_run"] = sum(1 for n in ran if n not in outcome)
  # durations_s also names a test that a timeout cut after its setup: only `passed` says which
  # tests passed.
  return {"counts": counts, "by_function": by_function,
          "passed": [n for n in ran if outcome.get(n) == "passed"], "failed": failed,
          "skipped": skipped, "durations_s": durations}


def run(args, pytest_args: list[str]) -> int:
  if not os.path.isfile(os.path.join(args.dest, "SOURCE.json")):
    raise SystemExit(f"{args.dest}: run `prepare` first (or carry the folder)")
  with open(os.path.join(args.dest, "SOURCE.json")) as f:
    origin = json.load(f)
  env = dict(os.environ)
  flag = f"--xla_force_host_platform_device_count={args.cpu_devices}"
  if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()  # CPU only; GPUs unaffected
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  log_path = os.path.join(args.dest, "results.jsonl")
  if os.path.exists(log_path):
    os.remove(log_path)
  extra = []
  if args.cpu_subset:  # one -k (pytest keeps only the last): joined with the caller's
    keyword = " and ".join(f"not {name}" for name in HEAVY)
    for i, a in enumerate(pytest_args[:-1]):
      if a == "-k":
        keyword, pytest_args = (f"({pytest_args[i + 1]}) and {keyword}",
                                pytest_args[:i] + pytest_args[i + 2:])
        break
    extra += ["-k", keyword]
  cmd = [args.python, "-m", "pytest", "-c", os.path.join(args.dest, "pytest.ini"),
         "--rootdir", args.dest, "-v", "-rfE", "--kvax-reference", args.reference,
         "--kvax-log", log_path, *extra, *pytest_args, os.path.join(args.dest, "tests")]
  print("+", " ".join(cmd), flush=True)
  start = time.time()
  proc = subprocess.Popen(cmd, cwd=args.dest, env=env, process_group=0)
  try:
    rc = proc.wait(timeout=args.timeout)
    timed_out = False
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
      proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    rc, timed_out = None, True
  wall = time.time() - start
  records = []
  if os.path.exists(log_path):
    with open(log_path) as f:
      records = [json.loads(line) for line in f if line.strip()]
  environment = _environment(args.python, env)
  result = {
      "what": "kvax's own tests (tests/test_attention.py) against kvax_plugin, imports "
              "rewritten by scripts/kvax_suite.py",
      "date": datetime.date.today().isoformat(),
      "kvax": {k: origin.get(k) for k in ("source", "rev", "commit")},
      "kvax_plugin": _git_commit(),
      **environment,
      "reference": args.reference if args.reference != "auto" else (
          "cudnn" if environment.get("backend") == "gpu" else "xla"),
      "pytest_args": extra + pytest_args,
      "pytest_exit_code": rc, "timed_out": timed_out, "wall_s": round(wall, 1),
      **summarise(records, rc),
      "notes": list(args.note),
  }
  _write(result, args.out)
  return 0 if rc == 0 else 1


def _write(result: dict, out: str | None) -> None:
  text = json.dumps(result, indent=1)
  print(json.dumps(result["counts"]))
  for f in result["failed"]:
    print(f"FAILED {f['id']}: {f['reason']}")
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      f.write(text + "\n")
    print("wrote", out)


def _passed_ids(path: str, run: dict) -> list[str]:
  """The ids that passed in one run's result. Results written before `passed` was recorded:
  the ids with durations that neither failed nor were skipped, less (in a run its timeout cut)
  the last one started, which the timeout stopped; checked against the run's own count."""
  if "passed" in run:
    return list(run["passed"])
  done = {f["id"] for f in run["failed"]} | {s["id"] for s in run["skipped"]}
  started = [n for n in run["durations_s"] if n not in done]
  if run["timed_out"] and started:
    started = started[:-1]
  if len(started) != run["counts"]["passed"]:
    raise SystemExit(f"{path}: {len(started)} tests look passed but the run counted "
                     f"{run['counts']['passed']}; run it again to record which passed")
  return started


def merge(paths: list[str], out: str | None, notes=()) -> int:
  """Results of runs over disjoint test selections, as one (the last run wins a repeated id)."""
  runs = []
  for p in paths:
    with open(p) as f:
      runs.append(json.load(f))
  merged = dict(runs[-1])
  ids = {}
  for p, r in zip(paths, runs):
    for f in r["failed"]:
      ids[f["id"]] = ("failed", f)
    for s in r["skipped"]:
      ids[s["id"]] = ("skipped", s)
    for n in _passed_ids(p, r):
      ids[n] = ("passed", None)
  merged["failed"] = [v for k, v in ids.values() if k == "failed"]
  merged["skipped"] = [v for k, v in ids.values() if k == "skipped"]
  merged["durations_s"] = {k: v for r in runs for k, v in r["durations_s"].items()}
  merged["counts"] = {"cases": max(r["counts"]["cases"] for r in runs)}
  for key in ("passed", "failed", "skipped"):
    merged["counts"][key] = sum(1 for k, _ in ids.values() if k == key)
  merged["counts"]["not_run"] = merged["counts"]["cases"] - len(ids)
  merged["by_function"] = {}
  for n, (k, _) in ids.items():
    row = merged["by_function"].setdefault(n.split("::")[-1].split("[")[0], {})
    row[k] = row.get(k, 0) + 1
  merged["passed"] = sorted(n for n, (k, _) in ids.items() if k == "passed")
  merged["runs"] = []
  for p, r in zip(paths, runs):
    if "runs" in r:  # an earlier merge: its runs, as they were recorded
      merged["runs"].extend(r["runs"])
    else:
      merged["runs"].append({"file": os.path.basename(p), **{k: r.get(k) for k in (
          "kvax_plugin", "devices", "reference", "pytest_args", "counts", "pytest_exit_code",
          "timed_out", "wall_s")}})
  for key in ("devices", "reference", "pytest_args", "pytest_exit_code"):
    merged.pop(key, None)
  merged["notes"] = [n for r in runs for n in r.get("notes", [])] + list(notes)
  merged["wall_s"] = round(sum(r["wall_s"] for r in runs), 1)
  merged["timed_out"] = any(r["timed_out"] for r in runs)
  _write(merged, out)
  return 0


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  pytest_args = []
  if "--" in argv:
    i = argv.index("--")
    argv, pytest_args = argv[:i], argv[i + 1:]
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("prepare", help="copy and rewrite kvax's tests into --dest")
  p.add_argument("source", help="kvax git dir (bare or not), kvax tree, or sdist .tar.gz")
  p.add_argument("--rev", default="v0.1.0", help="git revision (git sources only)")
  p.add_argument("--dest", default=DEST)
  r = sub.add_parser("run", help="run the prepared suite; pytest args after --")
  r.add_argument("--dest", default=DEST)
  r.add_argument("--out", default=None, help="JSON result path")
  r.add_argument("--reference", default="auto", choices=("auto", "cudnn", "xla"),
                 help="kvax's reference: auto = cuDNN on GPUs, XLA elsewhere")
  r.add_argument("--cpu-devices", type=int, default=8,
                 help="simulated CPU devices (XLA_FLAGS; no effect on GPUs)")
  r.add_argument("--cpu-subset", action="store_true",
                 help="leave out the 32k-token cases with head dim 128 (HEAVY)")
  r.add_argument("--timeout", type=float, default=None, help="stop pytest after this many s")
  r.add_argument("--python", default=sys.executable)
  r.add_argument("--note", action="append", default=[], help="a line kept in the JSON")
  m = sub.add_parser("merge", help="merge JSON results of runs over disjoint selections")
  m.add_argument("inputs", nargs="+")
  m.add_argument("--out", default=None)
  m.add_argument("--note", action="append", default=[], help="a line kept in the JSON")
  args = parser.parse_args(argv)
  if args.cmd == "prepare":
    manifest = prepare(args.source, args.rev, args.dest)
    print(f"prepared {args.dest} from {manifest['source']} {manifest.get('commit', '')}")
    for p, changes in manifest["rewritten"].items():
      print(f"  {p}: {len(changes)} names onto kvax_plugin")
    return 0
  if args.cmd == "merge":
    return merge(args.inputs, args.out, args.note)
  return run(args, pytest_args)


if __name__ == "__main__":
  sys.exit(main())
