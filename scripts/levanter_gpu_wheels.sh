#!/usr/bin/env bash
# Download the wheels the GPU image lacks for the Levanter integration (the image has jax 0.11.2,
# triton 3.6.0, flax, optax, chex, equinox, jaxtyping, tensorstore, transformers, pyarrow, ...:
# /work/.library/device/KINDS.md), for carrying to a GPU machine:
#   bash scripts/levanter_gpu_wheels.sh .whl-levanter      # ~55 MB; .whl-levanter is git-ignored
# then, there: bash integration/levanter/run_on_gpu.sh (it installs them into /tmp/site-levanter).
# The list is what integration/levanter/gpu_levanter.py imports (traced in .venv-levanter: every
# module's distribution) minus the image's packages, at constraints-levanter.txt's versions, plus
# jax-triton 0.3.1 for the Triton kernels. It replaces ../shared/gpu/wheels.sh's "core" group
# (jax-triton): carry one or the other, never two versions of a package.
set -eu
dest=${1:-.whl-levanter}
pkgs="marin-levanter==0.2.227.dev40316220070 marin-haliax==0.2.227.dev40316220070
  marin-rigging==0.2.227.dev40316220070 marin-fray==0.2.227.dev40316220070
  marin-finestore==0.2.227.dev40316220070 jax-triton==0.3.1
  aqtp==0.9.0 draccus==0.11.6 mergedeep==1.3.4 jmp==0.0.4 humanfriendly==10.0 tqdm-loggable==0.4.1
  tblib==3.2.2 braceexpand==0.1.7 msgspec==0.22.0 zstandard==0.25.0 platformdirs==4.14.7
  wandb==0.31.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
  typing-inspection==0.4.5 GitPython==3.2.1 gitdb==4.0.12 smmap==5.0.3 sniffio==1.3.1
  s3fs==2026.2.0 aiobotocore==3.10.0 aioitertools==0.13.0 botocore==1.43.117 jmespath==1.1.0
  substrait==0.28.0 substrait-protobuf==0.79.0 cffi==2.1.1 cryptography==50.0.2
  google-api-core==2.44.0 google-auth==2.62.2 google-cloud-core==2.8.0
  google-cloud-storage==3.17.1 google-cloud-storage-control==1.17.0 google-cloud-tpu==1.28.0
  google-resumable-media==2.11.0 googleapis-common-protos==1.76.0 grpc-google-iam-v1==0.14.6
  grpcio-status==1.85.1 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2"
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" $pkgs 2>&1 | grep -v '^WARNING' || true
du -sh "$dest"
