#!/usr/bin/env bash
# Builds libkvax_probe.so (the FFI toolchain probe, probe.cu) with scripts/build_ffi_so.sh.
# Usage: bash scripts/ffi_probe/build.sh [NVCC]
set -euo pipefail
cd "$(dirname "$0")"
bash ../build_ffi_so.sh probe.cu libkvax_probe.so "$@"
