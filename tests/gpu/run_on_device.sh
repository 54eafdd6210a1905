#!/usr/bin/env bash
# Run on a GPU machine through the device tool (the image lacks jax-triton / tokamax: carry .whl):
#   bash tests/gpu/run_on_device.sh tests      # GPU tests -> $OUT/gpu_tests.log
#   bash tests/gpu/run_on_device.sh bench ARGS # benchmark -> $OUT/bench.log (+ results files)
# Wheels come from `bash ../shared/gpu/wheels.sh .whl core bench`.
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
esac
