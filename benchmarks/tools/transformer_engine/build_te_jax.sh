#!/bin/bash
# On a GPU machine (its image has CUDA 13 headers, pybind11 and jax with its CUDA plugin):
# builds the transformer_engine_jax 2.20.2 wheel into $OUT/wheel. About 9 minutes on one core
# (2026-11-27, H200 machine: the extension builds serially). Needs .te/ from bundle.sh and the
# sdist (pip download --no-deps --no-binary :all: transformer-engine-jax==2.20.2) in .te/.
set -euxo pipefail
TE=$PWD/.te
bash "$TE/install.sh"  # the wheel is not there yet: installs the rest
mkdir -p /tmp/tebuild && cd /tmp/tebuild && tar xzf "$TE"/transformer_engine_jax-2.20.2.tar.gz
cd transformer_engine_jax-2.20.2
PYTHONPATH=/tmp/site NVTE_FRAMEWORK=jax python3 setup.py build_ext bdist_wheel -d "$OUT/wheel" \
  > "$OUT/build.log" 2>&1
