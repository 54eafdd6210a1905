"""Integration tests against upstream MaxText (marked `maxtext`).

They need the [maxtext] extra (scripts/bootstrap.sh installs it). Where it is missing they
are reported as skipped, except in CI or with KVAX_REQUIRE_MAXTEXT=1, where a missing MaxText
is an error: a skipped integration suite must never pass for a green one.

The in-process tests are written for one CPU device (the multi-device cases run their own
workers, test_maxtext_mesh.py); scripts/test.sh runs this suite in a process of its own for that.
Collected together with tests/ (whose conftest simulates 8 devices) they would run every model
on an 8-device fsdp mesh with 8x the batch: several times slower, and ~20 GiB at the peak. The
summary says so when it happens.

Compilation is most of this suite's CPU time, so, for this process and the workers it starts
(they inherit the environment):
- XLA's CPU backend compiles at LLVM optimisation level 0, as tests/conftest.py explains (the
  numerics do not change; KVAX_TEST_XLA_OPT=default keeps the default level);
- one JAX persistent compilation cache for the whole test run (every program, however quick
  to compile: the workers' MaxText processes compile many of the same ones). MaxText would
  otherwise use ~/jax_cache, which outlives the run: a second run then compiles little and
  measures nothing of a fresh machine's run. The directory is a temporary one, removed at the
  end, unless KVAX_TEST_JAX_CACHE names one (kept: later runs start warm).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _add_xla_flag(flag: str) -> None:
  name = flag.split("=")[0]
  if name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


if os.environ.get("KVAX_TEST_XLA_OPT", "fast") != "default":
  _add_xla_flag("--xla_backend_optimization_level=0")
if not os.environ.get("KVAX_TEST_JAX_CACHE"):
  os.environ["KVAX_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="kvax_test_jax_cache_")
  atexit.register(shutil.rmtree, os.environ["KVAX_TEST_JAX_CACHE"], ignore_errors=True)
# Read by JAX when it is imported (here and in the workers); maxtext_harness.py and the worker
# command lines pass the directory to MaxText as jax_cache_dir, which MaxText sets in its turn.
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["KVAX_TEST_JAX_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
if "jax" in sys.modules:
  # Imported before this file, by tests/ collected in the same run: its config has read the
  # environment already. The directory is then set by MaxText (jax_cache_dir) when a test here
  # makes a config, so tests/ compiles nothing into it.
  import jax
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

HAVE_MAXTEXT = importlib.util.find_spec("maxtext") is not None
REQUIRE_MAXTEXT = os.environ.get("KVAX_REQUIRE_MAXTEXT") == "1" or os.environ.get("CI") == "true"

# Levanter's suite runs in its own environment (.venv-levanter, see scripts/test.sh).
collect_ignore = ["levanter"]


def pytest_collection_modifyitems(config, items):
  del config
  if HAVE_MAXTEXT:
    return
  if REQUIRE_MAXTEXT:
    return  # _maxtext_required errors every test instead
  for item in items:
    if "maxtext" in item.keywords:
      item.add_marker(pytest.mark.skip(reason="needs the [maxtext] extra: "
                                              "KVAX_EXTRAS=dev,maxtext bash scripts/bootstrap.sh"))


@pytest.fixture(scope="session", autouse=True)
def _maxtext_required():
  if REQUIRE_MAXTEXT and not HAVE_MAXTEXT:
    pytest.fail("MaxText is not installed but required here (CI or KVAX_REQUIRE_MAXTEXT=1): "
                "install the [maxtext] extra", pytrace=False)


@pytest.fixture(scope="session")
def _uninstall_at_end():
  yield
  from kvax_plugin.integrations import maxtext as kvax_maxtext
  kvax_maxtext.uninstall()  # leave MaxText untouched for whatever runs after this suite


@pytest.fixture
def kvax_installed(_uninstall_at_end):
  """The plugin, installed (install() is idempotent; some tests uninstall it on purpose)."""
  from kvax_plugin.integrations import maxtext as kvax_maxtext
  kvax_maxtext.install()
  return kvax_maxtext


def pytest_terminal_summary(terminalreporter):
  jax = sys.modules.get("jax")
  if jax is not None and jax.device_count() > 1:
    terminalreporter.write_line(
        f"note: integration/ ran with {jax.device_count()} devices (collected with tests/?); "
        "its tests are written for one: run it on its own (scripts/test.sh does)", yellow=True)
  from maxtext_results import LINES
  if LINES:
    terminalreporter.section("MaxText integration results")
    for line in LINES:
      terminalreporter.write_line(line)
