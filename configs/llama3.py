"""Llama 3 (Meta), for the launcher in a checkout:

    python -m kvax_plugin.launch --config=configs/llama3.py:tiny

The config itself ships in the package (kvax_plugin/configs/llama3.py), so an install runs
`python -m kvax_plugin.launch --config=llama3:tiny` from any directory.
"""

from kvax_plugin.configs.llama3 import VARIANTS, get_config  # noqa: F401
