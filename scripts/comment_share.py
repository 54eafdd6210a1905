"""The share of comment and docstring lines in a tree of Python files.

Counts, over every .py file under the given folders, the non-blank lines that are comments (a
`#` token on the line) or inside a docstring (of a module, class or function, or a bare string
after a field), against all non-blank lines. A line holding both code and a trailing comment counts as a comment line.

    python scripts/comment_share.py kvax_plugin            # the share, and the top files
    python scripts/comment_share.py kvax_plugin --max 15   # exit 1 above 15%
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path


def _docstring_lines(tree: ast.AST) -> set[int]:
  """Lines of docstrings: a bare string statement, whether the first of a module, class or
  function (a docstring proper) or one after a field or assignment (an attribute docstring)."""
  lines: set[int] = set()
  for node in ast.walk(tree):
    if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)):
      lines.update(range(node.lineno, node.end_lineno + 1))
  return lines


def count_file(path: Path) -> tuple[int, int]:
  """(comment or docstring lines, non-blank lines) of one Python file."""
  text = Path(path).read_text(encoding="utf-8")
  source_lines = text.splitlines()
  nonblank = {i + 1 for i, line in enumerate(source_lines) if line.strip()}
  commented = _docstring_lines(ast.parse(text, str(path)))
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type == tokenize.COMMENT:
      commented.add(tok.start[0])
  return len(commented & nonblank), len(nonblank)


def count_tree(roots: list[Path]) -> dict[Path, tuple[int, int]]:
  """count_file of every .py file under `roots` (files are taken as they are)."""
  files = []
  for root in roots:
    files += [root] if root.is_file() else sorted(root.rglob("*.py"))
  return {f: count_file(f) for f in files}


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("roots", nargs="*", type=Path, default=[Path("kvax_plugin")])
  ap.add_argument("--max", type=float, default=None,
                  help="the highest share allowed, in percent (exit 1 above it)")
  ap.add_argument("--top", type=int, default=10, help="how many files to list, most first")
  args = ap.parse_args(argv)
  counts = count_tree(args.roots)
  comments = sum(c for c, _ in counts.values())
  lines = sum(n for _, n in counts.values())
  share = 100.0 * comments / lines if lines else 0.0
  for path, (c, n) in sorted(counts.items(), key=lambda kv: -kv[1][0])[:args.top]:
    print(f"{c:6d} / {n:6d}  {path}")
  print(f"comments and docstrings: {comments} of {lines} non-blank lines ({share:.1f}%)")
  if args.max is not None and share > args.max:
    print(f"above the {args.max:g}% allowed", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
