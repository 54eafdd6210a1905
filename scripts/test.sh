#!/usr/bin/env bash
# The test command: set up (idempotent) and run the CPU test suites. Extra args go to pytest.
# Two environments: .venv (everything but Levanter) and .venv-levanter (integration/levanter,
# which cannot share an environment with MaxText). Without args both suites run (.venv-levanter
# is set up in the background while the first suite runs); with args, paths under
# integration/levanter run in .venv-levanter and anything else in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
# --confcutdir: integration/conftest.py (MaxText's) is not the Levanter suite's.
levanter_pytest() { .venv-levanter/bin/python -m pytest -q --confcutdir=integration/levanter "$@"; }
if [ $# -eq 0 ]; then
  bash scripts/bootstrap.sh
  log=$(mktemp)
  bash scripts/bootstrap_levanter.sh >"$log" 2>&1 &
  setup=$!
  status=0
  .venv/bin/python -m pytest -q || status=$?
  if ! wait "$setup"; then
    cat "$log" >&2; echo "test.sh: setting up .venv-levanter failed (above)" >&2; exit 1
  fi
  rm -f "$log"
  levanter_pytest integration/levanter || status=$?
  exit "$status"
elif printf '%s\n' "$@" | grep -q '^integration/levanter'; then
  bash scripts/bootstrap_levanter.sh
  levanter_pytest "$@"
else
  bash scripts/bootstrap.sh
  exec .venv/bin/python -m pytest -q "$@"
fi
