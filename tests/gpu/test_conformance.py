"""The GPU conformance matrix (tests/conformance_cells.py): every cell a registered backend
accepts runs forward and backward through the public op against the float32 reference; every
cell it refuses must raise BackendUnavailableError naming why.

Runs only when a marker expression names it (it takes minutes, -m gpu alone skips it):
    python -m pytest -m "gpu and conformance" tests/gpu/test_conformance.py       # quick
    python -m pytest -m "gpu and conformance_full" tests/gpu/test_conformance.py  # full
or through scripts/test_gpu.sh [quick|full], which runs it in parallel shards and writes the
result JSON. Environment:
    KVAX_CONFORMANCE_JSONL=path   append one JSON record per cell (merged into the report by
                                  python tests/conformance_cells.py merge)
    KVAX_CONFORMANCE_SHARD=k/n    this process's share (whole compile groups, balanced)
    KVAX_CONFORMANCE_PART=k/n     a slice taken before sharding (a sweep split over calls)
    KVAX_CONFORMANCE_SEED=int     generator and input seed (default 0)
    KVAX_CONFORMANCE_SIZE=cpu     the CPU-sized cells on a machine without GPU (a dry run of the
                                  script's plumbing)
    KVAX_CONFORMANCE_STRICT=1     a cell the registry accepts and the backend then refuses
                                  ("refused_late": an explicit error, never a wrong answer, but a
                                  declaration that does not say all) fails too
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import conformance_cells as cc  # noqa: E402

_SIZE_ENV = os.environ.get("KVAX_CONFORMANCE_SIZE", "")
_SEED = int(os.environ.get("KVAX_CONFORMANCE_SEED", "0"))


def _gpu_reason() -> str:
  """Why the matrix cannot run here ("" when it can): it needs a GPU unless asked for the CPU
  sizes (where the GPU backends' cells record "unavailable")."""
  if _SIZE_ENV == "cpu":
    return ""
  import jax
  try:
    if any(d.platform == "gpu" for d in jax.devices()):
      return ""
  except RuntimeError:
    pass
  return f"no GPU visible to JAX (default backend: {jax.default_backend()})"


pytestmark = [pytest.mark.gpu]


def pytest_generate_tests(metafunc):
  """The cells as parameters. A marker expression without "conformance" (say -m gpu) gets one
  skipped placeholder: the matrix is minutes of GPU time, run on purpose."""
  if "cell" not in metafunc.fixturenames:
    return
  expr = metafunc.config.getoption("markexpr") or ""
  if "conformance" not in expr and not _SIZE_ENV:
    metafunc.parametrize("cell", [pytest.param(None, marks=pytest.mark.skip(
        reason='the conformance matrix runs with -m "gpu and conformance" (quick) or '
               '"gpu and conformance_full" (scripts/test_gpu.sh)'))], ids=["not_selected"])
    return
  size = _SIZE_ENV or ("full" if "conformance_full" in expr else "quick")
  cells = cc.generate(size, _SEED)
  cells = cc.select(cells, os.environ.get("KVAX_CONFORMANCE_PART"))
  cells = cc.select(cells, os.environ.get("KVAX_CONFORMANCE_SHARD"))
  params = []
  for cell in cells:
    # quick cells carry both markers (full includes them), the rest only conformance_full
    marks = [pytest.mark.conformance_full]
    if "quick" in cell.sizes or size == "cpu":
      marks.append(pytest.mark.conformance)
    params.append(pytest.param(cell, marks=marks, id=cell.id))
  metafunc.parametrize("cell", params)


def test_cell(cell):
  reason = _gpu_reason()
  if reason:
    pytest.skip(reason)
  record = cc.run_cell(cell, seed=_SEED)
  path = os.environ.get("KVAX_CONFORMANCE_JSONL")
  if path:
    # One line per cell as it finishes: a shard cut by its time limit still reports its cells.
    with open(path, "a") as f:
      f.write(json.dumps(record, default=str) + "\n")
  print(f"\n[{record['status']}] {cell.id} {record.get('errors', '')} "
        f"{record.get('reason', '')} {record.get('seconds')} s")
  assert record["status"] != cc.FAILED, record.get("error")
  if os.environ.get("KVAX_CONFORMANCE_STRICT") == "1":
    assert record["status"] != cc.REFUSED_LATE, (
        f"the registry accepted this cell, the backend refused it: {record.get('reason')}")
