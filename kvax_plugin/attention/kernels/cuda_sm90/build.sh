#!/usr/bin/env bash
# Builds libkvax_sm90_bwd.so (the CUDA C++ fused backward, sm_90a) with scripts/build_ffi_so.sh:
# nvcc 13 + cccl from PyPI, the jaxlib FFI headers, ptxas's register / spill report printed.
# Usage: bash kvax_plugin/attention/kernels/cuda_sm90/build.sh [NVCC]
set -euo pipefail
cd "$(dirname "$0")"
bash ../../../../scripts/build_ffi_so.sh fused_backward.cu libkvax_sm90_bwd.so "$@"
