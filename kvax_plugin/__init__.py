"""kvax-plugin: block-sparse FlashAttention for packed documents in JAX, and its integrations.

Two doors to the same op:
  * `kvax_plugin.ops` and `kvax_plugin.utils` are kvax 0.1.0's modules (names, parameter order,
    defaults, return structures and conventions), so kvax code switches by changing its imports;
  * the names below are the native API (kvax_plugin.attention.api): the same signatures, but
    under context parallelism every token array (kv positions and segment ids too) comes in the
    order the tokens arrive. With mesh=None both take the mask's mesh, or the surrounding one
    when query specs are known, as kvax does. README.md, "Migrating from kvax".
"""

import jax as _jax

from kvax_plugin._version import __version__, check_jax

check_jax(_jax.__version__)

from kvax_plugin import ops, utils  # noqa: E402  (after the version check)
from kvax_plugin.attention.api import (BackendUnavailableError, attention,
                                       create_attention_mask, flash_attention,
                                       positions_from_segment_ids, resolve_backend)
from kvax_plugin.attention.block_mask import (AttentionMask, calculate_mask_sparsity, draw_mask,
                                              mask_sparsity, print_mask)
from kvax_plugin.attention.compare import compare_with_reference
from kvax_plugin.attention.context_parallel import (ShardedAttentionMask, attention_specs,
                                                    context_parallel_balance,
                                                    from_load_balanced_order,
                                                    permute_tokens_context_parallelism,
                                                    to_load_balanced_order,
                                                    unpermute_tokens_context_parallelism)
from kvax_plugin.attention.options import (HopperOptions, KernelOptions, MosaicOptions,
                                           TritonOptions)
from kvax_plugin.attention.params import PADDING_SEGMENT_ID, FlashAttentionParamsConfig
from kvax_plugin.attention.reference import reference_attention
from kvax_plugin.attention.validation import check_mask_inputs
from kvax_plugin.attention.token_order import (TokenOrder, apply_token_order, token_order,
                                               undo_token_order)

__all__ = [
    "__version__", "ops", "utils", "PADDING_SEGMENT_ID", "FlashAttentionParamsConfig",
    "KernelOptions", "MosaicOptions", "HopperOptions", "TritonOptions",
    "AttentionMask", "create_attention_mask", "flash_attention", "attention",
    "reference_attention", "compare_with_reference", "mask_sparsity", "draw_mask", "print_mask",
    "calculate_mask_sparsity", "positions_from_segment_ids", "resolve_backend",
    "BackendUnavailableError", "attention_specs", "ShardedAttentionMask",
    "to_load_balanced_order", "from_load_balanced_order", "permute_tokens_context_parallelism",
    "unpermute_tokens_context_parallelism", "context_parallel_balance", "check_mask_inputs",
    "TokenOrder", "token_order", "apply_token_order", "undo_token_order",
]
