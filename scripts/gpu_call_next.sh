#!/usr/bin/env bash
# The next session's device calls (kind nvidia-h200-x2, carry .whl), written in session 6.
#   LANE=both (default, ~8 min): two single-GPU lanes in parallel
#     A (GPU 0): 64k --split (each Mosaic kernel alone, plus the register-pressure variants:
#                consumers at 240 registers, dq kernel at 64 kv rows, fused at 240), then the
#                forward hooks (optimization barrier, next-K pre-wait, both) next to cuDNN and
#                tokamax Mosaic
#     B (GPU 1): 64k causal + docs, fwd+bwd of every backward variant next to cuDNN
#   LANE=CP (~6 min): context parallelism per order with the library's new dk / dv sum (input
#     dtype at cp=2), both backends, and the collectives timed alone (how much of the gap to 2x
#     is communication, i.e. what the all-gather overlap in NOTES could win); then, one GPU
#     each, the 6 Triton GPU tests not run since the layering move and the Triton float32
#     non-finite test with its corrected reference
#   LANE=DIMS (~7 min): Mosaic at head dims 64 / 256 (16k); kernel compile times; cold e2e
#   LANE=A / LANE=B: one lane alone (on a 1-GPU kind)
#   LANE=NT1, LANE=NT2: the Triton backend under triton 3.9 + jax-triton 0.4.1 (see below)
# Order of the calls: both, DIMS, CP, NT1, NT2 (the last three back to back on a warm machine;
# ~32 device minutes with the starts: drop NT1/NT2 first).
# --interleave: after each implementation is timed alone, all are timed again round-robin (the
# forward of the docs case moved 9.2-9.9 ms between rows of one kernel in session 6: drift).
# Predictions (benchmarks/NOTES.md, session 6): 240 registers removes most ptxas spills (fused
# gains most); the dq kernel at 64 kv rows is a wash or slower; the forward hooks move the
# forward by a few percent at most (tokamax's comment says its ordering barrier matters).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
elif [ ! -d /tmp/site ]; then
  echo "no .whl carried and no /tmp/site from an earlier call on this (warm) machine"; exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/next.log
