"""The attention op, in layers (each imports only from the layers above it in this list):

    params.py, options.py     constants and FlashAttentionParamsConfig; the kernels' tuning
                              options (KernelOptions) and the environment variables kvax reads
    block_mask.py             the block tables (AttentionMask) and their reporting
    reference.py              the dense float32 reference; validation.py: argument checks;
                              token_order.py: context-parallel token orders
    kernels/capabilities.py,  what every backend shares: its capability record, and the
    kernels/custom_vjp.py     custom VJP of the backends with their own backward kernels
    kernels/<leaf>            kernel backends (jax_blockwise, reference, triton/, mosaic/): the
                              leaves
    kernels/__init__.py       the registry: names, capabilities, devices, "auto"
    context_parallel.py       sharding and context parallelism over a mesh (and the per-rank
                              work of a token order: context_parallel_balance)
    api.py, compare.py        the public op (create_attention_mask, flash_attention, attention)

tests/test_layering.py checks the order and that the import graph has no cycle.
"""
