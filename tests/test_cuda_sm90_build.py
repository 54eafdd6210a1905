"""backend="hopper" builds its CUDA backward itself (kvax_plugin/attention/kernels/cuda_sm90/
build.py), on the CPU: the cache key, the cache folder, the prebuilt library's recorded key, the
file lock (two processes starting at once build once), the one message a missing toolchain
gives, and the command line. A fake nvcc (a script passed as the `nvcc` argument) stands in for
the compiler, so these take seconds; one test compiles the real source where nvcc is installed
(kvax-plugin[gpu] brings it) and KVAX_TEST_NVCC=1 asks for it."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvax_plugin.attention.kernels.cuda_sm90 import build
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as cuda_bwd

ROOT = Path(__file__).resolve().parents[1]


def _fake_nvcc(tmp_path: Path, seconds: float = 0.0, fail: bool = False) -> tuple[Path, Path]:
  """(nvcc, log): a script that takes nvcc's command line, appends one line per run to `log`
  and writes a small file at -o's path after `seconds` (or fails like a compile error)."""
  log = tmp_path / "nvcc_runs.log"
  nvcc = tmp_path / "fake_nvcc"
  nvcc.write_text(textwrap.dedent(f"""\
      #!{sys.executable}
      import sys, time
      args = sys.argv[1:]
      with open({str(log)!r}, "a") as f:
          f.write(" ".join(args) + "\\n")
      time.sleep({seconds})
      if {fail}:
          print("fused_backward.cu(1): error: expected a ';'", file=sys.stderr)
          sys.exit(2)
      print("ptxas info    : Used 168 registers, used 16 barriers", file=sys.stderr)
      with open(args[args.index("-o") + 1], "wb") as f:
          f.write(b"not really a shared object")
      """))
  nvcc.chmod(0o755)
  return nvcc, log


def _runs(log: Path) -> int:
  return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def source(tmp_path) -> Path:
  src = tmp_path / "src" / "fused_backward.cu"
  src.parent.mkdir()
  src.write_text("__global__ void kernel() {}  // a kernel\n")
  return src


def test_key_follows_source_flags_jaxlib_and_arch(source, monkeypatch):
  key = build.build_key(source)
  assert len(key) == 16 and key == build.build_key(source)
  parts = build.key_parts(source)
  assert parts["arch"] == build.ARCH == "sm_90a" and "code=sm_90a" in parts["flags"]
  import jaxlib
  assert parts["jaxlib"] == jaxlib.__version__
  source.write_text("__global__ void another_kernel() {}\n")
  changed = {build.build_key(source)}
  monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-lineinfo",))
  changed.add(build.build_key(source))
  monkeypatch.setattr(build, "_jaxlib_version", lambda: "0.99.0")
  changed.add(build.build_key(source))
  assert len(changed | {key}) == 4
  # the shipped source has one key, computed without nvcc
  assert len(build.build_key()) == 16


KERNEL = """\
#include <cstdint>  // for int32_t
/* The kernel. */
__global__ void k(int32_t* x) {
  x[0] = 1'000;  // one thousand
}
"""


def test_a_comment_edit_keeps_the_key_and_a_code_edit_changes_it(source):
  source.write_text(KERNEL)
  key = build.build_key(source)
  for commented in (
      KERNEL.replace("// one thousand", "// a thousand, said otherwise"),
      KERNEL.replace("/* The kernel. */", "/* The kernel,\n   over two lines. */\n\n"),
      KERNEL.replace("// for int32_t", "") + "\n\n// a trailing note   \n",
      KERNEL.replace("  x[0]", "      x[0]").replace("{\n", "{   \n\n")):
    source.write_text(commented)
    assert build.build_key(source) == key, commented
  for changed in (KERNEL.replace("1'000", "1'001"), KERNEL.replace("x[0]", "x[1]"),
                  KERNEL.replace("int32_t* x", "int32_t *x, int y")):
    source.write_text(changed)
    assert build.build_key(source) != key, changed


def test_comment_looking_text_in_literals_is_kept():
  text = ('const char* s = "a // b /* c */";  // gone\n'
          "char q = '\"'; char r = '/'; // gone\n"
          'auto raw = R"x(// kept )" /* kept */)x";\n')
  assert build.compiled_text(text) == (
      'const char* s = "a // b /* c */";\n'
      "char q = '\"'; char r = '/';\n"
      'auto raw = R"x(// kept )" /* kept */)x";\n')
  assert build.compiled_text('s = "x // y";') != build.compiled_text('s = "x // z";')
  assert build.compiled_text("a/**/b  c") == "a b c\n"  # a comment still separates tokens
  # a line splice keeps the line after it, blank or not, and the space before its text
  assert build.compiled_text("#define A 1 \\\n    + 2\n\n#define B \\\n\nint z;\n") == (
      "#define A 1 \\\n + 2\n#define B \\\n\nint z;\n")
  # a // comment ending in a line splice continues on the next line
  assert build.compiled_text("// note \\\n still the note\nint y;\n") == "int y;\n"


