"""Every Python block of README.md runs as written, each in a fresh process on the CPU (8
simulated devices, as the context-parallel block needs). The Levanter block runs in Levanter's
own environment: integration/levanter/test_readme_levanter.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import readme_blocks

BLOCKS = [(line, code) for line, code in readme_blocks.python_blocks()
          if not readme_blocks.needs_levanter(code)]


def test_readme_has_its_blocks():
  all_blocks = readme_blocks.python_blocks()
  assert len(BLOCKS) >= 4, "quick start, context parallelism, migration, MaxText"
  assert sum(readme_blocks.needs_levanter(c) for _, c in all_blocks) == 1


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code, tmp_path):
  if "maxtext" in code:
    pytest.importorskip("maxtext")
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "xla_force_host_platform_device_count" not in f)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip())
  script = tmp_path / "block.py"
  script.write_text(code)
  r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, f"README.md:{line}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
