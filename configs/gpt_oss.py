"""gpt-oss (OpenAI), mixture of experts, for the launcher in a checkout:

    python -m kvax_plugin.launch --config=configs/gpt_oss.py:tiny

The config itself ships in the package (kvax_plugin/configs/gpt_oss.py), so an install runs
`python -m kvax_plugin.launch --config=gpt_oss:tiny` from any directory.
"""

from kvax_plugin.configs.gpt_oss import VARIANTS, get_config  # noqa: F401
