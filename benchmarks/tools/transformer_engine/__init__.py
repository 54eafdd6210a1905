"""TransformerEngine for JAX on the GPU machines, for MaxText's attention=cudnn_flash_te:

    bash benchmarks/tools/transformer_engine/bundle.sh [TE_JAX_WHEEL]   # builds .te/ here
    bash .te/install.sh; . /tmp/site/te_env.sh; PYTHONPATH=/tmp/site python3 .te/smoke.py

bundle.sh (with build_te_jax.sh) makes the bundle, fatbin_keep_arch.py keeps only the sm_90
cubins of libtransformer_engine.so (tests/test_fatbin_keep_arch.py), install.sh and smoke.py
run on the GPU machine (docs/context-parallelism.md).
"""
