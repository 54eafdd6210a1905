"""Gemma 2 (Google), for the launcher in a checkout:

    python -m kvax_plugin.launch --config=configs/gemma2.py:tiny

The config itself ships in the package (kvax_plugin/configs/gemma2.py), so an install runs
`python -m kvax_plugin.launch --config=gemma2:tiny` from any directory.
"""

from kvax_plugin.configs.gemma2 import VARIANTS, get_config  # noqa: F401
