"""Gemma 2 (Google):
MaxText's upstream configs, trained with attention=kvax on packed text.

    python -m kvax_plugin.launch --config=gemma2:tiny
    python -m kvax_plugin.launch --config=gemma2:tiny --config.attention=dot_product
    python -m kvax_plugin.launch --config=gemma2:2b --config.seq_len=8192 --config.steps=100

`tiny` (the default variant) trains on two CPU cores and keeps the family's attention (head dim 256
(128 in 27b), GQA 2:1, window 4096 on every other layer, soft cap 50); the other VARIANTS are
MaxText's model configs unchanged, for GPUs.
"""

from kvax_plugin.configs import common

VARIANTS = {
    "tiny": ("gemma2-2b", dict(
        # gemma2-2b's 8 query / 4 kv heads of dim 256, window 4096 and soft cap 50 stay; one
        # MaxText gemma2 layer is a (local, global) pair, so 1 layer = 2 attention layers.
        base_emb_dim=256, base_mlp_dim=512, base_num_decoder_layers=1, **common.TINY_COMMON)),
    "2b": ("gemma2-2b", {}),
    "9b": ("gemma2-9b", {}),
    "27b": ("gemma2-27b", {}),
}


def get_config(arg=None):
  return common.family_config("gemma2", arg, VARIANTS)
