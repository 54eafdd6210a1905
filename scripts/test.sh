#!/usr/bin/env bash
# The test command: set up (idempotent) and run the CPU test suites. Extra args go to pytest.
# Two environments: .venv (everything but Levanter) and .venv-levanter (integration/levanter,
# which cannot share an environment with MaxText). Without args both suites run; with args,
# paths under integration/levanter run in .venv-levanter and anything else in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
levanter_suite() {
  bash scripts/bootstrap_levanter.sh
  # --confcutdir: integration/conftest.py (MaxText's) is not this suite's.
  .venv-levanter/bin/python -m pytest -q --confcutdir=integration/levanter "$@"
}
if [ $# -eq 0 ]; then
  bash scripts/bootstrap.sh
  .venv/bin/python -m pytest -q
  levanter_suite integration/levanter
elif printf '%s\n' "$@" | grep -q '^integration/levanter'; then
  levanter_suite "$@"
else
  bash scripts/bootstrap.sh
  exec .venv/bin/python -m pytest -q "$@"
fi
