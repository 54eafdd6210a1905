"""The public-domain text shipped with the package, split into documents of varied length.

The files (kvax_plugin/data/*.txt, origins in SOURCES.md) are read through importlib.resources;
nothing is downloaded. `split_entries` cuts natural units (dictionary entries, else paragraphs);
`group_documents` joins consecutive units into documents of log-uniform target lengths (seeded),
so packed rows mix short and long documents.
"""

from __future__ import annotations

import importlib.resources
import math
import re
import zlib
from collections.abc import Sequence

import numpy as np

_PACKAGE = "kvax_plugin.data"
# A headword line: first word made of capitals (dots, apostrophes and hyphens allowed, as in
# "LL.D." or "R.I.P."), followed by whitespace, punctuation or the end of the line.
_HEADWORD = re.compile(r"^[A-Z][A-Z.'\-]*(?=[\s,.?(]|$)")


def corpus_files() -> tuple[str, ...]:
  """Names of the text files shipped in kvax_plugin/data, sorted (deterministic order)."""
  root = importlib.resources.files(_PACKAGE)
  names = sorted(p.name for p in root.iterdir() if p.name.endswith(".txt"))
  if not names:
    raise FileNotFoundError(
        "no corpus text found in kvax_plugin/data/*.txt: the package data was not installed "
        "(setup.cfg package_data must list data/*.txt)")
  return tuple(names)


def read_text(name: str) -> str:
  """The full text of one shipped file, e.g. read_text("devils_dictionary.txt")."""
  available = corpus_files()
  if name not in available:
    raise ValueError(f"name must be one of the shipped corpus files {available}, got {name!r}")
  return importlib.resources.files(_PACKAGE).joinpath(name).read_text(encoding="utf-8")


def split_entries(text: str) -> list[str]:
  """Split a text into its natural units (dictionary entries, else paragraphs).

  Returns the units in reading order, each stripped of surrounding blank lines; joining them
  with blank lines gives back the text up to whitespace between units.
  """
  if not isinstance(text, str):
    raise TypeError(f"text must be a str, got {type(text).__name__}")
  lines = text.split("\n")
  starts = [i for i, line in enumerate(lines)
            if i > 0 and not lines[i - 1].strip() and _HEADWORD.match(line)]
  if not starts:
    # No headwords: paragraphs, so any plain-prose file still yields many units.
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
  bounds = ([0] if starts[0] > 0 else []) + starts + [len(lines)]
  units = ["\n".join(lines[a:b]).strip("\n") for a, b in zip(bounds[:-1], bounds[1:])]
  return [u for u in units if u.strip()]


def group_documents(units: Sequence[str], *, seed: int | Sequence[int] = 0,
                    min_chars: int = 64, max_chars: int = 4096) -> list[str]:
  """Join consecutive units into documents with seeded, log-uniform target lengths.

  Each document takes units until its length reaches a target drawn log-uniformly in
  [min_chars, max_chars]; a single unit longer than the target is a document on its own, so
  documents may exceed max_chars. Order is preserved and every unit is used exactly once.
  seed: an int or a sequence of non-negative ints (anything np.random.default_rng takes).
  """
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
    size += len(unit) + 2  # the blank line that joins units
    if size >= target:
      documents.append("\n\n".join(current))
      current, size = [], 0
      target = math.exp(rng.uniform(lo, hi))
  if current:
    documents.append("\n\n".join(current))
  return documents


def load_documents(*, seed: int = 0, min_chars: int = 64, max_chars: int = 4096,
                   files: Sequence[str] | None = None) -> list[str]:
  """All shipped text as a list of documents (str), deterministic for a given seed.

  files: which shipped files to use (default: all, in sorted order). Each file is split and
  grouped on its own so no document straddles two works.
  """
  names = corpus_files() if files is None else tuple(files)
  documents: list[str] = []
  for name in names:
    # A stream per file, keyed by its name, so adding a file does not change the others'.
    documents += group_documents(split_entries(read_text(name)), seed=(seed, zlib.crc32(
        name.encode())), min_chars=min_chars, max_chars=max_chars)
  return documents


__all__ = ["corpus_files", "read_text", "split_entries", "group_documents", "load_documents"]
