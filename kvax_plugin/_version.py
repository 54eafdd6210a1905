"""The package's version and the jax releases it is tested with (README, "Compatibility")."""

from __future__ import annotations

import re
import warnings

__version__ = "0.1.0"

# The jax minor releases the test suite runs on (CI: the whole suite on the first, the core
# suite on the last); setup.cfg's install_requires admits exactly these.
TESTED_JAX = ((0, 11), (0, 12))


def _minor(version: str) -> tuple[int, int]:
  m = re.match(r"(\d+)\.(\d+)", version)
  if not m:
    raise ValueError(f"unparsable jax version {version!r}")
  return int(m.group(1)), int(m.group(2))


def check_jax(version: str) -> None:
  """Raise ImportError for a jax older than TESTED_JAX (the kernels use APIs it lacks); warn
  for a newer one, which no test has run on."""
  got = _minor(version)
  low, high = TESTED_JAX[0], TESTED_JAX[-1]
  tested = f"jax {low[0]}.{low[1]} to {high[0]}.{high[1]}"
  if got < low:
    raise ImportError(f"kvax-plugin needs {tested}, found jax {version}: "
                      f"pip install 'jax>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'")
  if got > high:
    warnings.warn(f"kvax-plugin is tested with {tested}, found jax {version}; if something "
                  f"fails, pip install 'jax<{high[0]}.{high[1] + 1}'", stacklevel=3)
