"""kvax 0.1.0's `kvax.utils`: code written against kvax switches by changing its import line.

    from kvax.utils import attention_specs, permute_tokens_context_parallelism, ...         # kvax
    from kvax_plugin.utils import attention_specs, permute_tokens_context_parallelism, ...  # same

FlashAttentionParamsConfig and PADDING_SEGMENT_ID (-1) keep kvax's names and fields;
attention_specs(query_specs, kv_specs) is a context manager as in kvax (kv_specs may be omitted
here: it then follows the query's batch and heads); the two permutations take (inputs,
mesh=None) and read the context size from the mesh (or the surrounding one) and the specs.
`to_load_balanced_order(x, cp, axis=1)` / `from_load_balanced_order` (kvax_plugin top level)
take the context size explicitly. README.md ("Migrating from kvax") lists the differences.
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
