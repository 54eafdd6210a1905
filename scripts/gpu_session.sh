#!/usr/bin/env bash
# One device-tool call on the 2 x H200 kind: multi-GPU tests, context-parallel benchmark, MaxText
# GPU parity, the main job on a GPU. Needs .whl (wheels.sh core maxtext) carried. Writes to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu_session.log
python3 -c "import jax, triton, jax_triton; print(jax.__version__, triton.__version__, jax_triton.__version__, jax.devices())" 2>&1 | tee -a $OUT/gpu_session.log
step() { echo "=== $1 ($(date -u +%H:%M:%S))" | tee -a $OUT/gpu_session.log; }
if [ -z "${SKIP_MULTI:-}" ]; then
step "multigpu tests"
timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider -m multigpu tests/test_sharding_gpu.py 2>&1 | tail -15 | tee -a $OUT/gpu_session.log
step "context-parallel benchmark"
mkdir -p $OUT/cp
timeout ${T_CP:-300} python3 benchmarks/bench_context_parallel.py --out_dir $OUT/cp 2>&1 | tail -30 | tee -a $OUT/gpu_session.log
fi
step "maxtext gpu parity"
timeout ${T_PARITY:-150} python3 integration/gpu_parity.py --out $OUT/maxtext_gpu_parity.json 2>&1 | grep -v Warning | tail -12 | tee -a $OUT/gpu_session.log
step "main job on GPU"
timeout ${T_MAIN:-90} python3 -m kvax_plugin.launch --config=configs/llama3.py:tiny --config.output_dir=$OUT/main --config.steps=15 2>&1 | tail -15 | tee -a $OUT/gpu_session.log
step done
