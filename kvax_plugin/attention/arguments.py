"""Scalar arguments of the attention op: a Python number or NumPy scalar (or 0-d array) becomes a
Python int / float / bool; bools are not numbers, and JAX arrays are rejected (these settings
are static). Every error names the argument. Imports nothing of the package.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

# A window this large excludes no pair of int32 positions (|q_pos - kv_pos| <= 2**32 - 1).
NO_WINDOW_FROM = 2**32


def _shape(x):
  return getattr(x, "shape", type(x).__name__)


def _describe(value) -> str:
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
  return f"{type(value).__name__} {value!r}"


def _unwrap_numpy(value):
  if isinstance(value, np.ndarray) and value.ndim == 0:
    return value[()]
  return value


def as_int(name: str, value, *, minimum: int | None = None) -> int:
  """`value` as a Python int: a Python or NumPy integer (not a bool), at least `minimum`."""
  v = _unwrap_numpy(value)
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
    raise TypeError(f"{name} must be a Python or NumPy integer, got {_describe(value)}")
  v = int(v)
  if minimum is not None and v < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {v}")
  return v


def as_float(name: str, value) -> float:
  """`value` as a Python float: a Python or NumPy real number (not a bool). NaN / inf pass."""
  v = _unwrap_numpy(value)
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
    hint = (" (it is static, compiled into the kernel: pass float(x) of a concrete value)"
            if hasattr(value, "shape") else "")
    raise TypeError(f"{name} must be a Python or NumPy real number, got {_describe(value)}{hint}")
  return float(v)


def as_bool(name: str, value) -> bool:
  v = _unwrap_numpy(value)
  if not isinstance(v, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {_describe(value)}")
  return bool(v)


def normalize_window(sliding_window) -> int | None:
  """sliding_window as a positive Python int, or None; 2**32 or more excludes no pair of int32
  positions, so it is None too."""
  if sliding_window is None:
    return None
  w = as_int("sliding_window", sliding_window, minimum=1)
  return None if w >= NO_WINDOW_FROM else w


def normalize_logit_options(scale, logits_soft_cap) -> tuple[float, float | None]:
  """(scale, soft cap) as Python floats. NaN and inf behave as in the reference; a soft cap of
  inf becomes None (no cap), and of NaN becomes scale=nan with no cap (kernels test `cap > 0`)."""
  scale = as_float("scale", scale)
  if logits_soft_cap is None:
    return scale, None
  cap = as_float("logits_soft_cap", logits_soft_cap)
  if math.isnan(cap):
    return math.nan, None
  if cap <= 0:
    raise ValueError(f"logits_soft_cap must be a positive float or None, got {cap!r}")
  return scale, (None if math.isinf(cap) else cap)