def test_the_shipped_source_strips_to_its_code():
  code = build.compiled_text(build.SOURCE.read_text())
  assert build.compiled_text(code) == code  # stripping stripped code changes nothing
  assert not [line for line in code.splitlines() if line.startswith(("//", "/*")) or not line]
  assert code.startswith("#include <cuda.h>\n")


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert build.default_cache_dir() == tmp_path / "xdg" / "kvax_plugin" / "sm90"
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  for unusable in ("", "relative/dir"):  # the XDG spec: ignore an empty or relative value
    monkeypatch.setenv("XDG_CACHE_HOME", unusable)
    assert build.default_cache_dir() == tmp_path / "home" / ".cache" / "kvax_plugin" / "sm90"
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert build.default_cache_dir() == tmp_path / "home" / ".cache" / "kvax_plugin" / "sm90"


def test_builds_once_into_the_cache_under_the_key(source, tmp_path):
  nvcc, log = _fake_nvcc(tmp_path)
  cache = tmp_path / "cache"
  assert build.cached_library(cache, source, prebuilt=None) is None
  lib = build.ensure_library(cache, nvcc, source=source, prebuilt=None)
  key = build.build_key(source)
  assert lib == cache / key / build.LIB_NAME and lib.read_bytes() == b"not really a shared object"
  info = json.loads(build.info_path(lib).read_text())
  assert info["key"] == key and info["parts"] == build.key_parts(source)
  assert info["report"] == ["ptxas info    : Used 168 registers, used 16 barriers"]
  assert build.ensure_library(cache, nvcc, source=source, prebuilt=None) == lib
  assert _runs(log) == 1  # the second call found it
  assert not [p for p in lib.parent.iterdir() if p.suffix == ".tmp"]  # no temporary left
  assert [a for a in log.read_text().split() if a.startswith("arch=")] == [
      "arch=compute_90a,code=sm_90a"]
  source.write_text("__global__ void edited() {}\n")  # new code is a new key: built again, beside the old
  lib2 = build.ensure_library(cache, nvcc, source=source, prebuilt=None)
  assert lib2.parent != lib.parent and lib.exists() and _runs(log) == 2


def test_a_prebuilt_library_is_used_when_its_key_matches(source, tmp_path):
  nvcc, log = _fake_nvcc(tmp_path)
  prebuilt = source.with_name(build.LIB_NAME)
  assert build.build(source, prebuilt, nvcc, verbose=False) == prebuilt
  assert build.recorded_key(prebuilt) == build.build_key(source)
  cache = tmp_path / "cache"
  assert build.ensure_library(cache, nvcc, source=source, prebuilt=prebuilt) == prebuilt
  assert _runs(log) == 1 and not cache.exists()
  # a prebuilt library of another source (or without its record) is not used: the cache is
  source.write_text("__global__ void edited() {}\n")
  assert build.cached_library(cache, source, prebuilt) is None
  lib = build.ensure_library(cache, nvcc, source=source, prebuilt=prebuilt)
  assert lib.parent.parent == cache and _runs(log) == 2
  build.info_path(prebuilt).unlink()
  assert build.recorded_key(prebuilt) is None


