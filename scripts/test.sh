#!/usr/bin/env bash
# The test command: set up (idempotent) and run the CPU test suites. Extra args go to pytest.
# Three environments: .venv (the pinned jax, everything but Levanter), .venv-levanter
# (integration/levanter, which cannot share an environment with MaxText) and .venv-jax-next (the
# newest jax setup.cfg accepts, constraints-jax-next.txt: the core suite $jax_next). Without args
# the suites run in two lines, one per core (CI has 2): tests/ (8 simulated CPU devices,
# tests/conftest.py) in the foreground; in the background integration/ (MaxText, one CPU device),
# then integration/levanter and the core suite on the newest jax (both set up meanwhile), then
# the programs of $moved (subprocess and end-to-end runs, moved there to balance the lines). The
# background output is printed when it is done; each suite ends with its slowest tests. Timings
# by line and file: docs/testing.md. With args, paths under integration/levanter run in
# .venv-levanter and anything else in .venv (KVAX_JAX=next: in .venv-jax-next).
set -euo pipefail
cd "$(dirname "$0")/.."
# --confcutdir: integration/conftest.py (MaxText's) is not the Levanter suite's.
levanter_pytest() { .venv-levanter/bin/python -m pytest -q --confcutdir=integration/levanter "$@"; }
slowest="--durations=12"
# The newest jax: the kernels in their interpreters (race detector included), the mask, the kvax
# API, errors, options, versions, and the wheel installed outside the tree (MaxText is not in
# that environment: its launcher test is deselected there, not skipped).
jax_next="tests/test_mosaic_races.py tests/test_kvax_migration.py tests/test_block_mask.py
  tests/test_errors.py tests/test_options.py tests/test_versions.py tests/test_installed_wheel.py"
bootstrap_jax_next() {
  KVAX_VENV=.venv-jax-next KVAX_CONSTRAINTS=constraints-jax-next.txt KVAX_EXTRAS=dev,triton \
    bash scripts/bootstrap.sh
}
if [ $# -eq 0 ]; then
  bash scripts/bootstrap.sh
  moved="tests/test_benchmark_programs.py tests/test_launch.py tests/test_triton_interpret.py
    tests/test_gate.py"
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
  (
    # Set up while both lines run: no byte-compiling ahead (KVAX_PRECOMPILE=0), the cores are
    # the tests'.
    KVAX_PRECOMPILE=0 bash scripts/bootstrap_levanter.sh >"$logs/setup" 2>&1 &
    setup=$!
    KVAX_PRECOMPILE=0 bootstrap_jax_next >"$logs/setup-jax-next" 2>&1 &
    setup_next=$!
    status=0
    .venv/bin/python -m pytest -q "$slowest" integration || status=$?
    if ! wait "$setup"; then
      cat "$logs/setup"; echo "test.sh: setting up .venv-levanter failed (above)"; exit 1
    fi
    levanter_pytest "$slowest" integration/levanter || status=$?
    if ! wait "$setup_next"; then
      cat "$logs/setup-jax-next"; echo "test.sh: setting up .venv-jax-next failed (above)"; exit 1
    fi
    echo "=== the core suite on $(.venv-jax-next/bin/python -c 'import jax; print("jax", jax.__version__)') ==="
    # shellcheck disable=SC2086  # several paths
    .venv-jax-next/bin/python -m pytest -q "$slowest" -m "not maxtext" $jax_next || status=$?
    # shellcheck disable=SC2086  # several paths
    .venv/bin/python -m pytest -q "$slowest" $moved || status=$?
    exit "$status"
  ) >"$logs/background" 2>&1 &
  background=$!
  status=0
  ignore=(); for f in $moved; do ignore+=(--ignore="$f"); done
  .venv/bin/python -m pytest -q "$slowest" tests "${ignore[@]}" || status=$?
  wait "$background" || status=$?
  echo "=== integration/, integration/levanter, the newest jax's core suite and $moved (run alongside tests/) ==="
  cat "$logs/background"
  exit "$status"
elif printf '%s\n' "$@" | grep -q '^integration/levanter'; then
  bash scripts/bootstrap_levanter.sh
  levanter_pytest "$@"
elif [ "${KVAX_JAX:-}" = next ]; then
  bootstrap_jax_next
  exec .venv-jax-next/bin/python -m pytest -q "$@"
else
  bash scripts/bootstrap.sh
  exec .venv/bin/python -m pytest -q "$@"
fi
