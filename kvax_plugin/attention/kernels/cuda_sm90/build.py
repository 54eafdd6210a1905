"""Build backend="hopper"'s CUDA C++ backward (libkvax_sm90_bwd.so, an XLA FFI shared object for
sm_90a) from fused_backward.cu. No GPU is needed: nvcc >= 13 (PyPI nvidia-cuda-nvcc and
nvidia-cuda-cccl, in the `gpu` extra), the installed jaxlib's FFI headers, cudart linked
statically.

The backend builds it on first use into a cache keyed by build_key (the source as the compiler
sees it, the flags, the jaxlib version, the architecture):
$XDG_CACHE_HOME/kvax_plugin/sm90/<key>/libkvax_sm90_bwd.so. Concurrent processes build it once
(file lock, temporary file, rename). A prebuilt library next to fused_backward.py is used when
its recorded key (libkvax_sm90_bwd.so.json) matches, for machines without nvcc:

    python -m kvax_plugin.attention.kernels.cuda_sm90.build    # prebuild next to the source
    python -m kvax_plugin.attention.kernels.cuda_sm90.build --cache-dir DIR   # into a cache
    python -m kvax_plugin.attention.kernels.cuda_sm90.build --source probe.cu --out probe.so

nvcc: --nvcc when given, else the nvidia-cuda-nvcc wheel's, else nvcc on PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fused_backward.cu"
LIB_NAME = "libkvax_sm90_bwd.so"
OUTPUT = HERE / LIB_NAME
ARCH = "sm_90a"
# nvcc's flags but the paths: part of the cache key.
FLAGS = ("-std=c++17", "-O3", "-gencode", f"arch=compute_90a,code={ARCH}", "--shared",
         "-Xcompiler", "-fPIC", "-cudart", "static", "-Xptxas", "-v")
INSTALL_HINT = ("pip install 'kvax-plugin[gpu]' (or: pip install 'nvidia-cuda-nvcc>=13' "
                "'nvidia-cuda-cccl>=13')")
MISSING_TOOLCHAIN = (
    f'backend="hopper" compiles its CUDA backward ({LIB_NAME}) once, on first use, and needs '
    f"nvcc >= 13 for it: {INSTALL_HINT}. Or build it on another machine with the same jaxlib "
    "(python -m kvax_plugin.attention.kernels.cuda_sm90.build; no GPU needed) and copy "
    f"{LIB_NAME} and {LIB_NAME}.json next to {HERE / 'fused_backward.py'}")
# The report keeps ptxas's lines and source or error lines, not the FFI headers' warnings.
_PTXAS_DETAIL = re.compile(r"^\s+\d+ bytes stack frame")
_ERROR = re.compile(r"\berror\b", re.IGNORECASE)


class ToolchainMissing(FileNotFoundError):
  """No nvcc to build the library with (the message says what to install)."""


def _keep(line: str, source: Path) -> bool:
  return ("ptxas" in line or source.name in line or bool(_ERROR.search(line))
          or bool(_PTXAS_DETAIL.match(line)))


def find_nvcc(explicit: str | os.PathLike | None = None) -> Path:
  """nvcc: `explicit`, else the nvidia-cuda-nvcc wheel's on sys.path (ahead of an older CUDA on
  PATH), else nvcc on PATH. Raises ToolchainMissing saying what to install."""
  if explicit:
    if not Path(explicit).is_file():
      raise ToolchainMissing(f"nvcc={str(explicit)!r}: no such file (expected the path of an "
                             "nvcc >= 13 executable, or None to look it up)")
    return Path(explicit)
  for entry in sys.path:
    for sub in ("nvidia/cu13/bin/nvcc", "nvidia/cuda_nvcc/bin/nvcc"):
      path = Path(entry or ".") / sub
      if path.is_file():
        return path
  on_path = shutil.which("nvcc")
  if on_path:
    return Path(on_path)
  raise ToolchainMissing(MISSING_TOOLCHAIN)


def nvcc_command(nvcc: Path, source: Path, out: Path, ffi_include: str) -> list[str]:
  return [str(nvcc), *FLAGS, f"-I{ffi_include}", str(source), "-o", str(out)]


def _jaxlib_version() -> str:
  import jaxlib
  return jaxlib.__version__


_RAW_PREFIX = re.compile(r"(?:u8|[uUL])?R$")
_LITERAL_PREFIX = re.compile(r"(?:u8|[uUL])?$")


def compiled_text(text: str) -> str:
  """`text` (C++ source) as the compiler's tokens see it: comments removed (/* */ becomes one
  space), blank runs outside literals collapsed, blank lines and line-edge blanks dropped.
  Literals (raw ones too), line splices and digit separators are kept exactly."""
  out: list[str] = []
  pending_space = False
  i, n = 0, len(text)

  def line_start() -> bool:
    return not out or out[-1].endswith("\n")

  def spliced() -> bool:
    return "".join(out[-2:]).endswith("\\\n")

  def emit(token: str) -> None:
    nonlocal pending_space
    if pending_space and (not line_start() or spliced()):
      out.append(" ")
    pending_space = False
    out.append(token)

  while i < n:
    c = text[i]
    if c == "\n":
      pending_space = False
      if not line_start() or spliced():
        out.append("\n")
      i += 1
    elif c in " \t\f\v\r":
      pending_space = True
      i += 1
    elif text.startswith("//", i):
      while i < n and text[i] != "\n":
        i += 2 if text.startswith("\\\n", i) else 1
    elif text.startswith("/*", i):
      end = text.find("*/", i + 2)
      i = n if end < 0 else end + 2
      pending_space = True
    elif c == '"' or c == "'":
      emit(_literal(text, i, c))
      i += len(out[-1])
    elif c.isalpha() or c == "_":
      j = i
      while j < n and (text[j].isalnum() or text[j] == "_"):
        j += 1
      word = text[i:j]
      if j < n and text[j] == '"' and _RAW_PREFIX.match(word):
        paren = text.find("(", j + 1)
        end = -1 if paren < 0 else text.find(")" + text[j + 1:paren] + '"', paren)
        j = n if end < 0 else end + paren - j + 1
      elif j < n and text[j] in "\"'" and _LITERAL_PREFIX.match(word):
        j += len(_literal(text, j, text[j]))
      emit(text[i:j])
      i = j
    elif c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
      j = i + 1
      while j < n and (text[j].isalnum() or text[j] in "_.'" or
                       (text[j] in "+-" and text[j - 1] in "eEpP")):
        j += 1
      emit(text[i:j])
      i = j
    elif c == "\\" and text.startswith("\n", i + 1):
      emit("\\")
      i += 1
    else:
      emit(c)
      i += 1
  return "".join(out).rstrip("\n") + "\n"


def _literal(text: str, start: int, quote: str) -> str:
  """The string or character literal opening at text[start] (unterminated: to line end)."""
  j = start + 1
  while j < len(text) and text[j] != quote and text[j] != "\n":
    j += 2 if text[j] == "\\" else 1
  return text[start:min(j + 1, len(text))] if j < len(text) and text[j] == quote else text[start:j]


def key_parts(source: Path = SOURCE) -> dict[str, str]:
  """What the binary depends on: compiled_text of the source (so a comment edit keeps the key),
  the flags, the jaxlib, the architecture. Not nvcc's version: the key must be computable where
  no nvcc is installed."""
  text = Path(source).read_text(encoding="utf-8", errors="surrogateescape")
  code = compiled_text(text).encode("utf-8", errors="surrogateescape")
  return {"code_sha256": hashlib.sha256(code).hexdigest(),
          "flags": " ".join(FLAGS), "jaxlib": _jaxlib_version(), "arch": ARCH}


def build_key(source: Path = SOURCE) -> str:
  text = json.dumps(key_parts(source), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
  """$XDG_CACHE_HOME/kvax_plugin/sm90 (if absolute), else ~/.cache/kvax_plugin/sm90."""
  base = os.environ.get("XDG_CACHE_HOME", "")
  root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
  return root / "kvax_plugin" / "sm90"


def info_path(lib: Path) -> Path:
  """The JSON beside a library: its key, key parts and the compiler's report."""
  return Path(lib).with_name(Path(lib).name + ".json")


