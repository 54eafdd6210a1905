#!/usr/bin/env bash
# The GPU test command: the conformance matrix (tests/gpu/test_conformance.py, cells from
# tests/conformance_cells.py) and the GPU tests (tests/gpu, -m gpu), with a result JSON.
#
#   bash scripts/test_gpu.sh [quick|full] [OUT_DIR]
#
#   quick  the matrix's quick cells: every value of every axis for every backend (a few
#          minutes on one H100, compiles included); GPU_TESTS=1 adds the GPU tests
#   full   the full matrix (quick + the pairwise cover of the risky axes) and the GPU tests
#
# On a device machine (the image lacks jax-triton: carry the wheels of
# `bash ../shared/gpu/wheels.sh .whl core` as .whl), e.g. through the device tool:
#   bash scripts/test_gpu.sh quick          # results in $OUT
#   PART=1/2 bash scripts/test_gpu.sh full  # then PART=2/2: the full sweep over two calls
#
# Writes to OUT_DIR (default $OUT, else /tmp/out):
#   conformance_<size>.json   date, GPU, versions, per-backend counts (cells / run / passed /
#                             failed / refused / refused_late / unavailable / not_run), the
#                             failing cells with their errors, every cell's record
#                             (conformance_full_part1of2.json with PART=1/2)
#   conformance_<size>_shard<i>.{log,jsonl}, gpu_tests_<file>.{log,xml}, env.txt
# Parts merge on any machine: python tests/conformance_cells.py merge ALL.json OUT*/*.jsonl --size full
# Exit status: 0 when no cell and no GPU test failed.
#
# Environment: SHARDS (matrix processes side by side on the one GPU; compiling dominates and
# runs on the host's cores: default 4 quick, 8 full), PART=k/n (a slice of the matrix),
# MATRIX_TIMEOUT / TEST_TIMEOUT (seconds per process, default 540: a device call is capped at
# 600 s; cells a cut process did not reach are listed as not_run), GPU_TESTS=0/1, SEED,
# PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
size=${1:-quick}
case $size in
  quick|full|cpu) ;;  # cpu: the CPU-sized cells on a machine without GPU (a dry run)
  *) echo "usage: $0 [quick|full] [OUT_DIR]" >&2; exit 2 ;;
esac
out=${2:-${OUT:-/tmp/out}}
mkdir -p "$out"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

{
  echo "date $(date -u +%FT%TZ)  commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)  size $size  part ${PART:-all}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)" 2>&1
  for m in triton jax_triton; do
    "$PY" -c "
try:
    import $m; print('$m', $m.__version__)
except Exception as e:
    print('$m not importable:', type(e).__name__, str(e).splitlines()[0] if str(e) else '')" 2>&1
  done
  # Every backend's availability, once and alone before the parallel shards: a backend that
  # builds something on first use (hopper's shared object) builds it here, not in racing shards
  # processes; one that stays unavailable is recorded so, with this reason, in every cell.
  timeout "${SETUP_TIMEOUT:-300}" "$PY" -c "
from kvax_plugin.attention import kernels
for name in kernels.KERNEL_BACKENDS:
    print('backend', name, kernels.availability(name))" 2>&1
} | tee "$out/env.txt"

if [ "$size" = full ]; then shards=${SHARDS:-8}; marker="gpu and conformance_full"; else shards=${SHARDS:-4}; marker="gpu and conformance"; fi
sizeenv=""; [ "$size" = cpu ] && sizeenv=cpu
tag=$size${PART:+_part${PART/\//of}}  # conformance_full_part1of2.json, ...
gpu_tests=${GPU_TESTS:-$([ "$size" = full ] && echo 1 || echo 0)}
rm -f "$out"/conformance_"$tag"_shard*.jsonl "$out"/gpu_tests_*.xml
t0=$(date +%s)
pids=()
for i in $(seq 1 "$shards"); do
  KVAX_CONFORMANCE_SIZE=$sizeenv KVAX_CONFORMANCE_SHARD=$i/$shards KVAX_CONFORMANCE_PART=${PART:-} \
  KVAX_CONFORMANCE_SEED=${SEED:-0} KVAX_CONFORMANCE_JSONL="$out/conformance_${tag}_shard$i.jsonl" \
    timeout "${MATRIX_TIMEOUT:-540}" "$PY" -m pytest -m "$marker" tests/gpu/test_conformance.py \
      -q -rf -p no:cacheprovider > "$out/conformance_${tag}_shard$i.log" 2>&1 &
  pids+=($!)
done
part=${PART:-1/1}
if [ "$gpu_tests" = 1 ] && [ "${part%%/*}" = 1 ]; then
  # One process per file, side by side with the matrix (the files take minutes each).
  for f in tests/gpu/test_*.py; do
    [ "$f" = tests/gpu/test_conformance.py ] && continue
    name=$(basename "$f" .py)
    timeout "${TEST_TIMEOUT:-540}" "$PY" -m pytest -m gpu "$f" -v -s -p no:cacheprovider \
      --junitxml "$out/gpu_tests_$name.xml" > "$out/gpu_tests_$name.log" 2>&1 &
    pids+=($!)
  done
fi
for pid in "${pids[@]}"; do wait "$pid"; done
echo "matrix and GPU tests: $(( $(date +%s) - t0 )) s wall" | tee -a "$out/env.txt"

# GPU tests' counts from their junit files, and the run's settings, into the report.
"$PY" - "$out" "$size" "$shards" "${PART:-}" > "$out/extra.json" <<'EOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET
out, size, shards, part = sys.argv[1:5]
files = {}
for path in sorted(glob.glob(os.path.join(out, "gpu_tests_*.xml"))):
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    files[os.path.basename(path)[len("gpu_tests_"):-4]] = {
        k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "failed": failed}
logs = glob.glob(os.path.join(out, "gpu_tests_*.log"))
cut = sorted(os.path.basename(p)[len("gpu_tests_"):-4] for p in logs
             if not os.path.exists(p[:-4] + ".xml"))
print(json.dumps({"size": size, "part": part or None, "shards": int(shards),
                  "command": f"bash scripts/test_gpu.sh {size}",
                  "gpu_tests": files, "gpu_tests_cut": cut}))
EOF
"$PY" tests/conformance_cells.py merge "$out/conformance_$tag.json" "$out"/conformance_"$tag"_shard*.jsonl \
  --size "$size" ${PART:+--part "$PART"} --seed "${SEED:-0}" --extra "$out/extra.json" | tee -a "$out/env.txt"
status=${PIPESTATUS[0]}
for log in "$out"/gpu_tests_*.log; do
  [ -f "$log" ] && echo "$(basename "$log"): $(tail -1 "$log")" | tee -a "$out/env.txt"
done
if ls "$out"/gpu_tests_*.xml >/dev/null 2>&1 && grep -lE 'failures="[1-9]|errors="[1-9]' "$out"/gpu_tests_*.xml >/dev/null; then
  status=1
fi
echo "result: $out/conformance_$tag.json (exit $status)"
exit "$status"
