#!/usr/bin/env bash
# The first device call of the next session (kind nvidia-h200-x2, carry .whl; ~8 min; falls back
# to one lane per call on the 1-GPU kinds with LANE=A or LANE=B). Written in session 6.
#   lane A (GPU 0): 64k --split: every Mosaic kernel alone plus the register-pressure variants
#                   (consumers at 240 registers, dq kernel stepping 64 kv rows, fused at 240),
#                   then the 6 Triton GPU tests not run since the layering move and the Triton
#                   float32 non-finite test with its corrected (highest-precision) reference
#   lane B (GPU 1): 64k causal + docs, fwd+bwd of every backward variant next to cuDNN
# Predictions (benchmarks/NOTES.md, session 6): 240 registers removes most ptxas spills; the dq
# kernel at 64 kv rows has none but twice the steps; the fused kernel gains most (spills 400/704 B).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/next.log
lane_a() {
  timeout ${T_SPLIT:-240} python3 benchmarks/bench_attention.py --seq 65536 --impls mosaic,cudnn --split \
    --rounds 5 --min-round-ms 15 --max-dense-mask-seq 0 --out $OUT/bench_64k_split > $OUT/bench_64k_split.log 2>&1
  timeout ${T_TESTS:-200} python3 -m pytest -m gpu -v -p no:cacheprovider \
    "tests/gpu/test_triton_gpu.py" -k "not test_against_reference and not 300-1000 and not 1-999" \
    "tests/gpu/test_nonfinite_gpu.py::test_triton_nan_inf_follow_the_reference" > $OUT/gpu_tests.log 2>&1
}
lane_b() {
  timeout ${T_BENCH:-420} python3 benchmarks/bench_attention.py --seq 65536 \
    --impls mosaic,mosaic_regs240,mosaic_dq64,mosaic_regs240_dq64,mosaic_fused,mosaic_fused_regs240,mosaic_fused_2buf_regs240,mosaic_fused_unpaired,cudnn \
    --rounds 5 --min-round-ms 15 --max-dense-mask-seq 0 --out $OUT/bench_64k_variants > $OUT/bench_64k_variants.log 2>&1
}
case ${LANE:-both} in
  A) lane_a ;;
  B) lane_b ;;
  *) (CUDA_VISIBLE_DEVICES=0 lane_a) & (CUDA_VISIBLE_DEVICES=1 lane_b) & wait ;;
esac
grep -E "parts|fwd_bwd" $OUT/bench_64k_split.log 2>/dev/null | tee -a $OUT/next.log
grep -vE "WARNING" $OUT/bench_64k_variants.log 2>/dev/null | grep -E "fwd_bwd|fwd " | tee -a $OUT/next.log
grep -E "passed|failed|FAILED" $OUT/gpu_tests.log 2>/dev/null | tail -12 | tee -a $OUT/next.log