def recorded_key(lib: Path) -> str | None:
  """The key recorded beside `lib`, or None."""
  try:
    if not Path(lib).is_file():
      return None
    return json.loads(info_path(lib).read_text()).get("key")
  except (OSError, ValueError, AttributeError):
    return None


def _atomic_write_text(path: Path, text: str) -> None:
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    f.write(text)
  os.chmod(tmp, 0o644)
  os.replace(tmp, path)


def build(source: Path = SOURCE, out: Path = OUTPUT, nvcc: str | os.PathLike | None = None,
          *, verbose: bool = True) -> Path:
  """Compile `source` into `out` (a temporary file renamed into place after its key is recorded
  in out.json); returns `out`. Raises ToolchainMissing without nvcc, RuntimeError on failure."""
  import jax.ffi
  source, out = Path(source), Path(out)
  compiler = find_nvcc(nvcc)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.unlink(missing_ok=True)
  info_path(out).unlink(missing_ok=True)
  fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
  os.close(fd)
  tmp = Path(tmp_name)
  try:
    cmd = nvcc_command(compiler, source, tmp, jax.ffi.include_dir())
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    report = [line for line in (done.stdout + done.stderr).splitlines() if _keep(line, source)]
    if verbose:
      print("\n".join(report))
    if done.returncode != 0 or not tmp.exists() or tmp.stat().st_size == 0:
      tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
      raise RuntimeError(f"nvcc failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")
    info = {"key": build_key(source), "parts": key_parts(source), "nvcc": str(compiler),
            "seconds": round(time.monotonic() - start, 1), "report": report}
    _atomic_write_text(info_path(out), json.dumps(info, indent=1) + "\n")
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
  finally:
    tmp.unlink(missing_ok=True)
  if verbose:
    print(f"built {out} ({out.stat().st_size} bytes, key {build_key(source)})")
  return out


