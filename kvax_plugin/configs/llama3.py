"""Llama 3 (Meta):
MaxText's upstream configs, trained with attention=kvax on packed text.

    python -m kvax_plugin.launch --config=llama3:tiny
    python -m kvax_plugin.launch --config=llama3:tiny --config.attention=dot_product
    python -m kvax_plugin.launch --config=llama3:8b --config.seq_len=8192 --config.steps=100

`tiny` (the default variant) trains on two CPU cores and keeps the family's attention (head dim
128, GQA 4:1, global causal attention); the other VARIANTS are MaxText's model configs unchanged,
for GPUs.
"""

from kvax_plugin.configs import common

VARIANTS = {
    "tiny": ("llama3-8b", dict(
        # 8 query / 2 kv heads keeps llama3's 4:1 GQA ratio and head dim 128.
        base_emb_dim=256, base_mlp_dim=512, base_num_decoder_layers=2,
        base_num_query_heads=8, base_num_kv_heads=2, **common.TINY_COMMON)),
    "8b": ("llama3-8b", {}),
    "3.1-8b": ("llama3.1-8b", {}),
    "70b": ("llama3-70b", {}),
    "3.1-405b": ("llama3.1-405b", {}),
}


def get_config(arg=None):
  return common.family_config("llama3", arg, VARIANTS)
