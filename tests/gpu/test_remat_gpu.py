"""GPU test: under a remat policy that saves the forward's residuals, XLA's compiled training
step holds each attention kernel once (forward, dk/dv, dq), and gives the same gradients as
recomputing everything.

Why a GPU test: on the GPU XLA's dynamic-slice fusion can clone the forward kernel into the
update that stacks its saved output across a scan over layers, so the forward runs twice per
layer although JAX saved its residuals (as in MaxText llama3-8b; the guard against it:
kvax_plugin/attention/kernels/custom_vjp.saved_residuals). Only XLA's GPU pipeline does this, so
only the compiled GPU module can show it.

    python -m pytest -m gpu tests/gpu/test_remat_gpu.py -v
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import layouts  # noqa: E402

import kvax_plugin as kvax  # noqa: E402
from mosaic_marks import MOSAIC_GPU_MARKS  # noqa: E402
from kvax_plugin.attention.kernels.custom_vjp import RESIDUAL_NAME  # noqa: E402


pytestmark = MOSAIC_GPU_MARKS

LAYERS, S, H, KH, D = 3, 1024, 4, 2, 128


def scanned_layers_step(policy):
  """value_and_grad of a toy decoder: LAYERS scanned residual blocks x += attention(x W_q, ...),
  each under jax.checkpoint(policy) as MaxText runs its layers. Returns (jitted step, args)."""
  rng = np.random.default_rng(0)
  pos, seg = layouts.packed_documents(rng, 1, S, num_docs=3, pad_tail=0)
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)
  mask = kvax.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  x = jnp.asarray(rng.standard_normal((1, S, H * D)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((LAYERS, 3, H * D, H * D)) / np.sqrt(H * D), jnp.bfloat16)

  def layer(x, wl):
    q = (x @ wl[0]).reshape(1, S, H, D)
    k = (x @ wl[1]).reshape(1, S, H, D)[:, :, :KH]
    v = (x @ wl[2]).reshape(1, S, H, D)[:, :, :KH]
    out = kvax.flash_attention(q, k, v, pos, seg, pos, seg, mask, backend="mosaic")
    return x + out.reshape(1, S, H * D), None

  def loss(x, w):
    y, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, w)
    return jnp.sum(y.astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (x, w)


def mosaic_calls(step, args) -> int:
  text = step.lower(*args).compile().as_text()
  return len(re.findall(r'custom_call_target="mosaic_gpu', text))


def test_saved_residuals_are_not_recomputed_by_xla():
  saving = jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME)
  step, args = scanned_layers_step(saving)
  assert mosaic_calls(step, args) == 3, "forward, dk/dv and dq, once each"
  full, _ = scanned_layers_step(jax.checkpoint_policies.nothing_saveable)
  assert mosaic_calls(full, args) == 4, "nothing saved: the forward reruns in the backward"
  (l1, (gx1, gw1)), (l2, (gx2, gw2)) = step(*args), full(*args)
  assert float(l1) == float(l2)
  for a, b in ((gx1, gx2), (gw1, gw2)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())