@contextlib.contextmanager
def _file_lock(path: Path, waiting_message: str):
  """An exclusive fcntl lock on `path` for the block; says once on stderr that it waits."""
  with open(path, "a") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      print(waiting_message, file=sys.stderr, flush=True)
      fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def cached_library(cache_dir: str | os.PathLike | None = None, source: Path = SOURCE,
                   prebuilt: Path | None = OUTPUT) -> Path | None:
  """`prebuilt` when its recorded key matches the source's, else the cache's copy, else None."""
  key = build_key(source)
  if prebuilt is not None and recorded_key(prebuilt) == key:
    return Path(prebuilt)
  cached = Path(cache_dir or default_cache_dir()) / key / LIB_NAME
  return cached if recorded_key(cached) == key else None


def ensure_library(cache_dir: str | os.PathLike | None = None,
                   nvcc: str | os.PathLike | None = None, *, source: Path = SOURCE,
                   prebuilt: Path | None = OUTPUT) -> Path:
  """The path of a library built from `source`, building it into <cache_dir>/<key>/ if needed
  (concurrent callers build once, under a file lock). prebuilt stands in when its recorded key
  matches. Raises ToolchainMissing (nothing to load, no nvcc) or RuntimeError (nvcc failed)."""
  found = cached_library(cache_dir, source, prebuilt)
  if found is not None:
    return found
  key = build_key(source)
  folder = Path(cache_dir or default_cache_dir()) / key
  target = folder / LIB_NAME
  folder.mkdir(parents=True, exist_ok=True)
  with _file_lock(folder / ".lock", f"kvax_plugin: waiting for another process building "
                                    f"{target}"):
    if recorded_key(target) == key:
      return target
    compiler = find_nvcc(nvcc)
    print(f"kvax_plugin: compiling backend=\"hopper\"'s CUDA backward into {target} (once per "
          "source and jaxlib version; about a minute)", file=sys.stderr, flush=True)
    build(source, target, compiler, verbose=False)
  return target


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--source", type=Path, default=SOURCE)
  ap.add_argument("--out", type=Path, default=None,
                  help=f"the library to write (default: {OUTPUT}, the prebuilt one)")
  ap.add_argument("--cache-dir", type=Path, default=None,
                  help="build into this cache (as the backend does on first use) instead")
  ap.add_argument("--nvcc", help="the nvcc to use (default: the nvidia-cuda-nvcc wheel's, then "
                                 "PATH)")
  ap.add_argument("--print-key", action="store_true",
                  help="print the cache key of --source and exit")
  args = ap.parse_args(argv)
  if args.print_key:
    print(build_key(args.source))
    return 0
  if args.cache_dir is not None and args.out is not None:
    ap.error("--cache-dir and --out: give one (where the library goes)")
  try:
    if args.cache_dir is not None:
      print(ensure_library(args.cache_dir, args.nvcc, source=args.source, prebuilt=None))
    else:
      build(args.source, args.out or OUTPUT, args.nvcc)
  except (FileNotFoundError, RuntimeError) as e:
    print(f"build: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
