"""Mistral 7B:
MaxText's upstream configs, trained with attention=kvax on packed text.

    python -m kvax_plugin.launch --config=mistral:tiny
    python -m kvax_plugin.launch --config=mistral:tiny --config.attention=dot_product
    python -m kvax_plugin.launch --config=mistral:7b --config.seq_len=8192 --config.steps=100

`tiny` (the default variant) trains on two CPU cores and keeps the family's attention (head dim
128, GQA 4:1; MaxText's mistral-7b.yml sets no window); the other VARIANTS are MaxText's model
configs unchanged, for GPUs.
"""

from kvax_plugin.configs import common

VARIANTS = {
    "tiny": ("mistral-7b", dict(
        # 8 query / 2 kv heads keeps mistral's 4:1 GQA ratio and head dim 128.
        base_emb_dim=256, base_mlp_dim=512, base_num_decoder_layers=2,
        base_num_query_heads=8, base_num_kv_heads=2, **common.TINY_COMMON)),
    "7b": ("mistral-7b", {}),
}


def get_config(arg=None):
  return common.family_config("mistral", arg, VARIANTS)
