#!/usr/bin/env bash
# Levanter + kvax on one GPU (device tool), with .whl-levanter carried (scripts/levanter_gpu_wheels.sh):
#   bash integration/levanter/run_on_gpu.sh [gpu_levanter.py args]
# -> $OUT/levanter_gpu.json (parity float32, tokens/s kvax vs jax_flash at 16k) and $OUT/levanter_gpu.log
# With the device tool, .whl-levanter (about 54 MB) plus the tracked tree (about 12 MB, 9 of them
# benchmarks/results) passes its 64 MiB limit: leave benchmarks/results out of the copy for the run.
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${LEVANTER_WHEELS:-.whl-levanter}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-levanter "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site-levanter:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  python3 -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/levanter_gpu.log"
timeout "${LEVANTER_TIMEOUT:-230}" python3 integration/levanter/gpu_levanter.py \
  --out "$OUT/levanter_gpu.json" "$@" 2>&1 | grep -v '^\[transformers\] PyTorch' | tee -a "$OUT/levanter_gpu.log"
