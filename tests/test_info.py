"""python -m kvax_plugin.info and the registry's auto_choice it reports (CPU)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from kvax_plugin import info
from kvax_plugin.attention import kernels


def test_auto_choice_names_why_each_backend_was_passed_over():
  if jax.default_backend() != "cpu":
    pytest.skip("the reasons asserted are a CPU machine's")
  name, passed = kernels.auto_choice(jnp.bfloat16, 128, 128, deterministic_backward=True)
  assert name == "jax" == kernels.resolve_backend_for("auto", jnp.bfloat16, 128, 128)
  assert list(passed) == ["hopper", "mosaic", "triton"]
  assert "reproducible" in passed["hopper"] and "no GPU" in passed["mosaic"]


def test_info_reports_every_backend_and_no_defect(capsys):
  assert info.main(["--json", "--head-dim", "64", "--features", "sliding_window"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert set(out["backends"]) == set(kernels.KERNEL_BACKENDS) and out["defects"] == []
  assert out["auto"]["call"]["features"] == ["sliding_window"]
  assert out["auto"]["backend"] == kernels.resolve_backend_for(
      "auto", jnp.bfloat16, 64, 64, ("sliding_window",))
