#!/bin/bash
# Builds .te/ (git-ignored, ~40 MB: fits one device call's carry, not with the MaxText wheels)
# with TransformerEngine 2.20.2 for JAX, for MaxText's attention=cudnn_flash_te on the GPU
# machines:
#   - transformer_engine_cu13's files, its libtransformer_engine.so reduced to the sm_90 cubins
#     (fatbin_keep_arch.py: 343 -> 311 MB, 26 MB compressed instead of 262 MB) and stripped;
#   - transformer_engine_jax built for this image by build_te_jax.sh (source only on PyPI);
#   - nvidia-cudnn-frontend and the pydantic wheels TE imports.
# Usage (repo root): bash benchmarks/tools/transformer_engine/bundle.sh [TE_JAX_WHEEL]
# Carry .te/ to the GPU machine (the device tool's carry), then there: bash .te/install.sh;
# . /tmp/site/te_env.sh; PYTHONPATH=/tmp/site:... python3 .te/smoke.py
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=$PWD/.te
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
mkdir -p "$OUT"
python3 -m pip download -q --no-deps -d "$W" transformer-engine-cu13==2.20.2 transformer-engine==2.20.2
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d "$OUT" nvidia-cudnn-frontend==1.32.0 pydantic==2.14.3 \
  pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
mkdir "$W/tree" && cd "$W/tree"
unzip -q ../transformer_engine_cu13-*.whl && unzip -q -o ../transformer_engine-2.*.whl
lib=transformer_engine/wheel_lib/libtransformer_engine.so
python3 "$HERE/fatbin_keep_arch.py" "$lib" "$lib.90" 90 && mv "$lib.90" "$lib" && strip --strip-unneeded "$lib"
rm -rf transformer_engine/pytorch  # TE imports it only when torch is there, and it needs its own build
tar cf - . | xz -T0 -6 > "$OUT/te_tree.tar.xz"
cp "$HERE/install.sh" "$HERE/smoke.py" "$HERE/build_te_jax.sh" "$OUT/"
if [ $# -ge 1 ]; then
  cp "$1" "$OUT/"  # a transformer_engine_jax wheel built before
else
  # build_te_jax.sh on a GPU machine turns this into the wheel (then rerun with it).
  python3 -m pip download -q --no-deps --no-binary :all: -d "$OUT" transformer-engine-jax==2.20.2
fi
du -sh "$OUT"
