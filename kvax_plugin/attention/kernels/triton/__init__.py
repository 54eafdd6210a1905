"""backend="triton": FlashAttention-2 kernels in Triton, called through jax-triton.

    backend.py    the JAX side: launch settings, custom VJP, flash_attention_triton
    forward.py, backward.py, common.py    the Triton kernels (import Triton)
    compat.py     the jax-triton / Triton version shim (and the CPU interpreter mode)

Nothing here imports Triton when the package is imported: the kernel modules load on first use.
"""
