"""Mistral 7B, for the launcher in a checkout:

    python -m kvax_plugin.launch --config=configs/mistral.py:tiny

The config itself ships in the package (kvax_plugin/configs/mistral.py), so an install runs
`python -m kvax_plugin.launch --config=mistral:tiny` from any directory.
"""

from kvax_plugin.configs.mistral import VARIANTS, get_config  # noqa: F401
