"""Registers and spills of the Mosaic GPU kernels, from ptxas (run on a GPU).

    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/ptxas python benchmarks/mosaic_resources.py

Compiles forward + backward once per backward mode (deterministic, fused with column-split dq,
fused with whole dq partials; with --modes, the named ones) at a small causal shape with head
dim 128, so that Mosaic GPU writes each kernel's ptxas report (registers per thread, spill
stores / loads, shared memory) into $MOSAIC_GPU_DUMP_TO. The reports answer whether a kernel
variant spills.

    ... python benchmarks/mosaic_resources.py --modes deterministic,one_by_one
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from kvax_plugin.attention.block_mask import create_attention_mask
from kvax_plugin.attention.kernels.mosaic import backend as mosaic


# label: (deterministic backward, environment); every hook named here is reset between modes
MODES = {
    "deterministic": (True, {}),
    "fused_split": (False, {}),
    "fused_whole": (False, {"KVAX_MOSAIC_DQ_WHOLE": "1"}),
    "one_by_one": (True, {"KVAX_MOSAIC_DKV_EARLY_DP": "0"}),
    "regs240": (True, {"KVAX_MOSAIC_BWD_REGS": "240"}),
    "fused_regs240": (False, {"KVAX_MOSAIC_BWD_REGS": "240"}),
    "nofold": (True, {"KVAX_MOSAIC_DKV_FOLD": "0"}),
}
DEFAULT_MODES = "deterministic,fused_split,fused_whole"


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--modes", default=DEFAULT_MODES,
                  help=f"comma-separated, of: {', '.join(MODES)}")
  args = ap.parse_args()
  labels = args.modes.split(",")
  unknown = [m for m in labels if m not in MODES]
  if unknown:
    ap.error(f"--modes: unknown {unknown}; expected some of {list(MODES)}")
  hooks = sorted({name for _, env in MODES.values() for name in env})
  s, h, kh, d = 2048, 8, 2, 128
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  seg = jnp.zeros((1, s), jnp.int32)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (1, s, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, s, kh, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, s, kh, d), jnp.bfloat16)
  for label in labels:
    det, env = MODES[label]
    for name in hooks:
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
