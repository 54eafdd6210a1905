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
# the benchmark programs moved, 1718 s against 1468 s, of which test_launch.py ~107 s.
# Each line runs on its own half of the CPUs (taskset, where there are 2 or more): unpinned,
# XLA's thread pools of both lines time-share every core. Two test files side by side on 2 cores
# (2026-11-26): pinned 67.5 / 91.2 s wall against 71.6 / 102.3 s unpinned, 154 against 175 user
# CPU-s.
# With args, paths under integration/levanter run in .venv-levanter and anything else
# in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
# --confcutdir: integration/conftest.py (MaxText's) is not the Levanter suite's.
levanter_pytest() { .venv-levanter/bin/python -m pytest -q --confcutdir=integration/levanter "$@"; }
# cpus_half first|second: the CPU list of that half of this process's CPUs ("" if fewer than 2).
cpus_half() {
  local cpus n
  cpus=($(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)))'))
  n=${#cpus[@]}
  [ "$n" -ge 2 ] || return 0
  if [ "$1" = first ]; then cpus=("${cpus[@]:0:n/2}"); else cpus=("${cpus[@]:n/2}"); fi
  (IFS=,; echo "${cpus[*]}")
}
# pinned first|second CMD...: CMD on that half of the CPUs (as is without taskset or 2 CPUs).
pinned() {
  local half=$1 cpus; shift
  cpus=$(cpus_half "$half")
  if [ -n "$cpus" ] && command -v taskset >/dev/null; then taskset -c "$cpus" "$@"; else "$@"; fi
}
if [ $# -eq 0 ]; then
  bash scripts/bootstrap.sh
  moved="tests/test_benchmark_programs.py tests/test_launch.py"
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
  (
    bash scripts/bootstrap_levanter.sh >"$logs/setup" 2>&1 &
    setup=$!
    status=0
    pinned second .venv/bin/python -m pytest -q integration || status=$?
    if ! wait "$setup"; then
      cat "$logs/setup"; echo "test.sh: setting up .venv-levanter failed (above)"; exit 1
    fi
    pinned second .venv-levanter/bin/python -m pytest -q --confcutdir=integration/levanter \
      integration/levanter || status=$?
    # shellcheck disable=SC2086  # two paths
    pinned second .venv/bin/python -m pytest -q $moved || status=$?
    exit "$status"
  ) >"$logs/background" 2>&1 &
  background=$!
  status=0
  ignore=(); for f in $moved; do ignore+=(--ignore="$f"); done
  pinned first .venv/bin/python -m pytest -q tests "${ignore[@]}" || status=$?
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
