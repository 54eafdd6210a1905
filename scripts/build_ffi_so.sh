#!/usr/bin/env bash
# Builds an XLA FFI shared object for Hopper (sm_90a) on the CPU machine: nvcc from the PyPI
# packages nvidia-cuda-nvcc + nvidia-cuda-cccl (CUDA 13), the XLA FFI headers from the project's
# jaxlib (.venv), cudart linked statically (the GPU image's driver is 580: CUDA 13.0). Prints
# ptxas's register / spill report, the point of building here: a kernel's register budget is
# checked before a GPU run. An old output is removed first, so a failed build leaves none.
# Usage: bash scripts/build_ffi_so.sh SOURCE.cu OUTPUT.so [NVCC]
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash scripts/build_ffi_so.sh SOURCE.cu OUTPUT.so [NVCC]" >&2
  exit 2
fi
SRC=$1 OUT=$2
NVCC=${3:-$(command -v nvcc || true)}
if [ -z "$NVCC" ]; then
  echo "build_ffi_so.sh: no nvcc; install one (python3 -m pip install 'nvidia-cuda-nvcc>=13'" \
       "nvidia-cuda-cccl) and pass its bin/nvcc" >&2
  exit 1
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FFI=$("$ROOT/.venv/bin/python" -c "import jax.ffi; print(jax.ffi.include_dir())")
rm -f "$OUT"
# the FFI headers' own warnings are dropped; ptxas's lines and any error stay
"$NVCC" -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --shared -Xcompiler -fPIC \
  -cudart static -Xptxas -v -I"$FFI" "$SRC" -o "$OUT" 2>&1 \
  | grep -v "api.h\|ffi.h\|control reaches\|^ *[0-9]* | \|^ *| *\^\|In function\|^ *^$\|^$" \
  || true
ls -la "$OUT"
