"""kvax-plugin: block-sparse FlashAttention for packed documents in JAX, and its integrations.

The public names follow the original kvax, so its users switch by changing an import.
"""

from kvax_plugin._version import __version__
from kvax_plugin.attention.api import (BackendUnavailableError, attention,
                                       create_attention_mask, flash_attention,
                                       positions_from_segment_ids, resolve_backend)
from kvax_plugin.attention.block_mask import AttentionMask, draw_mask, mask_sparsity
from kvax_plugin.attention.compare import compare_with_reference
from kvax_plugin.attention.context_parallel import (ShardedAttentionMask, attention_specs,
                                                    context_parallel_balance,
                                                    permute_tokens_context_parallelism,
                                                    unpermute_tokens_context_parallelism)
from kvax_plugin.attention.params import PADDING_SEGMENT_ID, FlashAttentionParamsConfig
from kvax_plugin.attention.reference import reference_attention

__all__ = [
    "__version__", "PADDING_SEGMENT_ID", "FlashAttentionParamsConfig", "AttentionMask",
    "create_attention_mask", "flash_attention", "attention", "reference_attention",
    "compare_with_reference", "mask_sparsity", "draw_mask", "positions_from_segment_ids",
    "resolve_backend", "BackendUnavailableError", "attention_specs", "ShardedAttentionMask",
    "permute_tokens_context_parallelism", "unpermute_tokens_context_parallelism",
    "context_parallel_balance",
]
