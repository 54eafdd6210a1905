"""Scalar arguments of the attention op: one rule for every static number and flag.

A Python number or a NumPy scalar (np.int64(64), np.float32(30.0), a 0-d NumPy array) is accepted
and converted to a Python int / float / bool; bools are not numbers here, and JAX arrays are
rejected (these settings are static: they shape the compiled program, so they cannot be traced
values). Every error names the argument and the expected type. Imports nothing of the package.
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
  """A 0-d NumPy array becomes its scalar; anything else is returned unchanged."""
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
  """sliding_window as a positive Python int, or None for "no window".

  Windows of 2**32 or more exclude no pair of int32 positions, so they are the same as None
  (2**31, 2**63 - 1 and similar "no window" values work).
  """
  if sliding_window is None:
    return None
  w = as_int("sliding_window", sliding_window, minimum=1)
  return None if w >= NO_WINDOW_FROM else w


def normalize_logit_options(scale, logits_soft_cap) -> tuple[float, float | None]:
  """(scale, soft cap) as Python floats, the form every backend receives.

  NaN and inf are accepted and behave as in the reference (README, "NaN and inf"): the logits
  become NaN / inf and so does every row that attends. Two rewrites keep the backends simple:
    * logits_soft_cap=inf is the limit of cap * tanh(s / cap), i.e. no cap: it becomes None;
    * logits_soft_cap=nan makes every logit NaN, exactly what scale=nan does: it becomes
      scale=nan with no cap (kernels test `cap > 0`, which NaN would silently fail).
  """
  scale = as_float("scale", scale)
  if logits_soft_cap is None:
    return scale, None
  cap = as_float("logits_soft_cap", logits_soft_cap)
  if math.isnan(cap):
    return math.nan, None
  if cap <= 0:
    raise ValueError(f"logits_soft_cap must be a positive float or None, got {cap!r}")
  return scale, (None if math.isinf(cap) else cap)
