"""The shared defaults of the family configs: kvax_plugin/configs/common.py."""

from kvax_plugin.configs.common import FAMILIES, TINY_COMMON, family_config  # noqa: F401
