"""The package's version and the jax releases it is tested with (README, "Compatibility")."""

from __future__ import annotations

import re
import warnings

__version__ = "0.1.0"

# The oldest jax release the test suite runs on (constraints.txt: the whole suite and the GPU
# tests) and the newest minor (constraints-jax-next.txt: the core suite on CPU); setup.cfg's
# install_requires admits exactly this range. jax 0.11.0 lacks the Mosaic GPU interpreter's
# parameters (plgpu.InterpretGPUParams), and flax, tokamax and MaxText need 0.11.1 or newer.
OLDEST_JAX = (0, 11, 2)
NEWEST_JAX_MINOR = (0, 12)


def _release(version: str) -> tuple[int, int, int]:
  """(major, minor, patch) of a jax version string ("0.12.0.1" -> (0, 12, 0))."""
  m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
  if not m:
    raise ValueError(f"unparsable jax version {version!r}")
  return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def requirement() -> str:
  """The pip requirement of the tested range, as setup.cfg declares it."""
  low, high = OLDEST_JAX, NEWEST_JAX_MINOR
  return f"jax>={low[0]}.{low[1]}.{low[2]},<{high[0]}.{high[1] + 1}"


def check_jax(version: str) -> None:
  """Raise ImportError for a jax older than OLDEST_JAX (the kernels use APIs it lacks); warn
  for a newer minor than NEWEST_JAX_MINOR, which no test has run on."""
  got = _release(version)
  low, high = OLDEST_JAX, NEWEST_JAX_MINOR
  tested = f"jax {low[0]}.{low[1]}.{low[2]} to {high[0]}.{high[1]}.x"
  if got < low:
    raise ImportError(f"kvax-plugin needs {tested}, found jax {version}: "
                      f"pip install '{requirement()}'")
  if got[:2] > high:
    warnings.warn(f"kvax-plugin is tested with {tested}, found jax {version}; if something "
                  f"fails, pip install 'jax<{high[0]}.{high[1] + 1}'", stacklevel=3)
