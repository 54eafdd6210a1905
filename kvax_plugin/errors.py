"""Errors of the launcher and the helpers it drives (data feeding, MaxText key translation).

Each message names the flag or key at fault; kvax_plugin.launch turns FlagError into exit
status 2 and SetupError into 1. Kept in a module of its own so kvax_plugin.data and
kvax_plugin.integrations can raise them without importing the launcher.
"""

from __future__ import annotations


class FlagError(ValueError):
  """A flag (or raw MaxText key) has a value the launcher cannot run; the message names it."""


class SetupError(RuntimeError):
  """The environment lacks what the launcher needs (MaxText, a supported version of it)."""


__all__ = ["FlagError", "SetupError"]
