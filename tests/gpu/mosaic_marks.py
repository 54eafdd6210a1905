"""The pytest marks of the GPU test files that need the Mosaic GPU backend (a Hopper GPU): the
`gpu` marker, and a skip that names why where the backend cannot run."""

from __future__ import annotations

import jax
import pytest

from kvax_plugin.attention.kernels.mosaic import backend as mosaic_backend


def _hopper() -> tuple[bool, str]:
  try:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
  except RuntimeError:
    gpus = []
  return mosaic_backend.device_supported(gpus[0] if gpus else None)


_OK, _WHY = _hopper()
MOSAIC_GPU_MARKS = [pytest.mark.gpu,
                    pytest.mark.skipif(not _OK, reason=f"Mosaic backend: {_WHY}")]
