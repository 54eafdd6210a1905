"""No S x S buffer: compiled memory statistics of forward+backward at S = 32k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import layouts
import kvax_plugin as kp


def test_forward_backward_memory_is_linear_at_32k():
  s, h, kh, d = 32768, 2, 1, 16
  pos, seg = layouts.packed_documents(np.random.default_rng(0), 1, s, num_docs=12, pad_tail=1000)
  ints = tuple(jnp.asarray(x) for x in (pos, seg, pos, seg))
  q = jax.ShapeDtypeStruct((1, s, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, s, kh, d), jnp.bfloat16)

  def loss(q, k, v, *ints):
    mask = kp.create_attention_mask(*ints, calc_bwd_mask=True)
    out = kp.flash_attention(q, k, v, *ints, mask, backend="jax")
    return jnp.sum(out.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  stats = grad.lower(q, kv, kv, *ints).compile().memory_analysis()
  temp = stats.temp_size_in_bytes
  score_matrix = s * s * 4  # one float32 S x S buffer: 4 GiB
  # Inputs, outputs, lse/delta and per-block scratch: tens of MiB, nowhere near S x S.
  assert temp < 256 * 2**20, f"forward+backward temp memory {temp / 2**20:.0f} MiB"
  assert temp < score_matrix / 16
