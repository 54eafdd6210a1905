#!/usr/bin/env bash
# One device-tool call (kind nvidia-h200, carry .whl from wheels.sh core bench): Mosaic GPU tests,
# a Triton subset, and bench_attention at 16k and 64k with the Mosaic rows; results under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu_tests.log
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 200 python3 -m pytest -m gpu tests/gpu/test_mosaic_gpu.py -v -s -p no:cacheprovider 2>&1 | grep -v Warning | tee -a $OUT/gpu_tests.log | grep -E "PASS|FAIL|Error|passed|failed|^\[" | cut -c1-200
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 60 python3 -m pytest -m gpu tests/gpu/test_triton_gpu.py -v -s -p no:cacheprovider -k "odd_length or softcap_sinks or sq300 or explicit_backend" 2>&1 | grep -v Warning | tee $OUT/gpu_tests_triton_subset.log | grep -E "passed|failed" | tail -3
timeout 150 python3 benchmarks/bench_attention.py --seq 16384 --impls mosaic,mosaic_fused,mosaic_unpaired,ours,cudnn,tokamax_mosaic --rounds 7 --min-round-ms 15 --max-dense-mask-seq 0 --check --out $OUT/bench_16k 2>&1 | grep -v "Warning\|^  File\|^    " > $OUT/bench_16k.log; tail -12 $OUT/bench_16k.log
timeout 170 python3 benchmarks/bench_attention.py --seq 65536 --impls mosaic,mosaic_fused,ours,cudnn,tokamax_mosaic --rounds 5 --min-round-ms 15 --max-dense-mask-seq 0 --out $OUT/bench_64k 2>&1 | grep -v "Warning\|^  File\|^    " > $OUT/bench_64k.log; tail -8 $OUT/bench_64k.log
