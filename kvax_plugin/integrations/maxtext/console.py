"""The launcher's console: its own lines on the terminal, everything else in maxtext.log.

With cfg.quiet (the default) descriptors 1 and 2 point at <output dir>/maxtext.log (XLA writes
to fd 2 directly) and the launcher writes through duplicates (Console.out / .err). Until
open_log() output is held in a temporary file. A failing run's traceback goes to the log.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import traceback

log_path_attr = "kvax_log_path"


class Console:

  def __init__(self, quiet: bool):
    self.quiet = quiet
    self.out, self.err = sys.stdout, sys.stderr
    self.log_path: str | None = None
    self._saved: tuple[int, int] | None = None
    self._sink = None
    self._handler: logging.Handler | None = None
    self._absl_level: int | None = None
    self._line_buffering: bool | None = None

  def __enter__(self) -> Console:
    if not self.quiet:
      return self
    _flush()
    self._saved = (os.dup(1), os.dup(2))
    self.out = _text(self._saved[0], sys.stdout)
    self.err = _text(self._saved[1], sys.stderr)
    self._point_at(tempfile.TemporaryFile())
    if hasattr(sys.stdout, "reconfigure"):
      # A pipe would make sys.stdout block-buffered: MaxText's prints would reach the log late.
      self._line_buffering = sys.stdout.line_buffering
      sys.stdout.reconfigure(line_buffering=True)
    return self

  def open_log(self, log_path: str) -> None:
    """From here on the output goes to `log_path` (written anew)."""
    from absl import logging as absl_logging
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    self.log_path = log_path
    if self.quiet:
      open(log_path, "wb").close()
      sink = open(log_path, "ab")
      _flush()
      self._sink.seek(0)
      shutil.copyfileobj(self._sink, sink)
      sink.flush()
      self._point_at(sink)
    self._handler = logging.FileHandler(log_path, mode="a" if self.quiet else "w")
    self._handler.setLevel(logging.INFO)
    self._handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(self._handler)
    if self.quiet:
      # absl's handler writes to descriptor 2: a second copy of every record.
      absl_handler = absl_logging.get_absl_handler()
      self._absl_level = absl_handler.level
      absl_handler.setLevel(logging.CRITICAL + 1)

  def __exit__(self, exc_type, exc, tb) -> None:
    from absl import logging as absl_logging
    if self.quiet and isinstance(exc, Exception) and self.log_path is not None:
      _flush()
      with open(self.log_path, "a") as f:
        f.write("kvax_plugin.launch: the run failed:\n")
        traceback.print_exception(exc, file=f)
      setattr(exc, log_path_attr, self.log_path)
    if self._absl_level is not None:
      absl_logging.get_absl_handler().setLevel(self._absl_level)
    if self._handler is not None:
      logging.getLogger().removeHandler(self._handler)
      self._handler.close()
    if not self.quiet:
      return
    if self._line_buffering is not None:
      sys.stdout.reconfigure(line_buffering=self._line_buffering)
    _flush()
    self.out.flush()
    self.err.flush()
    os.dup2(self._saved[0], 1)
    os.dup2(self._saved[1], 2)
    for fd in self._saved:
      os.close(fd)
    if self.log_path is None:

      self._sink.seek(0)
      sys.stderr.write(self._sink.read().decode(errors="replace"))
      sys.stderr.flush()
    self._sink.close()
    self.out.close()
    self.err.close()
    self.out, self.err = sys.stdout, sys.stderr

  def _point_at(self, sink) -> None:
    _flush()
    os.dup2(sink.fileno(), 1)
    os.dup2(sink.fileno(), 2)
    if self._sink is not None:
      self._sink.close()
    self._sink = sink


def _flush() -> None:
  # Flush Python's buffers before descriptors 1 / 2 change.
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (AttributeError, OSError, ValueError):
      pass


def _text(fd: int, like):
  return os.fdopen(os.dup(fd), "w", buffering=1, encoding=getattr(like, "encoding", None),
                   errors=getattr(like, "errors", None) or "strict")
