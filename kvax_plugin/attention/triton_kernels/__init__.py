"""Triton kernels of the attention op (imported only by triton_backend, never at package import)."""
