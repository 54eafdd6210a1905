"""The documentation's own checks (CPU, no JAX): docs/status.md stays a short page, every relative
link in README.md and docs/ reaches a file (and an #anchor into a .md file reaches one of its
headings, slugged as GitHub slugs them), and README.md names no commits: it cites results files,
which stay in the tree, where a commit hash would send the reader to git."""

import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STATUS_MAX_LINES = 200

# Hex words that look like commits but are not (library build keys and the like); only used when
# git cannot tell.
NOT_COMMITS = frozenset({"a786dc1e9abde613", "5bd2327d4a8b93f4", "cce8aad12ffb6adc",
                         "d138f7dfbc6e9579"})

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HEX_WORD = re.compile(r"(?<!\w)[0-9a-fA-F]{7,40}(?!\w)")


def _markdown_files():
  return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _prose_lines(text):
  """(line number, line) outside fenced code blocks."""
  fenced = False
  for number, line in enumerate(text.splitlines(), 1):
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if not fenced:
      yield number, line


def github_slug(heading: str) -> str:
  """GitHub's anchor for a heading's text: markdown links and emphasis reduced to their text,
  lower case, every character but letters, digits, spaces, hyphens and underscores dropped,
  spaces turned into hyphens."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
  text = re.sub(r"<[^>]+>", "", text)  # inline HTML
  text = text.strip().lower()
  text = "".join(c for c in text if c.isalnum() or c in " -_")
  return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
  """Every heading's anchor in a markdown file, repeats suffixed -1, -2, ... as GitHub does."""
  seen: dict[str, int] = {}
  out = set()
  for _, line in _prose_lines(path.read_text()):
    match = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not match:
      continue
    slug = github_slug(match.group(1))
    if slug in seen:
      seen[slug] += 1
      out.add(f"{slug}-{seen[slug]}")
    else:
      seen[slug] = 0
      out.add(slug)
  return out


def relative_links(path: Path):
  """(line number, target) of every relative link and image in a markdown file's prose."""
  for number, line in _prose_lines(path.read_text()):
    for match in _LINK.finditer(_CODE_SPAN.sub("", line)):
      target = match.group(1)
      if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
        continue  # http:, https:, mailto:, ...
      yield number, target


def test_status_page_is_short():
  status = ROOT / "docs" / "status.md"
  assert status.is_file(), "docs/status.md is the current standing; README links to it"
  lines = len(status.read_text().splitlines())
  assert lines <= STATUS_MAX_LINES, (
      f"docs/status.md has {lines} lines (at most {STATUS_MAX_LINES}): move dated detail to "
      "docs/history/")


def test_github_slug():
  assert github_slug('What "auto" runs on a Hopper GPU, and the numbers behind it') == (
      "what-auto-runs-on-a-hopper-gpu-and-the-numbers-behind-it")
  assert github_slug("2026-11-27, night (H200): `\"hopper\"`'s CTAs launched longest first") == (
      "2026-11-27-night-h200-hoppers-ctas-launched-longest-first")
  assert github_slug("MaxText: `attention=kvax`") == "maxtext-attentionkvax"
  assert github_slug("TransformerEngine at context 4 on 4 x H200 (2026-11-27, fae6ad3)") == (
      "transformerengine-at-context-4-on-4-x-h200-2026-11-27-fae6ad3")


def test_relative_links_resolve():
  broken = []
  for path in _markdown_files():
    for number, target in relative_links(path):
      file_part, _, anchor = target.partition("#")
      file_part = urllib.parse.unquote(file_part)
      dest = (path.parent / file_part).resolve() if file_part else path
      where = f"{path.relative_to(ROOT)}:{number}: {target}"
      if not dest.exists():
        broken.append(f"{where} (no such file)")
      elif anchor and dest.suffix == ".md" and dest.is_file():
        if urllib.parse.unquote(anchor).lower() not in anchors(dest):
          broken.append(f"{where} (no heading with that anchor in {dest.relative_to(ROOT)})")
  assert not broken, "broken links:\n" + "\n".join(broken)


def _is_commit(word: str) -> bool | None:
  """True / False as git says; None where git cannot tell (no git, or not a repository)."""
  if shutil.which("git") is None:
    return None
  try:
    inside = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"],
                            capture_output=True, text=True, timeout=30)
    if inside.returncode:
      return None
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", word + "^{commit}"],
        capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  return found.returncode == 0


def commit_like_words(text: str):
  """(line number, word) of hex words of 7-40 characters with a digit and a letter a-f."""
  for number, line in enumerate(text.splitlines(), 1):
    for match in _HEX_WORD.finditer(line):
      word = match.group(0)
      if re.search(r"\d", word) and re.search(r"[a-fA-F]", word):
        yield number, word


def test_commit_like_words():
  words = [w for _, w in commit_like_words("at a9b5d77, 2026-11-28; library 5bd2327d4a8b93f4; "
                                            "deadbeef cafe 1234567 x0a1b2c3d")]
  assert words == ["a9b5d77", "5bd2327d4a8b93f4"]


def test_readme_names_no_commits():
  """README.md cites results files (which stay in the tree), not commits."""
  text = (ROOT / "README.md").read_text()
  lines = text.splitlines()
  commits = []
  for number, word in commit_like_words(text):
    verdict = _is_commit(word)
    if verdict or (verdict is None and word.lower() not in NOT_COMMITS):
      commits.append(f"README.md:{number}: {word}: {lines[number - 1].strip()[:100]}")
  assert not commits, "README.md names commits (cite the results file instead):\n" + "\n".join(
      commits)


if __name__ == "__main__":
  raise SystemExit(pytest.main([__file__, "-q"]))