def test_two_processes_starting_at_once_build_once(source, tmp_path):
  """The lock is held here while both start, so both meet it (and say they wait); once it is
  released one builds and the other loads its result."""
  nvcc, log = _fake_nvcc(tmp_path, seconds=1.0)
  cache = tmp_path / "cache"
  folder = cache / build.build_key(source)
  folder.mkdir(parents=True)
  code = ("import sys; from kvax_plugin.attention.kernels.cuda_sm90 import build; "
          "from pathlib import Path; "
          "print(build.ensure_library(sys.argv[1], sys.argv[2], source=Path(sys.argv[3]), "
          "prebuilt=None))")
  with open(folder / ".lock", "a") as held:
    fcntl.flock(held, fcntl.LOCK_EX)
    procs, errs = [], []
    for i in range(2):
      errs.append(tmp_path / f"err{i}")
      procs.append(subprocess.Popen(
          [sys.executable, "-c", code, str(cache), str(nvcc), str(source)], cwd=ROOT,
          stdout=subprocess.PIPE, stderr=open(errs[-1], "w"), text=True))
    deadline = time.monotonic() + 120
    while not all("waiting for another process" in e.read_text() for e in errs):
      assert time.monotonic() < deadline, [e.read_text() for e in errs]
      assert all(p.poll() is None for p in procs), [e.read_text() for e in errs]
      time.sleep(0.1)
    assert _runs(log) == 0
    fcntl.flock(held, fcntl.LOCK_UN)
  outs = [p.communicate(timeout=120)[0].strip() for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [e.read_text() for e in errs]
  assert outs[0] == outs[1] == str(folder / build.LIB_NAME)
  assert _runs(log) == 1
  assert sum("compiling" in e.read_text() for e in errs) == 1


def test_a_missing_toolchain_says_what_to_install(source, tmp_path, monkeypatch):
  monkeypatch.setattr("sys.path", [str(tmp_path / "site")])
  monkeypatch.setenv("PATH", str(tmp_path / "bin"))
  with pytest.raises(build.ToolchainMissing) as e:
    build.ensure_library(tmp_path / "cache", source=source, prebuilt=None)
  message = str(e.value)
  assert message == build.MISSING_TOOLCHAIN
  assert "pip install 'kvax-plugin[gpu]'" in message and "'nvidia-cuda-nvcc>=13'" in message
  assert "python -m kvax_plugin.attention.kernels.cuda_sm90.build" in message
  assert isinstance(e.value, FileNotFoundError)
  with pytest.raises(build.ToolchainMissing, match=r"nvcc='.*missing': no such file"):
    build.find_nvcc(tmp_path / "missing")
  # the cheap status says the same, and builds nothing
  monkeypatch.setattr(cuda_bwd, "_LOADED", [])
  monkeypatch.setattr(cuda_bwd, "_FAILED", [])
  monkeypatch.setattr(build, "default_cache_dir", lambda: tmp_path / "cache2")
  monkeypatch.setattr(cuda_bwd, "PREBUILT", tmp_path / "none.so")
  assert cuda_bwd.library_status() == (False, build.MISSING_TOOLCHAIN)
  assert not (tmp_path / "cache2").exists()


def test_nvcc_lookup_order(tmp_path, monkeypatch):
  """The argument, then the wheel kvax-plugin[gpu] installs, then PATH (an older CUDA there
  must not win over the pinned wheel)."""
  exe = lambda p: (p.parent.mkdir(parents=True, exist_ok=True), p.write_text(""),
                   p.chmod(0o755), p)[3]
  wheel = exe(tmp_path / "site" / "nvidia" / "cu13" / "bin" / "nvcc")
  on_path = exe(tmp_path / "bin" / "nvcc")
  given = exe(tmp_path / "given" / "nvcc")
  monkeypatch.setattr("sys.path", [str(tmp_path / "site")])
  monkeypatch.setenv("PATH", str(tmp_path / "bin"))
  assert build.find_nvcc(str(given)) == given
  assert build.find_nvcc() == wheel
  monkeypatch.setattr("sys.path", [])
  assert build.find_nvcc() == on_path
  assert not [n for n in vars(build) if n.endswith("_ENV")]  # no environment variable hook


def test_a_failed_compile_is_reported_once_per_process(source, tmp_path, monkeypatch):
  nvcc, log = _fake_nvcc(tmp_path, fail=True)
  with pytest.raises(RuntimeError, match=r"nvcc failed \(exit 2\).*\n.*error: expected"):
    build.ensure_library(tmp_path / "cache", nvcc, source=source, prebuilt=None)
  lib_dir = tmp_path / "cache" / build.build_key(source)
  assert not (lib_dir / build.LIB_NAME).exists()
  assert not [p for p in lib_dir.iterdir() if p.suffix == ".tmp"]
  # through the loader: the error once, then said again without running nvcc
  monkeypatch.setattr(cuda_bwd, "_LOADED", [])
  monkeypatch.setattr(cuda_bwd, "_FAILED", [])
  monkeypatch.setattr(build, "SOURCE", source)
  real = build.ensure_library
  monkeypatch.setattr(build, "ensure_library", lambda cache_dir=None, nvcc_=None, **kw: real(
      tmp_path / "cache", nvcc, source=source, prebuilt=None))
  message = "libkvax_sm90_bwd.so could not be built or loaded: nvcc failed"
  for _ in range(2):
    with pytest.raises(RuntimeError, match=message):
      cuda_bwd.load()
  assert _runs(log) == 2  # the direct call and the loader's first
  ok, why = cuda_bwd.library_status()
  assert not ok and why.startswith(message)
  ok, why = cuda_bwd.prepare()  # what the device check returns
  assert not ok and why.startswith(message) and _runs(log) == 2


def test_load_takes_an_explicit_path_and_names_a_missing_one(tmp_path, monkeypatch):
  monkeypatch.setattr(cuda_bwd, "_LOADED", [])
  with pytest.raises(FileNotFoundError, match=r"path='.*nothing.so': no such library"):
    cuda_bwd.load(tmp_path / "nothing.so")


def test_command_line(source, tmp_path, capsys):
  nvcc, log = _fake_nvcc(tmp_path)
  out = tmp_path / "out" / "lib.so"
  assert build.main(["--source", str(source), "--out", str(out), "--nvcc", str(nvcc)]) == 0
  assert build.recorded_key(out) == build.build_key(source)
  assert "ptxas info    : Used 168 registers" in capsys.readouterr().out
  cache = tmp_path / "cache"
  assert build.main(["--source", str(source), "--cache-dir", str(cache), "--nvcc",
                     str(nvcc)]) == 0
  assert capsys.readouterr().out.strip() == str(cache / build.build_key(source) / build.LIB_NAME)
  assert build.main(["--source", str(source), "--print-key"]) == 0
  assert capsys.readouterr().out.strip() == build.build_key(source)
  assert build.main(["--source", str(source), "--out", str(out),
                     "--nvcc", str(tmp_path / "missing")]) == 1
  assert "no such file" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    build.main(["--out", str(out), "--cache-dir", str(cache)])
  # the defaults: the prebuilt library next to fused_backward.py, the shipped source
  assert build.OUTPUT == Path(cuda_bwd.__file__).with_name(build.LIB_NAME) == cuda_bwd.PREBUILT
  assert build.SOURCE == Path(cuda_bwd.__file__).with_name("fused_backward.cu")


def _real_nvcc() -> Path | None:
  try:
    return build.find_nvcc()
  except build.ToolchainMissing:
    return None


# Opt-in: the compile takes 16-80 s on 2 cores, and nvcc
# (~350 MB) is not in the test environment scripts/bootstrap.sh makes. Run it after a
# change to fused_backward.cu or build.py's flags (the GPU tests build the library too, on
# first use): KVAX_EXTRAS=dev,maxtext,gpu bash scripts/bootstrap.sh, then
# KVAX_TEST_NVCC=1 bash scripts/test.sh tests/test_cuda_sm90_build.py
@pytest.mark.skipif(os.environ.get("KVAX_TEST_NVCC") != "1",
                    reason="the real nvcc compile (16-80 s) is opt-in: KVAX_TEST_NVCC=1")
@pytest.mark.skipif(_real_nvcc() is None, reason="no nvcc (pip install 'kvax-plugin[gpu]')")
def test_the_real_source_builds_without_a_gpu(tmp_path):
  """The shipped fused_backward.cu through the real nvcc into a fresh cache (a minute or so on
  2 cores): the kernels built (the v7 feature set without and with the soft cap and / or the
  window, and with the mask in the loop without and with the window, bf16 and fp16, at head
  dims 128 and 64, and the head dim 256 and MLA 192 / 128 kernels without MASK_IN_LOOP: 40),
  none spilling but the soft-cap kernels at head dim 64 (80-104 bytes;
  docs/history/performance-2026-11.md), and none with serialized wgmma (C7512 / C7520),
  and a library that loads on a CPU machine and reports this module's interface version."""
  lib = build.ensure_library(tmp_path / "cache", prebuilt=None)
  info = json.loads(build.info_path(lib).read_text())
  assert info["key"] == build.build_key()
  report = info["report"]
  kernels = [line.split("'")[1] for line in report if "Compiling entry function" in line]
  base = cuda_bwd.VARIANTS[cuda_bwd.DEFAULT_VARIANT]
  features = [0, cuda_bwd.SOFTCAP, cuda_bwd.WINDOW, cuda_bwd.SOFTCAP | cuda_bwd.WINDOW]
  want = set()
  in_loop = [cuda_bwd.MASK_IN_LOOP, cuda_bwd.MASK_IN_LOOP | cuda_bwd.WINDOW]
  for half in (0, 1):
    for f in features + in_loop:
      want.add(f"fused_backward_kernelILi{base | f}ELb{half}ELi128E")
      want.add(f"fused_backward_kernelILi{base | f}ELb{half}ELi64E")
    for f in features:
      want.add(f"backward_d256_kernelILi{(base & ~cuda_bwd.DECOUPLE) | f}ELb{half}E")
      want.add(f"backward_mla_kernelILi{(base & ~cuda_bwd.DECOUPLE) | f}ELb{half}E")
  assert len(kernels) == 40 and {w for w in want if any(w in k for k in kernels)} == want
  assert not [line for line in report if "C7512" in line or "C7520" in line]
  for i, line in enumerate(report):
    if line.startswith("ptxas info    : Function properties for "):
      name, spills = line.split()[-1], report[i + 1]
      allowed = "ELi64E" in name and any(
          f"ILi{base | f}E" in name for f in features if f & cuda_bwd.SOFTCAP)
      assert allowed or "0 bytes spill stores, 0 bytes spill loads" in spills, (name, spills)
  assert ctypes.CDLL(str(lib)).KvaxSm90AbiVersion() == cuda_bwd.ABI_VERSION
