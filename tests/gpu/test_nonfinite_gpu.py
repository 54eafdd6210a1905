"""GPU kernels against the NaN / inf contract (tests/nonfinite_cases.py): on a GPU, max() does not
propagate NaN and exp2 / division follow the hardware, so the CPU interpreter runs are not
enough. Every case: NaN / inf in q, k, v, scale, soft cap, sinks; padding rows exactly 0.

    python -m pytest -m gpu tests/gpu/test_nonfinite_gpu.py -v -s
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nonfinite_cases  # noqa: E402  (tests/nonfinite_cases.py)

from kvax_plugin.attention.kernels import availability, backend_function  # noqa: E402
from kvax_plugin.attention.params import FlashAttentionParamsConfig  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)])
def test_triton_nan_inf_follow_the_reference(dtype, tol):
  ok, why = availability("triton")
  if not ok:
    pytest.skip(f"Triton backend: {why}")
  failures = nonfinite_cases.run_cases(backend_function("triton"), dtype=dtype, tol=tol)
  assert not failures, "\n".join(failures)


def test_mosaic_nan_inf_follow_the_reference():
  ok, why = availability("mosaic")
  if not ok:
    pytest.skip(f"Mosaic backend: {why}")
  # The Mosaic kernels take 16-bit inputs, head dims in multiples of 64 and 128 x 64 blocks.
  failures = nonfinite_cases.run_cases(backend_function("mosaic"), dtype=jnp.bfloat16, head_dim=64, tol=3e-2,
                                       params=FlashAttentionParamsConfig(128, 128))
  assert not failures, "\n".join(failures)


def test_hopper_nan_inf_follow_the_reference():
  """The CUDA backward masks in a pass of its own before the exponentials (dropped logits set to
  -inf on steps the table does not keep whole) or, for a scale that is not > 0, in the loop: a
  NaN / inf logit on a dropped pair must not reach P, dS or the gradients either way."""
  ok, why = availability("hopper")
  if not ok:
    pytest.skip(f"hopper backend: {why}")
  failures = nonfinite_cases.run_cases(backend_function("hopper"), dtype=jnp.bfloat16, head_dim=64,
                                       tol=3e-2, params=FlashAttentionParamsConfig(128, 128))
  assert not failures, "\n".join(failures)
