"""Registers and spills of the Mosaic GPU kernels, from ptxas (run on a GPU).

    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/ptxas python benchmarks/mosaic_resources.py

Compiles forward + backward once per backward mode (deterministic, fused with column-split dq,
fused with whole dq partials, and the small-CTA dk/dv kernel fused and deterministic) at a small causal shape with head dim 128, so that Mosaic GPU
writes each kernel's ptxas report (registers per thread, spill stores / loads, shared memory)
into $MOSAIC_GPU_DUMP_TO. The reports answer whether a kernel variant spills.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from kvax_plugin.attention.block_mask import create_attention_mask
from kvax_plugin.attention.kernels.mosaic import backend as mosaic


def main():
  s, h, kh, d = 2048, 8, 2, 128
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  seg = jnp.zeros((1, s), jnp.int32)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (1, s, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, s, kh, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, s, kh, d), jnp.bfloat16)
  for label, det, env in (("deterministic", True, {}), ("fused_split", False, {}),
                          ("fused_whole", False, {"KVAX_MOSAIC_DQ_WHOLE": "1"}),
                          ("small_fused", False, {"KVAX_MOSAIC_BWD_SMALL": "1"}),
                          ("small_deterministic", True, {"KVAX_MOSAIC_BWD_SMALL": "1"})):
    for name in ("KVAX_MOSAIC_DQ_WHOLE", "KVAX_MOSAIC_BWD_SMALL"):
      os.environ.pop(name, None)
    os.environ.update(env)

    def loss(q, k, v, det=det):
      out = mosaic.flash_attention_mosaic(q, k, v, pos, seg, pos, seg, mask, scale=d ** -0.5,
                                          logits_soft_cap=None, sinks=None,
                                          deterministic_backward=det)
      return jnp.sum(out.astype(jnp.float32))
    print(f"=== {label}", flush=True)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    jax.block_until_ready(grads)
    print(f"=== {label} done", flush=True)


if __name__ == "__main__":
  main()
