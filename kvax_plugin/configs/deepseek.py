"""DeepSeek V2/V3, multi-head latent attention (MLA) and MoE:
MaxText's upstream configs, trained with attention=kvax on packed text.

    python -m kvax_plugin.launch --config=deepseek:tiny
    python -m kvax_plugin.launch --config=deepseek:tiny --config.attention=dot_product
    python -m kvax_plugin.launch --config=deepseek:v2-16b --config.seq_len=4096 --config.steps=100

`tiny` (the default variant) trains on two CPU cores and keeps the family's attention (MLA:
query/key head dim 192 (128 + 64 rope), value 128, LoRA-compressed q and kv); the other VARIANTS
are MaxText's model configs unchanged, for GPUs.
"""

from kvax_plugin.configs import common

VARIANTS = {
    "tiny": ("deepseek3-tiny", dict(
        # MaxText's deepseek3-tiny keeps V3's MLA (qk 128 + 64 rope = 192, v 128, LoRA ranks);
        # 2 layers (1 dense + 1 MoE), 4 experts top 2, computed densely on CPU.
        base_num_decoder_layers=2, first_num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, sparse_matmul=False, capacity_factor=-1.0, **common.TINY_COMMON)),
    "v2-16b": ("deepseek2-16b", {}),
    "v3-671b": ("deepseek3-671b", {}),
}


def get_config(arg=None):
  return common.family_config("deepseek", arg, VARIANTS)
