"""Apply / check patches/maxtext/<version>/ against a MaxText source tree.

    python -m kvax_plugin.integrations.maxtext.patching check            # installed MaxText
    python -m kvax_plugin.integrations.maxtext.patching apply [--root DIR] [--dry-run]
    python -m kvax_plugin.integrations.maxtext.patching revert [--root DIR]

The manifest records each target's sha256 before and after its patch; a tree that is neither
is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

from kvax_plugin.integrations.maxtext.versions import SUPPORTED_MAXTEXT_VERSIONS


class PatchError(RuntimeError):
  """The tree does not match what the patches were written for, or `patch` failed."""


def patches_dir(version: str | None = None) -> str:
  """The patches for MaxText `version`: upstream_patches/<version> beside this file, shipped in
  the package (in a checkout, a link to the repository's patches/maxtext)."""
  version = version or SUPPORTED_MAXTEXT_VERSIONS[-1]
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_patches", version)
  if not os.path.isfile(os.path.join(path, "MANIFEST.json")):
    raise PatchError(f"no patches for MaxText {version} at {path} (supported: "
                     f"{', '.join(SUPPORTED_MAXTEXT_VERSIONS)})")
  return path


def load_manifest(directory: str) -> dict:
  with open(os.path.join(directory, "MANIFEST.json")) as f:
    return json.load(f)


def installed_root() -> str:
  import importlib.util
  spec = importlib.util.find_spec("maxtext")
  if spec is None or not spec.submodule_search_locations:
    raise PatchError("MaxText is not installed; pass --root DIR (the directory holding maxtext/)")
  return os.path.dirname(list(spec.submodule_search_locations)[0])


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def state(root: str, directory: str) -> dict[str, str]:
  """target -> "upstream" | "patched" | "unknown" | "missing"."""
  out = {}
  for p in load_manifest(directory)["patches"]:
    target = os.path.join(root, p["target"])
    if not os.path.isfile(target):
      out[p["target"]] = "missing"
      continue
    digest = _sha256(target)
    out[p["target"]] = ("upstream" if digest == p["sha256_upstream"] else
                        "patched" if digest == p["sha256_patched"] else "unknown")
  return out


def _run_patch(root: str, patch_file: str, strip: int, *, dry_run: bool, reverse: bool) -> None:
  if shutil.which("patch") is None:
    raise PatchError("the `patch` program is needed (apt-get install patch)")
  cmd = ["patch", f"-p{strip}", "--forward", "--batch", "-d", root, "-i", patch_file]
  if reverse:
    cmd[cmd.index("--forward")] = "--reverse"
  if dry_run:
    cmd.append("--dry-run")
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    raise PatchError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")


def apply(root: str | None = None, directory: str | None = None, *, dry_run: bool = False,
          reverse: bool = False) -> list[str]:
  """Apply (or revert) every patch in order; returns the targets changed. Idempotent."""
  root = root or installed_root()
  directory = directory or patches_dir()
  manifest = load_manifest(directory)
  current = state(root, directory)
  want_to = "upstream" if reverse else "patched"
  bad = {t: s for t, s in current.items() if s not in ("upstream", "patched")}
  if bad:
    raise PatchError(f"MaxText files under {root} differ from MaxText {manifest['version']} "
                     f"(and from its patched form): {bad}. These patches fit MaxText "
                     f"{manifest['version']} exactly; supported: {', '.join(SUPPORTED_MAXTEXT_VERSIONS)}")
  order = manifest["patches"][::-1] if reverse else manifest["patches"]
  changed = []
  for p in order:
    if current[p["target"]] == want_to:
      continue
    _run_patch(root, os.path.join(directory, p["file"]), manifest["strip"], dry_run=dry_run,
               reverse=reverse)
    changed.append(p["target"])
  if not dry_run:
    after = state(root, directory)
    wrong = {t: s for t, s in after.items() if s != want_to}
    if wrong:
      raise PatchError(f"after patching, hashes do not match the manifest: {wrong}")
  return changed


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("command", choices=("check", "apply", "revert"))
  parser.add_argument("--root", help="directory holding the maxtext package (default: installed)")
  parser.add_argument("--patches", help="patch directory (default: the package's, for the "
                      "supported version)")
  parser.add_argument("--dry-run", action="store_true")
  args = parser.parse_args(argv)
  root = args.root or installed_root()
  directory = args.patches or patches_dir()
  if args.command == "check":
    for target, s in state(root, directory).items():
      print(f"{s:9s} {os.path.join(root, target)}")
    return 0
  changed = apply(root, directory, dry_run=args.dry_run, reverse=args.command == "revert")
  verb = "would change" if args.dry_run else "changed"
  print(f"{verb}: {', '.join(changed) if changed else 'nothing (already ' + ('upstream' if args.command == 'revert' else 'patched') + ')'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
