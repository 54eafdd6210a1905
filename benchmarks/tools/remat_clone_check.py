"""How many Mosaic kernels XLA's compiled training step holds under a remat policy that saves
the attention residuals (tests/gpu/test_remat_gpu.py's toy decoder), and how long the step takes:
with and without the optimization barrier in custom_vjp.saved_residuals (--no-barrier patches
it out for this process), and with XLA's dynamic-slice fusion switched off. One configuration
per process (XLA flags are read at start-up); on a machine without a Hopper GPU it exits
saying so:

    python -m benchmarks.tools.remat_clone_check                      # as shipped
    python -m benchmarks.tools.remat_clone_check --no-barrier
    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false \\
        python -m benchmarks.tools.remat_clone_check --no-barrier
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import jax  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402

import test_remat_gpu as t  # noqa: E402
from kvax_plugin.attention.kernels import custom_vjp  # noqa: E402
from kvax_plugin.attention.kernels.mosaic import backend as mosaic_backend  # noqa: E402
from kvax_plugin.attention.kernels.custom_vjp import RESIDUAL_NAME  # noqa: E402


def _without_barrier(out, lse):
  """custom_vjp.saved_residuals as it was before the barrier (the clone's reproduction)."""
  return checkpoint_name(out, RESIDUAL_NAME), checkpoint_name(lse, RESIDUAL_NAME)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--no-barrier", action="store_true",
                  help="patch the optimization barrier out of custom_vjp.saved_residuals")
  ap.add_argument("--calls", type=int, default=20, help="timed step calls per policy")
  args = ap.parse_args(argv)
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  ok, why = mosaic_backend.device_supported(gpus[0] if gpus else None)
  if not ok:
    raise SystemExit(f"remat_clone_check needs the Mosaic GPU backend: {why}")
  barrier = not args.no_barrier
  if not barrier:
    custom_vjp.saved_residuals = _without_barrier  # read by the custom VJP at trace time
  rows = {}
  for name, policy in (("save_context", jax.checkpoint_policies.save_only_these_names(
      RESIDUAL_NAME)), ("nothing_saveable", jax.checkpoint_policies.nothing_saveable)):
    step, inputs = t.scanned_layers_step(policy)
    calls = t.mosaic_calls(step, inputs)
    jax.block_until_ready(step(*inputs))
    t0 = time.perf_counter()
    for _ in range(args.calls):
      out = step(*inputs)
    jax.block_until_ready(out)
    rows[name] = dict(mosaic_calls=calls,
                      step_ms=round((time.perf_counter() - t0) / args.calls * 1e3, 3))
  result = dict(barrier=barrier, xla_flags=os.environ.get("XLA_FLAGS", ""), layers=t.LAYERS,
                seq=t.S, rows=rows)
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
