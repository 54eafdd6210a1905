"""The public-domain text shipped with the package (kvax_plugin/data/*.txt, SOURCES.md), split
into natural units and grouped into documents of seeded log-uniform lengths.
"""

from __future__ import annotations

import importlib.resources
import math
import re
import zlib
from collections.abc import Sequence

import numpy as np

_PACKAGE = "kvax_plugin.data"
# A headword line: a first word of capitals ("LL.D.", "R.I.P."), then a break.
_HEADWORD = re.compile(r"^[A-Z][A-Z.'\-]*(?=[\s,.?(]|$)")


def corpus_files() -> tuple[str, ...]:
  """Names of the shipped text files, sorted."""
  root = importlib.resources.files(_PACKAGE)
  names = sorted(p.name for p in root.iterdir() if p.name.endswith(".txt"))
  if not names:
    raise FileNotFoundError(
        "no corpus text found in kvax_plugin/data/*.txt: the package data was not installed "
        "(setup.cfg package_data must list data/*.txt)")
  return tuple(names)


def read_text(name: str) -> str:
  available = corpus_files()
  if name not in available:
    raise ValueError(f"name must be one of the shipped corpus files {available}, got {name!r}")
  return importlib.resources.files(_PACKAGE).joinpath(name).read_text(encoding="utf-8")


def split_entries(text: str) -> list[str]:
  """A text's natural units (dictionary entries, else paragraphs) in reading order, stripped
  of surrounding blank lines."""
  if not isinstance(text, str):
    raise TypeError(f"text must be a str, got {type(text).__name__}")
  lines = text.split("\n")
  starts = [i for i, line in enumerate(lines)
            if i > 0 and not lines[i - 1].strip() and _HEADWORD.match(line)]
  if not starts:

    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
  bounds = ([0] if starts[0] > 0 else []) + starts + [len(lines)]
  units = ["\n".join(lines[a:b]).strip("\n") for a, b in zip(bounds[:-1], bounds[1:])]
  return [u for u in units if u.strip()]


def group_documents(units: Sequence[str], *, seed: int | Sequence[int] = 0,
                    min_chars: int = 64, max_chars: int = 4096) -> list[str]:
  """Join consecutive units into documents, each until it reaches a target length drawn
  log-uniformly in [min_chars, max_chars] (one long unit may exceed it); every unit is used once,
  in order. seed: anything np.random.default_rng takes."""
  if min_chars < 1:
    raise ValueError(f"min_chars must be >= 1, got {min_chars}")
  if max_chars < min_chars:
    raise ValueError(f"max_chars ({max_chars}) must be >= min_chars ({min_chars})")
  rng = np.random.default_rng(seed)
  lo, hi = math.log(min_chars), math.log(max_chars)
  documents: list[str] = []
  current: list[str] = []
  size = 0
  target = math.exp(rng.uniform(lo, hi))
  for unit in units:
    current.append(unit)
    size += len(unit) + 2
    if size >= target:
      documents.append("\n\n".join(current))
      current, size = [], 0
      target = math.exp(rng.uniform(lo, hi))
  if current:
    documents.append("\n\n".join(current))
  return documents


def load_documents(*, seed: int = 0, min_chars: int = 64, max_chars: int = 4096,
                   files: Sequence[str] | None = None) -> list[str]:
  """All shipped text as a list of documents (str), deterministic for a seed; each file is
  grouped on its own. files: which files (default: all, sorted)."""
  names = corpus_files() if files is None else tuple(files)
  documents: list[str] = []
  for name in names:
    # A stream per file: adding a file does not change the others'.
    documents += group_documents(split_entries(read_text(name)), seed=(seed, zlib.crc32(
        name.encode())), min_chars=min_chars, max_chars=max_chars)
  return documents


__all__ = ["corpus_files", "read_text", "split_entries", "group_documents", "load_documents"]
