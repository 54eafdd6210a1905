#!/usr/bin/env bash
# Builds an XLA FFI shared object for Hopper (sm_90a) on the CPU machine with the project's
# .venv: kvax_plugin/attention/kernels/cuda_sm90/build.py holds the nvcc lookup and flags (nvcc 13
# from PyPI, the jaxlib FFI headers, cudart static) and prints ptxas's register / spill report.
# Usage: bash scripts/build_ffi_so.sh SOURCE.cu OUTPUT.so [NVCC]
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash scripts/build_ffi_so.sh SOURCE.cu OUTPUT.so [NVCC]" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
OUT=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m kvax_plugin.attention.kernels.cuda_sm90.build \
  --source "$SRC" --out "$OUT" ${3:+--nvcc "$3"}
