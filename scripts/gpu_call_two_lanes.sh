#!/usr/bin/env bash
# One device-tool call on the 2 x H200 kind (carry .whl from `wheels.sh .whl core maxtext`):
# two single-GPU lanes in parallel (GPU 0 and GPU 1 are independent H200s, so kernel timings are
# as valid as on the 1-GPU kind), then the context-parallel variants on both GPUs. Session 6.
#   lane A (GPU 0): ptxas registers / spills of every Mosaic kernel; per-kernel times at 64k (--split)
#   lane B (GPU 1): 64k causal + docs: mosaic (deterministic), mosaic_fused, mosaic_fused_2buf, cuDNN
#   then (both GPUs): bench_context_parallel, packed layout, balanced order, with XLA's latency
#   hiding scheduler, dk / dv reduced in float32 and in the input dtype.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/s6.log
(
  export CUDA_VISIBLE_DEVICES=0
  mkdir -p $OUT/ptxas
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/ptxas timeout 90 python3 benchmarks/mosaic_resources.py \
    > $OUT/ptxas/stdout.log 2>&1
  timeout ${T_SPLIT:-200} python3 benchmarks/bench_attention.py --seq 65536 --impls mosaic,cudnn --split \
    --rounds 5 --min-round-ms 15 --max-dense-mask-seq 0 --out $OUT/bench_64k_split > $OUT/bench_64k_split.log 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout ${T_BENCH:-240} python3 benchmarks/bench_attention.py --seq 65536 \
    --impls mosaic,mosaic_fused,mosaic_fused_2buf,cudnn --rounds 5 --min-round-ms 15 \
    --max-dense-mask-seq 0 --out $OUT/bench_64k > $OUT/bench_64k.log 2>&1
) &
wait
grep -h -iE "registers|spill" $OUT/ptxas/stdout.log | sort | uniq -c | head -20 | tee -a $OUT/s6.log
grep -E " ms|x " $OUT/bench_64k_split.log | tail -20 | tee -a $OUT/s6.log
grep -E "^ +[0-9]+ |fwd " $OUT/bench_64k.log | grep -v WARNING | tail -24 | tee -a $OUT/s6.log
LHS=--xla_gpu_enable_latency_hiding_scheduler=true
for v in "lhs_f32:$LHS:float32" "lhs_bf16:$LHS:input" "nolhs_bf16::input"; do
  IFS=: read name flags red <<< "$v"
  mkdir -p $OUT/cp_$name
  XLA_FLAGS="$flags" timeout ${T_CP:-90} python3 benchmarks/bench_context_parallel.py --layouts packed \
    --orders balanced --kv_grad_reduce_dtype $red --out_dir $OUT/cp_$name 2>&1 | tail -4 | tee -a $OUT/s6.log
done
