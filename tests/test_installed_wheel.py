"""What a user installs: the wheel built from this tree, installed into a fresh environment and
run from a directory outside the tree.

An editable install imports whatever the checkout holds, so only this test sees a module or a
data file that the wheel leaves out. The fresh environment takes the third-party packages of
the test environment (a path entry to its site-packages, whose .pth files, the editable
kvax_plugin finder among them, are not run), so kvax_plugin can come only from the wheel.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def _tracked(prefix: str) -> list[str]:
  out = subprocess.run(["git", "ls-files", prefix], cwd=ROOT, capture_output=True, text=True)
  if out.returncode:
    pytest.fail(f"git ls-files failed: {out.stderr}")
  return out.stdout.split()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
  out = tmp_path_factory.mktemp("wheel")
  done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                         "--no-build-isolation", "-w", str(out), ROOT],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  (path,) = glob.glob(str(out / "*.whl"))
  return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> str:
  """The python of a fresh environment holding the wheel (and the test environment's
  third-party packages)."""
  env_dir = tmp_path_factory.mktemp("env")
  venv.EnvBuilder(with_pip=False).create(env_dir)
  python = str(env_dir / "bin" / "python")
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        capture_output=True, text=True, check=True).stdout.strip()
  with open(os.path.join(site, "test-environment-packages.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")
  # Without PYTHONPATH (as _run): a checkout on it, with its kvax_plugin.egg-info, reads to pip
  # as kvax-plugin of the same version already installed, and pip would install nothing.
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
                         "--no-deps", "--no-index", wheel],
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return python


def _run(python: str, *args: str, cwd: str, timeout: int = 300) -> subprocess.CompletedProcess:
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "xla_force_host_platform_device_count" not in f)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  return subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)


def test_wheel_holds_every_tracked_file_of_the_package(wheel):
  names = set(zipfile.ZipFile(wheel).namelist())
  tracked = _tracked("kvax_plugin")
  assert len(tracked) > 50
  files = []
  for t in tracked:
    path = os.path.join(ROOT, t)
    if os.path.islink(path) and os.path.isdir(path):  # a linked folder: the files under it
      for dirpath, _, found in os.walk(path):
        files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in found]
    else:
      files.append(t)
  assert any("upstream_patches" in f for f in files)  # MaxText's patches, linked from patches/
  assert [f for f in files if f not in names] == []


def test_every_module_imports_from_the_install(installed, tmp_path):
  code = """
import importlib, json, os, pkgutil
import kvax_plugin
failed = {}
names = [m.name for m in pkgutil.walk_packages(kvax_plugin.__path__, "kvax_plugin.")]
for name in names:
  if name.startswith(("kvax_plugin.integrations.levanter", "kvax_plugin.launch")):
    continue  # Levanter has its own environment; the launcher runs below
  try:
    importlib.import_module(name)
  except Exception as e:
    failed[name] = f"{type(e).__name__}: {e}"
from kvax_plugin.integrations.maxtext import patching
manifest = os.path.join(patching.patches_dir(), "MANIFEST.json")
print(json.dumps({"file": kvax_plugin.__file__, "modules": names, "failed": failed,
                  "patches": manifest if os.path.isfile(manifest) else None}))
"""
  r = _run(installed, "-c", code, cwd=str(tmp_path))
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert ROOT not in got["file"] and "site-packages" in got["file"], got["file"]
  assert got["failed"] == {}
  assert got["patches"] and "site-packages" in got["patches"]  # the patches ship in the wheel
  for backend in ("hopper", "mosaic.backend", "mosaic.forward", "mosaic.backward",
                  "triton.backend", "cuda_sm90.fused_backward", "jax_blockwise"):
    assert f"kvax_plugin.attention.kernels.{backend}" in got["modules"], backend


def test_info_reports_no_defect(installed, tmp_path):
  r = _run(installed, "-m", "kvax_plugin.info", "--json", cwd=str(tmp_path))
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  info = json.loads(r.stdout)
  assert info["defects"] == []
  assert set(info["backends"]) == {"hopper", "mosaic", "triton", "jax", "reference"}
  assert all(b["imports"] for b in info["backends"].values())
  assert info["auto"]["backend"] == "jax"  # CPU
  assert info["versions"]["jax"]


def test_demo_runs_from_the_install(installed, tmp_path):
  r = _run(installed, "-m", "kvax_plugin.demo", "--seq_len", "256", "--batch", "1",
           "--repeats", "1", "--out", str(tmp_path / "demo"), cwd=str(tmp_path))
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert "all outputs and gradients agree with the reference" in r.stdout
  summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
  assert summary["config"]["backend_resolved"] == "jax"


@pytest.mark.maxtext
def test_launcher_trains_two_steps_from_the_install(installed, tmp_path):
  pytest.importorskip("maxtext")
  out = tmp_path / "run"
  r = _run(installed, "-m", "kvax_plugin.launch", "--config=llama3:tiny", "--config.steps=2",
           "--config.seq_len=256", f"--config.output_dir={out}", cwd=str(tmp_path), timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  losses = summary["losses"]
  assert len(losses) == 2 and all(0 < x < 100 for x in losses), losses
