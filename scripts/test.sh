#!/usr/bin/env bash
# The test command: set up (idempotent) and run the CPU test suites. Extra args go to pytest.
# Two environments: .venv (everything but Levanter) and .venv-levanter (integration/levanter,
# which cannot share an environment with MaxText). Without args the suites run in two lines, one
# per core (CI has 2): tests/ (8 simulated CPU devices, tests/conftest.py) in the foreground;
# in the background integration/ (MaxText, one CPU device), then integration/levanter in
# .venv-levanter (set up meanwhile), then the programs of $moved (subprocess and end-to-end runs,
# moved there to balance the lines). The background output is printed when it is done; each
# suite ends with its slowest tests. Timings by line and file, and what was tried to cut them:
# docs/testing.md. With args, paths under integration/levanter run in .venv-levanter and
# anything else in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
# --confcutdir: integration/conftest.py (MaxText's) is not the Levanter suite's.
levanter_pytest() { .venv-levanter/bin/python -m pytest -q --confcutdir=integration/levanter "$@"; }
slowest="--durations=12"
if [ $# -eq 0 ]; then
  bash scripts/bootstrap.sh
  moved="tests/test_benchmark_programs.py tests/test_launch.py tests/test_triton_interpret.py"
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
  (
    bash scripts/bootstrap_levanter.sh >"$logs/setup" 2>&1 &
    setup=$!
    status=0
    .venv/bin/python -m pytest -q "$slowest" integration || status=$?
    if ! wait "$setup"; then
      cat "$logs/setup"; echo "test.sh: setting up .venv-levanter failed (above)"; exit 1
    fi
    levanter_pytest "$slowest" integration/levanter || status=$?
    # shellcheck disable=SC2086  # several paths
    .venv/bin/python -m pytest -q "$slowest" $moved || status=$?
    exit "$status"
  ) >"$logs/background" 2>&1 &
  background=$!
  status=0
  ignore=(); for f in $moved; do ignore+=(--ignore="$f"); done
  .venv/bin/python -m pytest -q "$slowest" tests "${ignore[@]}" || status=$?
  wait "$background" || status=$?
  echo "=== integration/, integration/levanter and $moved (run alongside tests/) ==="
  cat "$logs/background"
  exit "$status"
elif printf '%s\n' "$@" | grep -q '^integration/levanter'; then
  bash scripts/bootstrap_levanter.sh
  levanter_pytest "$@"
else
  bash scripts/bootstrap.sh
  exec .venv/bin/python -m pytest -q "$@"
fi
