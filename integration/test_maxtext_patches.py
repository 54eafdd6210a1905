"""patches/maxtext/<version>/: they apply cleanly to the installed wheel's source, the manifest
is accurate, and the patched MaxText runs attention=kvax without install()."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from maxtext_results import report

pytestmark = pytest.mark.maxtext

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory):
  """A copy of the installed maxtext package with the patches applied (the wheel is untouched)."""
  from kvax_plugin.integrations.maxtext import patching
  root = tmp_path_factory.mktemp("maxtext_patched")
  shutil.copytree(os.path.join(patching.installed_root(), "maxtext"), root / "maxtext")
  return str(root)


def test_manifest_matches_supported_version_and_wheel():
  from maxtext import version
  from kvax_plugin.integrations.maxtext import patching, versions
  assert versions.SUPPORTED_MAXTEXT_VERSIONS[-1] == version.__version__
  directory = patching.patches_dir()
  manifest = patching.load_manifest(directory)
  assert manifest["version"] == version.__version__
  assert sorted(os.listdir(directory)) == sorted(["MANIFEST.json"] +
                                                 [p["file"] for p in manifest["patches"]])
  for p in manifest["patches"]:
    assert p["purpose"] and len(p["sha256_upstream"]) == 64 and len(p["sha256_patched"]) == 64
  # The installed wheel is pristine upstream (tests never patch it in place).
  assert set(patching.state(patching.installed_root(), directory).values()) == {"upstream"}


def test_patches_apply_cleanly_with_patch(patched_root, tmp_path):
  from kvax_plugin.integrations.maxtext import patching
  directory = patching.patches_dir()
  manifest = patching.load_manifest(directory)
  fresh = tmp_path / "fresh"
  for p in manifest["patches"]:  # plain `patch --dry-run` then apply, file by file, in order
    target = fresh / p["target"]
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(patching.installed_root(), p["target"]), target)
  for p in manifest["patches"]:
    for extra in (["--dry-run"], []):
      proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "-d", str(fresh), "-i",
                             os.path.join(directory, p["file"])] + extra,
                            capture_output=True, text=True)
      assert proc.returncode == 0, proc.stdout + proc.stderr
      assert "offset" not in proc.stdout and "fuzz" not in proc.stdout, proc.stdout
  assert set(patching.state(str(fresh), directory).values()) == {"patched"}
  # The tool: applies, is idempotent, and reverts to the exact upstream bytes.
  assert patching.apply(patched_root, directory)
  assert patching.apply(patched_root, directory) == []
  assert set(patching.state(patched_root, directory).values()) == {"patched"}


def test_patched_config_keys_match_the_plugin(patched_root):
  from kvax_plugin.integrations.maxtext import patching
  from kvax_plugin.integrations.maxtext.settings import KVAX_CONFIG_FIELDS
  code = ("import json, maxtext.configs.types as t; f = t.MaxTextConfig.model_fields; "
          "print(json.dumps({k: f[k].default for k in f if k.startswith('kvax_')}))")
  patching.apply(patched_root, patching.patches_dir())
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": patched_root, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  declared = json.loads(proc.stdout.strip().splitlines()[-1])
  assert declared == {k: v[1] for k, v in KVAX_CONFIG_FIELDS.items()}


@pytest.mark.parametrize("model,extra", [("gemma2-2b", {"sliding_window_size": 48})],
                         ids=["gemma2-2b-window48"])
def test_patched_maxtext_runs_kvax_without_install(patched_root, model, extra):
  from kvax_plugin.integrations.maxtext import patching
  patching.apply(patched_root, patching.patches_dir())
  proc = subprocess.run([sys.executable, os.path.join(HERE, "maxtext_patched_worker.py"), model,
                         json.dumps(extra)], capture_output=True, text=True, timeout=900,
                        env={**os.environ, "PYTHONPATH": patched_root, "JAX_PLATFORMS": "cpu"})
  lines = [l for l in proc.stdout.splitlines() if l.startswith("KVAX_RESULT ")]
  assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
  r = json.loads(lines[-1][len("KVAX_RESULT "):])
  report(f"[maxtext patched, no install()] {model} {extra}: loss dot_product="
         f"{r['loss_dot_product']:.6f} kvax={r['loss_kvax']:.6f} | logits {r['logit_rel_diff']:.2e}"
         f" | worst grad {r['worst_grad_rel_diff']:.2e} at {r['worst_grad']} | {r['trace_counts']}")
  assert r["maxtext_file"].startswith(patched_root)
  assert r["patched"] and not r["installed"]
  assert r["trace_counts"]["prepare"] == 1 and r["trace_counts"]["mask_builds"] == 2
  assert abs(r["loss_kvax"] - r["loss_dot_product"]) <= 1e-5 * abs(r["loss_dot_product"])
  assert r["logit_rel_diff"] <= 1e-5 and not r["grads_over_tolerance"], r["grads_over_tolerance"]
