#!/usr/bin/env bash
# Second 2 x H200 call of session 6 (carry .whl): two single-GPU lanes in parallel.
#   lane A (GPU 0): every GPU test (tests/gpu, Mosaic + Triton + non-finite), then a one-line-per-kernel
#                   summary of ptxas registers / spills (the raw dump is too many files to bring back)
#   lane B (GPU 1): cold MaxText end to end, 16k one document per row, kvax vs cudnn_flash_jax, with
#                   the setup+compile breakdown; then the cold compile of one attention per kernel
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
(
  export CUDA_VISIBLE_DEVICES=0
  python3 -c "import jax, triton, jax_triton; print('jax', jax.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__)" > $OUT/gpu_tests.log 2>&1
  timeout ${T_TESTS:-330} python3 -m pytest -m gpu tests/gpu -v -p no:cacheprovider >> $OUT/gpu_tests.log 2>&1
  mkdir -p /tmp/ptxas
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxas timeout 90 python3 benchmarks/mosaic_resources.py > $OUT/ptxas_stdout.log 2>&1
  for f in /tmp/ptxas/*.ptxas /tmp/ptxas/*resources.txt; do echo "== $f"; grep -iE "registers|spill|smem|function" $f | head -8; done > $OUT/ptxas_summary.txt 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout ${T_E2E:-240} python3 benchmarks/maxtext_e2e.py --out_dir /tmp/e2e --runs 16k-long:kvax,16k-long:cudnn_flash_jax \
    --steps 5 > $OUT/e2e.log 2>&1
  mkdir -p $OUT/e2e && cp /tmp/e2e/e2e.json /tmp/e2e/e2e.png $OUT/e2e/ 2>/dev/null
  for d in /tmp/e2e/*/; do [ -f "$d/summary.json" ] && cp "$d/summary.json" "$OUT/e2e/$(basename "$d").summary.json"; done
  timeout 100 python3 benchmarks/kernel_compile_time.py --out $OUT/compile_time.json --impls kvax_mosaic,cudnn,kvax_triton > $OUT/compile_time.log 2>&1
) &
wait
tail -30 $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|ERROR"
tail -12 $OUT/e2e.log; tail -6 $OUT/compile_time.log; head -40 $OUT/ptxas_summary.txt
