"""Integration tests against Levanter (marin-levanter), run in .venv-levanter (scripts/test.sh).

Four simulated CPU devices for the mesh tests: XLA reads the flag when its CPU backend starts,
so it is set here, before anything imports jax. Float32 matmuls run at full precision on CPU.
XLA's CPU backend compiles at LLVM optimisation level 0, as tests/conftest.py explains: these
tests are mostly compilation (small models, one forward + backward each), which -O0 makes ~1.5x
faster, and the numerics do not change (KVAX_TEST_XLA_OPT=default keeps the default level).
"""

from __future__ import annotations

import os
import sys


def _add_xla_flag(flag: str) -> None:
  name = flag.split("=")[0]
  if name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


_add_xla_flag("--xla_force_host_platform_device_count=4")
if os.environ.get("KVAX_TEST_XLA_OPT", "fast") != "default":
  _add_xla_flag("--xla_backend_optimization_level=0")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402


# kvax blocks of 16 tokens: the tests' short rows (48 / 64 tokens) then span several blocks, so
# full, partial and skipped blocks all occur.
TEST_BLOCK = 16


@pytest.fixture(scope="session")
def kvax_levanter():
  """The plugin, installed for the whole test run (kernel "auto", blocks of TEST_BLOCK), then removed."""
  from kvax_plugin.integrations import levanter as kvax_levanter
  kvax_levanter.install(settings=kvax_levanter.KvaxLevanterSettings(block_size=TEST_BLOCK))
  yield kvax_levanter
  kvax_levanter.uninstall()


@pytest.fixture
def seam_counts(kvax_levanter):
  """seam.TRACE_COUNTS, zeroed (what the seam did while tracing, per test)."""
  from kvax_plugin.integrations.levanter import seam
  for k in seam.TRACE_COUNTS:
    seam.TRACE_COUNTS[k] = 0
  seam.SHARDED_SPECS.clear()
  return seam.TRACE_COUNTS
