"""The launcher's model-family configs (ml-collections), shipped with the package.

    python -m kvax_plugin.launch --config=llama3:tiny            # from an install, any directory
    python -m kvax_plugin.launch --config=configs/llama3.py:tiny  # a checkout's configs/ too

Each family file defines get_config(variant) through common.family_config.
"""

from __future__ import annotations

import os

from kvax_plugin.configs.common import FAMILIES

CONFIGS_DIR = os.path.dirname(os.path.abspath(__file__))


def config_file(family: str) -> str:
  """The packaged config file of `family` (one of FAMILIES)."""
  if family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
  return os.path.join(CONFIGS_DIR, f"{family}.py")


__all__ = ["CONFIGS_DIR", "FAMILIES", "config_file"]
