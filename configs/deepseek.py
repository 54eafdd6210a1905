"""DeepSeek V2/V3, multi-head latent attention (MLA) and MoE, for the launcher in a checkout:

    python -m kvax_plugin.launch --config=configs/deepseek.py:tiny

The config itself ships in the package (kvax_plugin/configs/deepseek.py), so an install runs
`python -m kvax_plugin.launch --config=deepseek:tiny` from any directory.
"""

from kvax_plugin.configs.deepseek import VARIANTS, get_config  # noqa: F401
