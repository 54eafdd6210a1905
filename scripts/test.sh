#!/usr/bin/env bash
# The test command: set up (idempotent) and run the CPU test suites. Extra args go to pytest.
# Two environments: .venv (everything but Levanter) and .venv-levanter (integration/levanter,
# which cannot share an environment with MaxText). Without args, three suites run, each in its
# own process: tests/ (8 simulated CPU devices, tests/conftest.py) in the foreground, and in the
# background integration/ (MaxText; one CPU device, as its tests are written for: the mesh tests
# start their own multi-device workers) followed by integration/levanter in .venv-levanter (set
# up in the background too). On 2 cores the two lines of work use both; the background output is
# printed when it is done. The benchmark-program and launcher tests of tests/ (subprocess and
# end-to-end MaxText runs) go to the background line, after Levanter's, to balance the lines: on
# 2 cores (bash .ci/run, 2026-11-26) tests/ took 2006 s and integration/ + levanter 1356 s; with
# the benchmark programs moved, 1718 s against 1468 s, of which test_launch.py ~107 s. On
# 2026-11-27 (bash .ci/run, 1746 s in all) tests/ took 1613 s and the other line 1518 s, so
# test_triton_interpret.py (~45 s) moved too.
# The lines are not pinned to a core each: tried 2026-11-27 (taskset), tests/ took 1478 s
# against 1329 s unpinned, as it could no longer use the other core once that line was done.
# With args, paths under integration/levanter run in .venv-levanter and anything else
# in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
# --confcutdir: integration/conftest.py (MaxText's) is not the Levanter suite's.
levanter_pytest() { .venv-levanter/bin/python -m pytest -q --confcutdir=integration/levanter "$@"; }
if [ $# -eq 0 ]; then
  bash scripts/bootstrap.sh
  moved="tests/test_benchmark_programs.py tests/test_launch.py tests/test_triton_interpret.py"
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
  (
    bash scripts/bootstrap_levanter.sh >"$logs/setup" 2>&1 &
    setup=$!
    status=0
    .venv/bin/python -m pytest -q integration || status=$?
    if ! wait "$setup"; then
      cat "$logs/setup"; echo "test.sh: setting up .venv-levanter failed (above)"; exit 1
    fi
    levanter_pytest integration/levanter || status=$?
    # shellcheck disable=SC2086  # several paths
    .venv/bin/python -m pytest -q $moved || status=$?
    exit "$status"
  ) >"$logs/background" 2>&1 &
  background=$!
  status=0
  ignore=(); for f in $moved; do ignore+=(--ignore="$f"); done
  .venv/bin/python -m pytest -q tests "${ignore[@]}" || status=$?
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
