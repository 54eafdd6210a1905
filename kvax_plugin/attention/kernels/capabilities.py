"""What a kernel backend declares it supports; the registry (kernels/__init__.py) reads it.

Every kernel leaf defines `CAPABILITIES = Capabilities(...)` next to its implementation, and the
registry checks a call against it before choosing the backend ("auto") or accepting it (an
explicit name). Leaves import this module; it imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax.numpy as jnp

# Features a call may need; a backend lists those it implements.
FEATURES = ("causal", "sliding_window", "logits_soft_cap", "sinks", "gqa", "distinct_v_head_dim",
            "backward")


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What a kernel backend supports (checked before it is chosen, never inside it).

  dtypes: input dtypes (names) it runs.
  min_head_dim / max_head_dim / head_dim_multiple: head dims (qk and v separately).
  head_dims: None, or the only (qk, v) head-dim pairs it runs (a backend built for a few, such
    as "hopper"'s (64, 64), (128, 128), (256, 256) and (192, 128): (192, 192) is within the
    limits but not one of them).
  float32_max_head_dim: a lower head-dim limit for float32 inputs (None: no extra limit).
  features: the entries of FEATURES it implements.
  """

  dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
  min_head_dim: int = 16
  max_head_dim: int = 256
  head_dim_multiple: int = 16
  head_dims: tuple[tuple[int, int], ...] | None = None
  float32_max_head_dim: int | None = None
  features: frozenset[str] = frozenset(FEATURES)

  def supports(self, dtype: Any, qk_head_dim: int, v_head_dim: int,
               features: Iterable[str] = ()) -> tuple[bool, str]:
    """(supported, reason) for inputs of this dtype, head dims and needed features."""
    name = jnp.dtype(dtype).name
    if name not in self.dtypes:
      return False, f"{name} inputs are not supported (supported: {', '.join(self.dtypes)})"
    if self.head_dims is not None and (qk_head_dim, v_head_dim) not in self.head_dims:
      return False, (f"head dims ({qk_head_dim}, {v_head_dim}) are not supported (one of "
                     f"{self.head_dims})")
    for dim in (qk_head_dim, v_head_dim):
      if (dim < self.min_head_dim or dim > self.max_head_dim
          or dim % self.head_dim_multiple):
        return False, (f"head dims ({qk_head_dim}, {v_head_dim}) are not supported (multiples of "
                       f"{self.head_dim_multiple} in [{self.min_head_dim}, "
                       f"{self.max_head_dim}])")
    limit = self.float32_max_head_dim
    if name == "float32" and limit is not None and max(qk_head_dim, v_head_dim) > limit:
      return False, (f"float32 inputs with head dims ({qk_head_dim}, {v_head_dim}) above {limit} "
                     "are not supported")
    missing = sorted(set(features) - self.features)
    if missing:
      return False, f"{', '.join(missing)} not supported"
    return True, ""
