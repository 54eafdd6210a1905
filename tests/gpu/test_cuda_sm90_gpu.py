"""The CUDA C++ fused backward (kvax_plugin/attention/kernels/cuda_sm90) against the float32
reference on a Hopper GPU: out, dq, dk, dv on small awkward layouts (GQA, MQA with padding and
one-token documents, non-contiguous segments, non-causal with huge segment ids, two batch
rows). Needs the
shared object built by its build.sh (skipped, with the reason, where it is absent)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from mosaic_marks import MOSAIC_GPU_MARKS  # noqa: E402
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as cuda_bwd  # noqa: E402

pytestmark = MOSAIC_GPU_MARKS + [
    pytest.mark.skipif(not cuda_bwd.LIB.exists(), reason=f"{cuda_bwd.LIB.name} not built "
                       "(python -m kvax_plugin.attention.kernels.cuda_sm90.build)")]


# "hopper": the same kernel through the public op (kvax_plugin.flash_attention, backend="hopper")
@pytest.mark.parametrize("variant", sorted(cuda_bwd.VARIANTS) + ["hopper"])
@pytest.mark.parametrize("name", ["causal_gqa_512", "docs_padding_mqa_1024",
                                  "non_contiguous_768", "not_causal_docs_640",
                                  "batch2_docs_384", "query_shorter_docs_768"])
def test_fused_backward_against_reference(name, variant):
  import cuda_backward_check as check
  row = check.check_case(name, variant)
  assert row["finite"], row
  assert max(row["errors"].values()) < 2e-2, row


def test_hopper_runs_on_every_gpu_of_the_process():
  """backend="hopper" on each visible GPU in turn, against the float32 reference: the handler's
  per-device state (the kernel's shared-memory limit; S20G's first context-parallel run hung
  when only the first device had it). benchmarks/hopper_on_each_device.py is the same check as
  a program (run on 2 x H200 in S20G)."""
  import jax
  import hopper_on_each_device as each
  for device in jax.devices():
    assert each.check_device(device) < 2e-2, device
