"""The Mosaic GPU kernels under Pallas' interpreter race detector (CPU).

Every kernel of a case (forward, dk/dv, dq or the fused dk/dv + dq) runs with
`InterpretGPUParams(detect_races=True)`; the detector prints "RACE DETECTED" for any pair of
accesses to one buffer that no barrier orders. Its model of TMA writes is stricter than the
hardware for ring reuse (see kernels/mosaic/forward.py `released_for_tma`), which the kernels
account for in interpreter mode only; everything else it reports is a real race, such as the
fused backward's K buffer staged with dK while the other consumer's last dQ product could
still read it (found this way in session 6, fixed by the `k_done` barrier).
Cases with more blocks than ring slots, so every ring wraps around.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402

import test_mosaic_interpret as kernels_in_interpreter  # noqa: E402


@pytest.mark.parametrize("name", ["window_masked_full_masked_det", "docs_padding_gqa"])
def test_kernels_have_no_race_in_the_interpreter(name, monkeypatch, capfd):
  """Deterministic backward (forward, dk/dv and dq kernels; K/V and q/dO rings wrap) and the
  fused backward (column-split dq, shared dS, the K buffer reused for dK): no race reported,
  and the results still match the float32 reference."""
  monkeypatch.setattr(plgpu, "InterpretGPUParams",
                      functools.partial(plgpu.InterpretGPUParams, detect_races=True))
  kernels_in_interpreter.test_kernels_in_interpreter_match_reference(name)
  out, err = capfd.readouterr()
  assert "RACE DETECTED" not in out + err, (out + err)[:4000]
