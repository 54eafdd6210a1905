"""backend="hopper" forward+backward on every visible GPU in one process, each against the
float32 reference: what a multi-GPU program (context parallelism, data parallelism) needs of the
fused backward's FFI handler, one device at a time so a failure names its device instead of
hanging a collective.

  python benchmarks/hopper_on_each_device.py   # prints one line per device; exit 1 on a failure
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import kvax_plugin as kp
from kvax_plugin.attention.block_mask import create_attention_mask
from kvax_plugin.attention.reference import reference_attention


def check_device(device, seq: int = 1024, heads: int = 4, kv_heads: int = 2) -> float:
  """Largest relative L2 error of out, dq, dk, dv on `device` (bf16 against float32)."""
  rng = np.random.default_rng(device.id)
  q, k, v, d_out = (jnp.asarray(rng.standard_normal((1, seq, n, 128)), jnp.bfloat16)
                    for n in (heads, kv_heads, kv_heads, heads))
  pos = jnp.arange(seq, dtype=jnp.int32)[None]
  seg = jnp.asarray((np.arange(seq) >= seq // 3).astype(np.int32))[None]  # two documents
  q, k, v, d_out, pos, seg = jax.device_put((q, k, v, d_out, pos, seg), device)
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  scale = 128 ** -0.5

  def grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(d_out.astype(out.dtype)))

  ours = grads(lambda q, k, v: kp.flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=scale,
                                                  backend="hopper"), q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  want = grads(lambda q, k, v: reference_attention(q, k, v, pos, seg, pos, seg, scale=scale),
               f32(q), f32(k), f32(v))
  errors = [float(jnp.linalg.norm(f32(a) - b) / jnp.linalg.norm(b)) for a, b in zip(ours, want)]
  assert all(list(x.devices())[0] == device for x in ours)
  return max(errors)


def main() -> int:
  failed = 0
  for device in jax.devices():
    try:
      err = check_device(device)
      ok = err < 2e-2
      print(f"device {device.id} ({device.device_kind}): max rel L2 {err:.2e} {'ok' if ok else 'FAIL'}")
    except Exception as e:  # report, go on to the next device
      ok = False
      print(f"device {device.id} ({device.device_kind}): FAIL {type(e).__name__}: {e}")
    failed += not ok
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
