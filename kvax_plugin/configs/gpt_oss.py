"""gpt-oss (OpenAI), mixture of experts:
MaxText's upstream configs, trained with attention=kvax on packed text.

    python -m kvax_plugin.launch --config=gpt_oss:tiny
    python -m kvax_plugin.launch --config=gpt_oss:tiny --config.attention=dot_product
    python -m kvax_plugin.launch --config=gpt_oss:20b --config.seq_len=8192 --config.steps=100

`tiny` (the default variant) trains on two CPU cores and keeps the family's attention (head dim 64,
GQA 8:1, window 128 on every other layer, sinks); the other VARIANTS are MaxText's model configs
unchanged, for GPUs.
"""

from kvax_plugin.configs import common

VARIANTS = {
    "tiny": ("gpt-oss-20b", dict(
        # 16 query / 2 kv heads keeps gpt-oss's 8:1 ratio and head dim 64; window 128 on every
        # other layer and the per-head attention sinks stay. MoE shrunk to 4 experts, top 2,
        # computed densely (sparse_matmul=false: megablox kernels are for accelerators).
        base_emb_dim=128, base_mlp_dim=128, base_moe_mlp_dim=128, base_num_decoder_layers=2,
        base_num_query_heads=16, base_num_kv_heads=2, num_experts=4, num_experts_per_tok=2,
        sparse_matmul=False, capacity_factor=-1.0, **common.TINY_COMMON)),
    "20b": ("gpt-oss-20b", {}),
    "120b": ("gpt-oss-120b", {}),
}


def get_config(arg=None):
  return common.family_config("gpt_oss", arg, VARIANTS)
