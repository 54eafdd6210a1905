"""kvax 0.1.0's `kvax.utils`: code written against kvax switches by changing its import line.

    from kvax.utils import attention_specs, permute_tokens_context_parallelism, ...         # kvax
    from kvax_plugin.utils import attention_specs, permute_tokens_context_parallelism, ...  # same

Names and fields are kvax's; kv_specs may be omitted here, and the two permutations read the
context size from the mesh (or the surrounding one) and the specs. README.md ("Migrating from
kvax") lists the differences.
"""

from kvax_plugin.attention.context_parallel import (attention_specs,
                                                    permute_tokens_context_parallelism,
                                                    unpermute_tokens_context_parallelism)
from kvax_plugin.attention.params import PADDING_SEGMENT_ID, FlashAttentionParamsConfig

__all__ = [
    "FlashAttentionParamsConfig",
    "PADDING_SEGMENT_ID",
    "attention_specs",
    "permute_tokens_context_parallelism",
    "unpermute_tokens_context_parallelism",
]
