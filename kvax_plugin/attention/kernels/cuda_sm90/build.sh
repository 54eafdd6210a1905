#!/usr/bin/env bash
# Builds libkvax_sm90_bwd.so (the CUDA C++ fused backward, sm_90a) on the CPU machine: nvcc from
# the PyPI package nvidia-cuda-nvcc (CUDA 13), the XLA FFI headers from the project's jaxlib,
# cudart linked statically (the GPU image's driver is 580: CUDA 13.0). Prints ptxas's register /
# spill report (the point of building here: the register budget is checked before a GPU run).
# Needs nvidia-cuda-nvcc and nvidia-cuda-cccl (PyPI) in the same environment.
# Usage: bash kvax_plugin/attention/kernels/cuda_sm90/build.sh [NVCC]
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${1:-$(command -v nvcc || true)}
if [ -z "$NVCC" ]; then
  echo "build.sh: no nvcc; install one (python3 -m pip install 'nvidia-cuda-nvcc>=13'" \
       "nvidia-cuda-cccl) and pass its bin/nvcc" >&2
  exit 1
fi
ROOT=$(cd ../../../.. && pwd)
FFI=$("$ROOT/.venv/bin/python" -c "import jax.ffi; print(jax.ffi.include_dir())")
rm -f libkvax_sm90_bwd.so  # a failed build must not leave an old one behind
"$NVCC" -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --shared -Xcompiler -fPIC \
  -cudart static -Xptxas -v -I"$FFI" fused_backward.cu -o libkvax_sm90_bwd.so 2>&1 \
  | grep -v "api.h\|control reaches\|^ *[0-9]* | \|^ *| *\^\|In function" || true
ls -la libkvax_sm90_bwd.so
