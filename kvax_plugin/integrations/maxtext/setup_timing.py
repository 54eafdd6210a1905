"""Where a launcher run's setup+compile seconds go (summary.json "compile_breakdown").

From `launch.run`'s start to MaxText's first training_loop_iteration, split into parts that add
up exactly: jax_trace, jax_lower, xla_compile (jax.monitoring events of the launcher's thread,
each moment counted once), launcher_checks, imports_and_config, model_state_init and remainder.
Other threads' JAX events are listed apart. Clock: time.time(), as JAX's.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import threading
import time
from typing import Any

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PARTS_OF_EVENTS = {TRACE_EVENT: "jax_trace", LOWER_EVENT: "jax_lower", COMPILE_EVENT: "xla_compile"}
PHASES = ("launcher_checks", "imports_and_config", "model_state_init")
PART_NAMES = ("jax_trace", "jax_lower", "xla_compile", *PHASES, "remainder")


class SetupTimer:
  """Collects JAX's compile-event spans and the launcher's phase times for one run."""

  def __init__(self):
    self.spans: list[tuple[float, float, str, str]] = []
    self.durations: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    self.phases: dict[str, list[float]] = {}
    self.first_step_start: float | None = None
    self.notes: list[str] = []
    # Other threads' JAX work (e.g. the corpus's mask statistics) is reported apart.
    self.thread = threading.get_ident()
    self.other_threads: dict[str, float] = collections.defaultdict(float)


  def _on_span(self, event: str, start: float, end: float, **kwargs) -> None:
    if event not in PARTS_OF_EVENTS:
      return
    if threading.get_ident() != self.thread:
      self.other_threads[PARTS_OF_EVENTS[event]] += end - start
      return
    self.spans.append((start, end, event, str(kwargs.get("fun_name", "?"))))

  def _on_duration(self, event: str, seconds: float, **kwargs) -> None:
    total = self.durations[event]
    total[0] += seconds
    total[1] += 1

  @contextlib.contextmanager
  def listening(self):
    """Record JAX's compile events within the block."""
    from jax import monitoring
    monitoring.register_event_time_span_listener(self._on_span)
    monitoring.register_event_duration_secs_listener(self._on_duration)
    try:
      yield self
    finally:
      monitoring.unregister_event_time_span_listener(self._on_span)
      monitoring.unregister_event_duration_listener(self._on_duration)

  def start(self, phase: str) -> None:
    self.phases[phase] = [time.time(), float("nan")]

  def stop(self, phase: str) -> None:
    self.phases[phase][1] = time.time()

  @contextlib.contextmanager
  def maxtext_hooks(self):
    """Time MaxText's setup_train_loop and each training_loop_iteration within the block (a
    MaxText without them leaves their seconds in the remainder, with a note)."""
    from maxtext.trainers.pre_train import train as mt_train
    from maxtext.utils import train_utils
    patched = []

    def wrap(module, name, before, after):
      original = getattr(module, name, None)
      if original is None:
        self.notes.append(f"{module.__name__}.{name} not found: its seconds are not split out")
        return

      @functools.wraps(original)
      def timed(*args, **kwargs):
        before()
        try:
          return original(*args, **kwargs)
        finally:
          after()

      setattr(module, name, timed)
      patched.append((module, name, original))

    def loop_start():
      if self.first_step_start is None:
        self.first_step_start = time.time()

    wrap(train_utils, "setup_train_loop", lambda: self.start("model_state_init"),
         lambda: self.stop("model_state_init"))
    wrap(mt_train, "training_loop_iteration", loop_start, lambda: None)
    try:
      yield self
    finally:
      for module, name, original in reversed(patched):
        setattr(module, name, original)


  def breakdown(self, t0: float, t_end: float) -> dict[str, Any]:
    """The run's compile_breakdown (seconds) between time.time() values t0 and t_end (or the first
    step's start); "parts" add up to "setup_and_compile", each >= 0."""
    end = self.first_step_start
    if end is None:
      self.notes.append("no training_loop_iteration seen: setup+compile runs to the end")
      end = t_end
    setup_and_compile = max(0.0, end - t0)
    excl = exclusive_seconds(self.spans, t0, end)
    parts = {name: 0.0 for name in PART_NAMES}
    for event, part in PARTS_OF_EVENTS.items():
      parts[part] = excl["by_event"].get(event, 0.0)
    for phase in PHASES:
      if phase not in self.phases:
        continue
      start, stop = max(self.phases[phase][0], t0), min(self.phases[phase][1], end)
      if stop > start:
        inner = exclusive_seconds(self.spans, start, stop)["total"]
        parts[phase] = max(0.0, (stop - start) - inner)
    named = sum(v for k, v in parts.items() if k != "remainder")
    if setup_and_compile - named < -1e-6:
      self.notes.append(f"named parts exceed setup+compile by {named - setup_and_compile:.3f} s")
    parts["remainder"] = max(0.0, setup_and_compile - named)
    in_loop = exclusive_seconds(self.spans, end, t_end)
    return {
        "setup_and_compile": setup_and_compile,
        "parts": {k: round(v, 3) for k, v in parts.items()},
        "phases_wall": {name: round(stop - start, 3)
                        for name, (start, stop) in self.phases.items()},
        "jax_events": {event: {"seconds": round(sec, 3), "count": n}
                       for event, (sec, n) in sorted(self.durations.items())},
        "top_functions": excl["top"],
        "training_loop_jax": {PARTS_OF_EVENTS[e]: round(v, 3)
                              for e, v in in_loop["by_event"].items()},
        "training_loop_top_functions": in_loop["top"][:4],
        "other_threads_jax": {k: round(v, 3) for k, v in self.other_threads.items()},
        "notes": list(self.notes),
    }


def exclusive_seconds(spans, lo: float, hi: float, top: int = 8) -> dict[str, Any]:
  """Seconds of [lo, hi] covered by `spans` (start, end, event, name), each moment counted once
  for the innermost open span: {"total", "by_event", "top": [[part, name, s, count], ...]}."""
  clipped = sorted((max(s, lo), min(e, hi), ev, name) for s, e, ev, name in spans
                   if min(e, hi) > max(s, lo))
  by_event: dict[str, float] = collections.defaultdict(float)
  by_name: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0.0, 0])
  for _, _, event, name in clipped:
    by_name[(PARTS_OF_EVENTS.get(event, event), name)][1] += 1
  points = sorted({p for s, e, _, _ in clipped for p in (s, e)})
  open_spans: list[tuple[float, int]] = []
  nxt, total = 0, 0.0
  for a, b in zip(points, points[1:]):
    while nxt < len(clipped) and clipped[nxt][0] <= a:
      heapq.heappush(open_spans, (-clipped[nxt][0], nxt))
      nxt += 1
    while open_spans and clipped[open_spans[0][1]][1] <= a:
      heapq.heappop(open_spans)
    if open_spans:
      _, _, event, name = clipped[open_spans[0][1]]
      by_event[event] += b - a
      by_name[(PARTS_OF_EVENTS.get(event, event), name)][0] += b - a
      total += b - a
  ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
  return {"total": total, "by_event": dict(by_event),
          "top": [[part, name, round(s, 3), n] for (part, name), (s, n) in ranked]}


def format_breakdown(b: dict[str, Any]) -> str:
  shown = [f"{k} {v:.1f}" for k, v in b["parts"].items() if v >= 0.05]
  return f"setup+compile {b['setup_and_compile']:.1f} s = " + " + ".join(shown)


__all__ = ["SetupTimer", "exclusive_seconds", "format_breakdown", "PART_NAMES"]
