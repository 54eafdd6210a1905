#!/usr/bin/env bash
# Builds libkvax_probe.so for sm_90a on this (CPU) machine: nvcc from the PyPI package
# nvidia-cuda-nvcc (CUDA 13), the XLA FFI headers from the project's jaxlib, cudart linked
# statically (the GPU image's driver is 580: CUDA 13.0).
# Usage: bash scripts/ffi_probe/build.sh [NVCC]
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${1:-$(command -v nvcc || true)}
if [ -z "$NVCC" ]; then
  echo "build.sh: no nvcc; install one (python3 -m pip install 'nvidia-cuda-nvcc>=13') and pass" \
       "its bin/nvcc" >&2
  exit 1
fi
FFI=$(../../.venv/bin/python -c "import jax.ffi; print(jax.ffi.include_dir())")
"$NVCC" -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --shared -Xcompiler -fPIC \
  -cudart static -Xptxas -v -I"$FFI" probe.cu -o libkvax_probe.so
ls -la libkvax_probe.so
