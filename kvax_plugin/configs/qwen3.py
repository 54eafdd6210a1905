"""Qwen3 (Alibaba), dense:
MaxText's upstream configs, trained with attention=kvax on packed text.

    python -m kvax_plugin.launch --config=qwen3:tiny
    python -m kvax_plugin.launch --config=qwen3:tiny --config.attention=dot_product
    python -m kvax_plugin.launch --config=qwen3:0.6b --config.seq_len=8192 --config.steps=100

`tiny` (the default variant) trains on two CPU cores and keeps the family's attention (head dim
128, GQA 2:1 (0.6b) to 8:1 (32b), q/k RMS norms); the other VARIANTS are MaxText's model configs
unchanged, for GPUs.
"""

from kvax_plugin.configs import common

VARIANTS = {
    "tiny": ("qwen3-0.6b", dict(
        # 4 query / 2 kv heads keeps qwen3-0.6b's 2:1 ratio, head dim 128 and q/k norms.
        base_emb_dim=256, base_mlp_dim=512, base_num_decoder_layers=2,
        base_num_query_heads=4, base_num_kv_heads=2,
        # Tied output: divide the logits by sqrt(emb_dim), so the loss starts near ln(vocab).
        normalize_embedding_logits=True, **common.TINY_COMMON)),
    "0.6b": ("qwen3-0.6b", {}),
    "4b": ("qwen3-4b", {}),
    "8b": ("qwen3-8b", {}),
    "32b": ("qwen3-32b", {}),
}


def get_config(arg=None):
  return common.family_config("qwen3", arg, VARIANTS)
