"""What a kernel backend declares it supports (`CAPABILITIES = Capabilities(...)` in each leaf);
the registry checks a call against it. Imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax.numpy as jnp

FEATURES = ("causal", "sliding_window", "logits_soft_cap", "sinks", "gqa", "distinct_v_head_dim",
            "backward")


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What a kernel backend supports (checked before it is chosen, never inside it): dtypes
  (names); head dims (qk and v separately) within min / max and a multiple of head_dim_multiple;
  head_dims: None or the only (qk, v) pairs it runs; float32_max_head_dim: a lower limit for
  float32 (None: none); features: the FEATURES it implements."""

  dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
  min_head_dim: int = 16
  max_head_dim: int = 256
  head_dim_multiple: int = 16
  head_dims: tuple[tuple[int, int], ...] | None = None
  float32_max_head_dim: int | None = None
  features: frozenset[str] = frozenset(FEATURES)

  def supports(self, dtype: Any, qk_head_dim: int, v_head_dim: int,
               features: Iterable[str] = ()) -> tuple[bool, str]:
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
