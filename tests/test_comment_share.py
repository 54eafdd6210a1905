"""The package's text: comments and docstrings stay a small share of its Python lines
(scripts/comment_share.py), and no file under kvax_plugin/ holds a dated note (dates,
measurements and history live in git and docs/)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvax_plugin"
SCRIPT = ROOT / "scripts" / "comment_share.py"
DATE = re.compile(rb"20\d\d-\d\d-\d\d")


def _share_within(percent: float) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(SCRIPT), str(PACKAGE), "--max", str(percent)],
                        capture_output=True, text=True)


def test_comment_share_is_at_most_15_percent():
  done = _share_within(15)
  assert done.returncode == 0, done.stdout + done.stderr


def test_comment_share_counts_comments_and_docstrings(tmp_path):
  sys.path.insert(0, str(SCRIPT.parent))
  try:
    import comment_share
  finally:
    sys.path.remove(str(SCRIPT.parent))
  sample = tmp_path / "m.py"
  sample.write_text('"""Module.\n\nMore."""\n\n# a comment\nx = 1  # trailing\n\n\n'
                    'def f():\n  """One line."""\n  return "# not a comment"\n')
  assert comment_share.count_file(sample) == (5, 7)
  assert comment_share.main([str(tmp_path), "--max", "70"]) == 1
  assert comment_share.main([str(tmp_path), "--max", "72"]) == 0


def test_no_dated_notes_in_the_package():
  dated = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*"))
           if p.is_file() and DATE.search(p.read_bytes())]
  assert not dated, dated
