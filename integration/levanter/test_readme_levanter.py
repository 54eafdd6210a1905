"""README.md's Levanter block runs as written, in Levanter's environment."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import readme_blocks  # noqa: E402


def test_readme_levanter_block_runs(tmp_path):
  (code,) = [c for _, c in readme_blocks.python_blocks() if readme_blocks.needs_levanter(c)]
  script = tmp_path / "block.py"
  script.write_text(code)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