bench() {  # name, impls (64k causal + docs)
  timeout ${T_BENCH:-400} python3 benchmarks/bench_attention.py --seq 65536 --impls "$2" "${@:3}" \
    --rounds 7 --min-round-ms 15 --max-dense-mask-seq 0 --out $OUT/$1 > $OUT/$1.log 2>&1
}
lane_a() {
  T_BENCH=220 bench bench_64k_split mosaic,cudnn --split
  T_BENCH=300 bench bench_64k_fwd mosaic,mosaic_fwd_optbar,mosaic_fwd_prewait,mosaic_fwd_both,cudnn,tokamax_mosaic --interleave
}
lane_b() {
  T_BENCH=520 bench bench_64k_bwd mosaic,mosaic_regs240,mosaic_dq64,mosaic_fused,mosaic_fused_regs240,mosaic_fused_unpaired,mosaic_fused_unpaired_regs240,mosaic_fused_2buf_regs240,cudnn --interleave
}
cp_runs() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for b in triton auto; do
    mkdir -p $OUT/cp_$b
    timeout 150 python3 benchmarks/bench_context_parallel.py --backend $b --iters 15 \
      --out_dir $OUT/cp_$b 2>&1 | grep -vE "^WARNING" | tail -12 | tee -a $OUT/next.log
  done
  (CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider tests/gpu/test_triton_gpu.py \
     -k "not test_against_reference and not 300-1000 and not 1-999" > $OUT/gpu_tests_triton.log 2>&1) &
  (CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider \
     "tests/gpu/test_nonfinite_gpu.py::test_triton_nan_inf_follow_the_reference" > $OUT/gpu_tests_nonfinite.log 2>&1) &
  wait
}
# LANE=DIMS (~7 min, two lanes): GPU 0: the Mosaic backend at head dims 64 and 256 (16k) next to
# cuDNN and tokamax Mosaic (not timed yet); GPU 1: the cold compile of one attention per kernel
# (the kernels' masked runs now trace once: -26% CUDA module text on CPU, predicted Mosaic
# compile 4.7 -> ~3.5 s), then the cold MaxText e2e, 16k one document per row, kvax vs
# cudnn_flash_jax, with the import warm-up (session 6: setup+compile 42.8 vs 28.3 s, 1.51x).
dims_runs() {
  (export CUDA_VISIBLE_DEVICES=0; timeout 420 python3 benchmarks/bench_attention.py --seq 16384 \
     --head-dims 64,256 --impls mosaic,cudnn,tokamax_mosaic --interleave --rounds 7 \
     --out $OUT/bench_16k_dims > $OUT/bench_16k_dims.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1
   timeout 100 python3 benchmarks/kernel_compile_time.py --out $OUT/compile_time.json \
     --impls kvax_mosaic,cudnn,kvax_triton > $OUT/compile_time.log 2>&1
   timeout 300 python3 benchmarks/maxtext_e2e.py --out_dir /tmp/e2e --steps 8 \
     --runs 16k-long:kvax,16k-long:cudnn_flash_jax > $OUT/e2e.log 2>&1
   mkdir -p $OUT/e2e && cp /tmp/e2e/e2e.json $OUT/e2e/ 2>/dev/null
   for d in /tmp/e2e/*/; do [ -f "$d/summary.json" ] && cp "$d/summary.json" "$OUT/e2e/$(basename "$d").summary.json"; done) &
  wait
  tail -4 $OUT/compile_time.log; tail -4 $OUT/e2e.log
}
# LANE=NT1 then LANE=NT2: the Triton kernels under triton 3.9.0 + jax-triton 0.4.1 (README's
# compatibility table). `bash ../shared/gpu/new_triton.sh pack` made .tri1/ (57 MiB) and .tri2/
# (48 MiB); each call carries one of them ALONE (with .whl it would pass 64 MiB), so run them
# right after a call that carried .whl (its /tmp/site stays while the machine is warm, ~30 s):
#   run(kind=..., carry=[".tri1"], command="LANE=NT1 bash scripts/gpu_call_next.sh")
#   run(kind=..., carry=[".tri2"], command="LANE=NT2 bash scripts/gpu_call_next.sh")
new_triton_tests() {
  cp .tri2/* /tmp/tri/ 2>/dev/null
  [ -d /tmp/trisite ] || { mkdir -p /tmp/trisite && cat /tmp/tri/part.* | xz -d | tar -x -C /tmp/trisite; } || exit 1
  export PYTHONPATH=/tmp/trisite:$PYTHONPATH TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas \
         TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas TRITON_DEFAULT_FP_FUSION=1
  python3 -c "import jax, triton, jax_triton; print('jax', jax.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__)" | tee $OUT/new_triton_tests.log
  (CUDA_VISIBLE_DEVICES=0 timeout 400 python3 -m pytest -m gpu -v -p no:cacheprovider tests/gpu/test_triton_gpu.py \
     -k "odd_length or softcap_sinks or 1-999 or float32_d128 or mla or bitwise or explicit_backend" >> $OUT/new_triton_tests.log 2>&1) &
  (CUDA_VISIBLE_DEVICES=1 timeout 400 python3 benchmarks/bench_attention.py --seq 16384 --impls ours,cudnn \
     --rounds 7 --interleave --out $OUT/bench_16k_triton39 > $OUT/bench_16k_triton39.log 2>&1) &
  wait
  grep -E "passed|failed" $OUT/new_triton_tests.log | tail -3
}
# LANE=T (session 7, first call, ~9 min): the Mosaic GPU tests on the kernels as they are now
# (visit order, fused-backward race fix: not GPU-run before), split over the two GPUs, then
# GPU 0: 64k --split (each kernel and its register variants alone), GPU 1: the forward hooks.
mosaic_tests() {  # lane number, -k expression
  timeout ${T_TESTS:-270} python3 -m pytest -m gpu -v -p no:cacheprovider tests/gpu/test_mosaic_gpu.py \
    tests/gpu/test_nonfinite_gpu.py -k "$2" > $OUT/gpu_tests_mosaic_$1.log 2>&1
}
lane_t0() {
  mosaic_tests 0 "against_reference and (huge or mla or mqa or non_contiguous or not_causal_gqa8 or odd_length or softcap)"
  T_BENCH=240 bench bench_64k_split mosaic,cudnn --split
}
lane_t1() {
  mosaic_tests 1 "one_token or random_positions or sliding or window_not or query_shorter or fused_and or mosaic_nan"
  T_BENCH=270 bench bench_64k_fwd mosaic,mosaic_fwd_optbar,mosaic_fwd_prewait,mosaic_fwd_both,cudnn,tokamax_mosaic --interleave
}
# LANE=T2 (session 7, second call, ~9 min): the Mosaic GPU tests again, now with the forward's
# next-K pre-wait on by default and the backward's pre-wait hook on (KVAX_MOSAIC_BWD_PREWAIT=1:
# so the kernels it would make the default are GPU-tested in the same call), then GPU 0: 64k
# fwd+bwd rows (default, backward pre-wait with and without 240 registers, forward without the
# pre-wait) next to cuDNN and tokamax Mosaic, interleaved; GPU 1: 64k --split (each kernel alone).
lane_t2_0() {
  KVAX_MOSAIC_BWD_PREWAIT=1 mosaic_tests 0 "against_reference and (huge or mla or mqa or non_contiguous or not_causal_gqa8 or odd_length or softcap)"
  T_BENCH=300 bench bench_64k mosaic,mosaic_bwd_prewait,mosaic_bwd_prewait_regs240,mosaic_fwd_noprewait,cudnn,tokamax_mosaic --interleave
}
lane_t2_1() {
  KVAX_MOSAIC_BWD_PREWAIT=1 T_TESTS=330 mosaic_tests 1 "one_token or random_positions or sliding or window_not or query_shorter or fused_and or mosaic_nan"
  T_BENCH=200 bench bench_64k_split mosaic,cudnn --split
}
# LANE=FINAL (session 7, last call, ~8.5 min): context parallelism on both GPUs (balanced order,
# both backends, the library's bf16 dk / dv sum at cp=2, the collectives and the balanced order's
# kv arrangement timed alone: the fixed costs between the measured speed-up and 2x), then two
# lanes: GPU 0: 64k --split (the dk/dv ring 4 deep) and 16k head dim 128 rows; GPU 1: the cold
# kernel compile times (visit order: predicted 4.7 -> ~3.5 s) and 16k at head dims 64 / 256.
final_runs() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for b in auto triton; do
    mkdir -p $OUT/cp_$b
    timeout 130 python3 benchmarks/bench_context_parallel.py --backend $b --iters 15 \
      --orders natural,balanced --out_dir $OUT/cp_$b 2>&1 | grep -vE "^WARNING" | tail -9 | tee -a $OUT/next.log
  done
  (export CUDA_VISIBLE_DEVICES=0
   T_BENCH=170 bench bench_64k_split mosaic,cudnn --split
   timeout 110 python3 benchmarks/bench_attention.py --seq 16384 --impls mosaic,cudnn,tokamax_mosaic \
     --interleave --rounds 7 --out $OUT/bench_16k > $OUT/bench_16k.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1
   timeout 90 python3 benchmarks/kernel_compile_time.py --out $OUT/compile_time.json \
     --impls kvax_mosaic,cudnn > $OUT/compile_time.log 2>&1
   timeout 190 python3 benchmarks/bench_attention.py --seq 16384 --head-dims 64,256 \
     --impls mosaic,cudnn,tokamax_mosaic --interleave --rounds 5 \
     --out $OUT/bench_16k_dims > $OUT/bench_16k_dims.log 2>&1) &
  wait
  grep -vE "WARNING" $OUT/compile_time.log | tail -5
}
case ${LANE:-both} in
  FINAL) final_runs ;;
  T2) (export CUDA_VISIBLE_DEVICES=0; lane_t2_0) & (export CUDA_VISIBLE_DEVICES=1; lane_t2_1) & wait ;;
  T) (export CUDA_VISIBLE_DEVICES=0; lane_t0) & (export CUDA_VISIBLE_DEVICES=1; lane_t1) & wait ;;
  NT1) mkdir -p /tmp/tri && cp .tri1/* /tmp/tri/ && ls -la /tmp/tri ;;
  NT2) new_triton_tests ;;
  DIMS) dims_runs ;;
  A) lane_a ;;
  B) lane_b ;;
  CP) cp_runs ;;
  *) (export CUDA_VISIBLE_DEVICES=0; lane_a) & (export CUDA_VISIBLE_DEVICES=1; lane_b) & wait ;;
esac
for f in $OUT/bench_*.log; do echo "== $f"; grep -vE "WARNING" $f | grep -E "parts|fwd_bwd|fwd "; done 2>/dev/null | tee -a $OUT/next.log
grep -hE "passed|failed|FAILED" $OUT/gpu_tests_*.log 2>/dev/null | tail -12 | tee -a $OUT/next.log
