"""The Python blocks of README.md, for the tests that run them (tests/test_readme.py, and the
Levanter ones in integration/levanter/test_readme_levanter.py)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVANTER = "kvax_plugin.integrations import levanter"


def python_blocks(path: str = os.path.join(ROOT, "README.md")) -> list[tuple[int, str]]:
  """(first line number, code) of every ```python block."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  out = []
  for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M):
    out.append((text[:m.start()].count("\n") + 2, m.group(1)))
  return out


def needs_levanter(code: str) -> bool:
  return LEVANTER in code
