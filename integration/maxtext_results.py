"""Result lines (largest differences, losses) collected by the MaxText tests for the summary."""

from __future__ import annotations

LINES: list[str] = []


def report(line: str) -> None:
  LINES.append(line)
