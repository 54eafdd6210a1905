"""The backward's delta = rowsum(dO * O) reads the cotangent the kernels read (custom_vjp.as_stored).

A query row that sees exactly one key has a constant softmax: its dq, and the dk of keys only such
rows see, are 0 in exact arithmetic and ~1e-6 from a correct kernel. When the float32 cotangent is
a jit argument, XLA may skip its rounding to bf16 where it is widened again for delta, while the
kernels read the rounded one: those gradients then hold bf16's rounding of dO V, orders of
magnitude above a correct kernel's (a constant cotangent is rounded at compile time and would
hide it). The CPU's XLA keeps the rounding, so this runs on the GPU.

    python -m pytest -m gpu tests/gpu/test_cotangent_rounding_gpu.py -v
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import layouts  # noqa: E402  (tests/layouts.py)

from kvax_plugin.attention.api import create_attention_mask, flash_attention  # noqa: E402
from kvax_plugin.attention.kernels import availability  # noqa: E402

pytestmark = pytest.mark.gpu

B, S, H, KH, D = 2, 384, 8, 1, 128


@pytest.mark.parametrize("backend", ["hopper", "mosaic", "triton", "jax"])
def test_one_key_rows_get_zero_gradients_with_a_traced_cotangent(backend):
  ok, why = availability(backend)
  if not ok:
    pytest.skip(f"{backend}: {why}")
  rng = np.random.default_rng(7)
  # 25 one-token documents among 27, 3 padding tokens at the end of each row
  pos, seg = layouts.packed_documents(rng, B, S, num_docs=27, one_token_docs=25, pad_tail=3)
  ints = tuple(jnp.asarray(x, jnp.int32) for x in (pos, seg, pos, seg))
  mask = create_attention_mask(*ints, calc_bwd_mask=True, causal=False)
  draw = lambda *shape: rng.standard_normal(shape, np.float32)
  q, k, v = (jnp.asarray(draw(*s), jnp.bfloat16) for s in ((B, S, H, D), (B, S, KH, D),
                                                           (B, S, KH, D)))
  cot = jnp.asarray(draw(B, S, H, D))

  @jax.jit
  def grads(q, k, v, cot, ints, mask):  # cot an argument, as a training step's gradient is
    def loss(q, k, v):
      out = flash_attention(q, k, v, *ints, mask, backend=backend)
      return jnp.sum(out.astype(jnp.float32) * cot)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  dq, dk, dv = (np.asarray(x, np.float32) for x in grads(q, k, v, cot, ints, mask))
  keep = layouts.dense_mask_np(pos, seg, pos, seg, causal=False)
  single = keep.sum(axis=2) == 1  # [B, S] rows that see one key
  only_single = keep.any(axis=1) & ~(keep & ~single[:, :, None]).any(axis=1)  # [B, S] keys
  assert single.sum() >= 40 and only_single.sum() >= 40
  for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.all(np.isfinite(x)), name
  # the other rows are real gradients (dv of the one-key rows is dO itself)
  assert np.abs(dq[~single & (seg != -1)]).max() > 1e-2
  assert np.abs(dv[only_single]).max() > 1e-1
  # 2e-6 from every backend once delta reads the rounded cotangent; 2e-2 before
  assert np.abs(dq[single]).max() < 1e-4, np.abs(dq[single]).max()
  assert np.abs(dk[only_single]).max() < 1e-4, np.abs(dk[only_single]).max()
