"""Qwen3 (Alibaba), dense, for the launcher in a checkout:

    python -m kvax_plugin.launch --config=configs/qwen3.py:tiny

The config itself ships in the package (kvax_plugin/configs/qwen3.py), so an install runs
`python -m kvax_plugin.launch --config=qwen3:tiny` from any directory.
"""

from kvax_plugin.configs.qwen3 import VARIANTS, get_config  # noqa: F401
