#!/usr/bin/env bash
# Run on a GPU machine through the device tool (the image lacks jax-triton / tokamax: carry .whl):
#   bash tests/gpu/run_on_device.sh tests      # GPU tests -> $OUT/gpu_tests.log
#   bash tests/gpu/run_on_device.sh bench ARGS # benchmark -> $OUT/bench.log (+ results files)
#   bash tests/gpu/run_on_device.sh e2e ARGS   # benchmarks/maxtext_e2e.py -> $OUT/e2e/ + e2e.log
#   bash tests/gpu/run_on_device.sh compile ARGS  # benchmarks/kernel_compile_time.py -> $OUT/
# Wheels come from `bash ../shared/gpu/wheels.sh .whl core bench` (e2e: `.whl core maxtext`).
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=$1; shift
case $what in
  tests)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu_tests.log"
    python3 -c "import jax, triton, jax_triton; print('jax', jax.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__)" 2>&1 | tee -a "$OUT/gpu_tests.log"
    timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider "$@" 2>&1 | tee -a "$OUT/gpu_tests.log"
    ;;
  bench)
    timeout "${BENCH_TIMEOUT:-500}" python3 benchmarks/bench_attention.py --out "$OUT/bench_attention" "$@" 2>&1 | tee "$OUT/${BENCH_LOG:-bench}.log"
    ;;
  e2e)
    # Summaries and logs only: the runs' caches and TensorBoard files stay on the machine.
    timeout "${E2E_TIMEOUT:-540}" python3 benchmarks/maxtext_e2e.py --out_dir /tmp/e2e "$@" 2>&1 | tee "$OUT/e2e.log"; status=${PIPESTATUS[0]}
    mkdir -p "$OUT/e2e" && cp /tmp/e2e/e2e.json /tmp/e2e/e2e.png "$OUT/e2e/" 2>/dev/null
    for d in /tmp/e2e/*/; do [ -f "$d/summary.json" ] && cp "$d/summary.json" "$OUT/e2e/$(basename "$d").summary.json"; done
    exit "$status"
    ;;
  compile)
    timeout "${COMPILE_TIMEOUT:-300}" python3 benchmarks/kernel_compile_time.py --out "$OUT/compile_time.json" "$@" 2>&1 | tee "$OUT/compile_time.log"
    ;;
esac
