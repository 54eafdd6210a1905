"""Integration tests against upstream MaxText (marked `maxtext`).

They need the [maxtext] extra (scripts/bootstrap.sh installs it). Where it is missing they
are reported as skipped, except in CI or with KVAX_REQUIRE_MAXTEXT=1, where a missing MaxText
is an error: a skipped integration suite must never pass for a green one.

The in-process tests are written for one CPU device (the multi-device cases run their own
workers, test_maxtext_mesh.py); scripts/test.sh runs this suite in a process of its own for that.
Collected together with tests/ (whose conftest simulates 8 devices) they would run every model
on an 8-device fsdp mesh with 8x the batch: several times slower, and ~20 GiB at the peak. The
summary says so when it happens.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
