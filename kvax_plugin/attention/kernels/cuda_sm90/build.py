"""Build an XLA FFI shared object for Hopper (sm_90a) from CUDA C++ source, on any machine with
Python (no GPU needed): nvcc 13 (PyPI: nvidia-cuda-nvcc, nvidia-cuda-cccl; the `hopper` extra of
kvax-plugin), the XLA FFI headers of the installed jaxlib, cudart linked statically (so only the
driver is needed where it runs). Prints ptxas's register / spill report: a kernel's register
budget is checked here, before a GPU run.

    python -m kvax_plugin.attention.kernels.cuda_sm90.build    # libkvax_sm90_bwd.so, next to
                                                              # fused_backward.py
    python -m kvax_plugin.attention.kernels.cuda_sm90.build --source probe.cu --out probe.so

The flags live here only: scripts/build_ffi_so.sh (the FFI probe) and build.sh call this.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fused_backward.cu"
OUTPUT = HERE / "libkvax_sm90_bwd.so"
NVCC_ENV = "KVAX_NVCC"
INSTALL_HINT = ("python3 -m pip install 'nvidia-cuda-nvcc>=13' nvidia-cuda-cccl "
                "(or kvax-plugin[hopper])")
# What the report keeps of nvcc's output: ptxas's lines (registers, spills, serialization
# warnings) and anything about the source itself or an error; the FFI headers' own warnings
# (their message, source excerpt and caret lines) are dropped.
_PTXAS_DETAIL = re.compile(r"^\s+\d+ bytes stack frame")
_ERROR = re.compile(r"\berror\b", re.IGNORECASE)


def _keep(line: str, source: Path) -> bool:
  return ("ptxas" in line or source.name in line or bool(_ERROR.search(line))
          or bool(_PTXAS_DETAIL.match(line)))


def find_nvcc(explicit: str | None = None) -> Path:
  """nvcc: `explicit`, else $KVAX_NVCC, else nvcc on PATH, else the one the nvidia-cuda-nvcc wheel
  installs (nvidia/cu13/bin or nvidia/cuda_nvcc/bin on sys.path). Raises FileNotFoundError with
  what to install."""
  for candidate in (explicit, os.environ.get(NVCC_ENV) or None):
    if candidate:
      if not Path(candidate).is_file():
        raise FileNotFoundError(f"nvcc: {candidate} does not exist")
      return Path(candidate)
  on_path = shutil.which("nvcc")
  if on_path:
    return Path(on_path)
  for entry in sys.path:
    for sub in ("nvidia/cu13/bin/nvcc", "nvidia/cuda_nvcc/bin/nvcc"):
      path = Path(entry or ".") / sub
      if path.is_file():
        return path
  raise FileNotFoundError(f"no nvcc (--nvcc, ${NVCC_ENV}, PATH, the nvidia-cuda-nvcc wheel); "
                          f"install it: {INSTALL_HINT}")


def nvcc_command(nvcc: Path, source: Path, out: Path, ffi_include: str) -> list[str]:
  """The nvcc command line: sm_90a (wgmma, setmaxnreg, TMA), a shared object with cudart
  static, ptxas's report on."""
  return [str(nvcc), "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "--shared",
          "-Xcompiler", "-fPIC", "-cudart", "static", "-Xptxas", "-v", f"-I{ffi_include}",
          str(source), "-o", str(out)]


def build(source: Path = SOURCE, out: Path = OUTPUT, nvcc: str | None = None) -> Path:
  """Compile `source` into `out` (an old `out` is removed first, so a failed build leaves none);
  prints the compiler's report. Returns `out`; raises RuntimeError when nvcc fails."""
  import jax.ffi
  cmd = nvcc_command(find_nvcc(nvcc), Path(source), Path(out), jax.ffi.include_dir())
  Path(out).unlink(missing_ok=True)
  done = subprocess.run(cmd, capture_output=True, text=True)
  report = [line for line in (done.stdout + done.stderr).splitlines()
            if _keep(line, Path(source))]
  print("\n".join(report))
  if done.returncode != 0 or not Path(out).exists():
    raise RuntimeError(f"nvcc failed (exit {done.returncode}): {' '.join(cmd)}")
  print(f"built {out} ({Path(out).stat().st_size} bytes)")
  return Path(out)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--source", type=Path, default=SOURCE)
  ap.add_argument("--out", type=Path, default=OUTPUT)
  ap.add_argument("--nvcc", help=f"the nvcc to use (default: ${NVCC_ENV}, PATH, the wheel's)")
  args = ap.parse_args(argv)
  try:
    build(args.source, args.out, args.nvcc)
  except (FileNotFoundError, RuntimeError) as e:
    print(f"build: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
