"""Pallas' Mosaic GPU interpreter race detector, read the same way on every supported jax.

jax 0.11 prints each report ("RACE DETECTED" and the two accesses) to stdout; jax 0.12 raises on
the first one unless InterpretGPUParams(on_race="warn"), which logs each report through
`logging` instead. `detector_params` turns detection on and asks for every report, and
`captured_reports` collects them from both places, so tests and scripts/race_report.py count
and parse the same text on both.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
from collections.abc import Iterator

import jax.experimental.pallas.mosaic_gpu as plgpu

# The original class, kept before any test patches plgpu.InterpretGPUParams.
_PARAMS = plgpu.InterpretGPUParams


def detector_params() -> functools.partial:
  """InterpretGPUParams with race detection on, reporting every race (never raising)."""
  extra = {"on_race": "warn"} if "on_race" in inspect.signature(_PARAMS).parameters else {}
  return functools.partial(_PARAMS, detect_races=True, **extra)


class _ToBuffer(logging.Handler):
  def __init__(self, buffer: io.StringIO):
    super().__init__(logging.WARNING)
    self.buffer = buffer

  def emit(self, record: logging.LogRecord) -> None:
    message = record.getMessage()
    if "RACE DETECTED" in message:
      self.buffer.write(message if message.endswith("\n") else message + "\n")


@contextlib.contextmanager
def captured_reports() -> Iterator[io.StringIO]:
  """A buffer that receives the race reports printed (jax 0.11) or logged (jax 0.12) inside."""
  buffer = io.StringIO()
  handler = _ToBuffer(buffer)
  root = logging.getLogger()
  root.addHandler(handler)
  try:
    with contextlib.redirect_stdout(buffer):
      yield buffer
  finally:
    root.removeHandler(handler)
