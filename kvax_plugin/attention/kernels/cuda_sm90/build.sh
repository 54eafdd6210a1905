#!/usr/bin/env bash
# Prebuilds libkvax_sm90_bwd.so (the CUDA C++ fused backward, sm_90a) next to this file with the
# project's .venv, recording its cache key in libkvax_sm90_bwd.so.json (build.py: nvcc 13 from
# PyPI, the jaxlib FFI headers, ptxas's report). Optional: backend="hopper" builds it into
# ~/.cache/kvax_plugin/sm90 on first use; a prebuilt one serves machines without nvcc.
# Outside a source checkout: python -m kvax_plugin.attention.kernels.cuda_sm90.build
# Usage: bash kvax_plugin/attention/kernels/cuda_sm90/build.sh [NVCC]
set -euo pipefail
cd "$(dirname "$0")"
bash ../../../../scripts/build_ffi_so.sh fused_backward.cu libkvax_sm90_bwd.so "$@"
