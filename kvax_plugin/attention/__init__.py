"""The attention op, in layers (each imports only from the layers above it):

    params.py, options.py     constants, FlashAttentionParamsConfig, KernelOptions
    block_mask.py             the block tables (AttentionMask) and their reporting
    reference.py, validation.py, token_order.py
    kernels/capabilities.py, kernels/custom_vjp.py   what every backend shares
    kernels/<leaf>            the kernel backends (jax_blockwise, reference, triton/, mosaic/)
    kernels/__init__.py       the registry: names, capabilities, devices, "auto"
    context_parallel.py       sharding and context parallelism over a mesh
    api.py, compare.py        the public op

tests/test_layering.py checks the order and that the import graph has no cycle.
"""
