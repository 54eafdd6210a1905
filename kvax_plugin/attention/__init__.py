"""The attention op, in layers (each imports only from the layers above it):

    arguments.py; params.py, options.py, specs.py   constants, launch params, mesh specs
    block_mask.py, sharded_mask.py   the block tables (AttentionMask), per shard on a mesh
    validation.py             checks of the op's arguments
    reference.py, token_order.py, kernels/capabilities.py, kernels/custom_vjp.py
    balance.py                the per-rank work of a token order
    kernels/<leaf>            the kernel backends (jax_blockwise, reference, triton/, mosaic/)
    kernels/__init__.py       the registry: names, capabilities, devices, "auto"
    split_kv_attention.py, kv_exchange.py   the overlapped merge, kv collectives in shard_map
    plan.py                   AttentionPlan: what one call runs, decided once
    sharded.py, run.py        the plan run on a mesh (shard_map) or on one device
    api.py, context_parallel.py, compare.py   the public op and names

A call: validation.check_call -> plan.make_plan -> run.run.
tests/test_layering.py checks the order and that the import graph has no cycle.
"""
