#!/usr/bin/env bash
# One device-tool call (kind nvidia-h200, carry .whl from `wheels.sh .whl core maxtext`), ~9 min:
# what the next Mosaic backward change needs to know, written under $OUT.
#   1. ptxas reports (registers, spills) of every Mosaic kernel: benchmarks/mosaic_resources.py
#   2. per-kernel times at 64k (forward, dk/dv, dq, fused dk/dv+dq) next to cuDNN: --split
#   3. cold compile of one attention fwd+bwd per kernel, stage by stage (kernel_compile_time.py)
#   4. the MaxText end-to-end program, cold, with the setup+compile breakdown (16k, one document
#      per row: the row where kvax must reach cudnn_flash_jax)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/profile.log
mkdir -p $OUT/ptxas
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/ptxas XLA_PYTHON_CLIENT_PREALLOCATE=false \
  timeout 90 python3 benchmarks/mosaic_resources.py > $OUT/ptxas/stdout.log 2>&1
grep -h -iE "registers|spill|===" $OUT/ptxas/stdout.log $OUT/ptxas/* 2>/dev/null | sort | uniq -c | head -30 | tee -a $OUT/profile.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 benchmarks/bench_attention.py --seq 65536 \
  --impls mosaic,cudnn --split --rounds 5 --min-round-ms 15 --max-dense-mask-seq 0 \
  --out $OUT/bench_64k_split > $OUT/bench_64k_split.log 2>&1
grep -E " ms|parts" $OUT/bench_64k_split.log | tee -a $OUT/profile.log
COMPILE_TIMEOUT=90 bash tests/gpu/run_on_device.sh compile --impls kvax_mosaic,cudnn,kvax_triton \
  2>&1 | tail -6 | tee -a $OUT/profile.log
E2E_TIMEOUT=200 bash tests/gpu/run_on_device.sh e2e --runs 16k-long:kvax,16k-long:cudnn_flash_jax --steps 5 \
  2>&1 | tail -8 | tee -a $OUT/profile.log
