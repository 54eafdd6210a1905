"""Context parallelism on >= 2 GPUs against one GPU (marker: multigpu), with the Triton and the
hopper backends, each token order, with and without the overlapped kv exchange
(overlap_kv_gather), and at 4 shards with the dk / dv sum in bf16 (kv_grad_reduce_dtype).

Run on a 2- or 4-GPU machine: `python -m pytest -q -m multigpu tests/test_sharding_gpu.py`
(the 4-shard cases need 4 GPUs and are skipped with fewer).
Skipped elsewhere (with the reason). The full-size agreement / speed-up run is
benchmarks/bench_context_parallel.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvax_plugin.attention import token_order
from kvax_plugin.attention.api import create_attention_mask, flash_attention
from kvax_plugin.attention.kernels import availability

try:
  GPUS = jax.devices("gpu")
except RuntimeError:
  GPUS = []

pytestmark = [
    pytest.mark.gpu, pytest.mark.multigpu,
    pytest.mark.skipif(len(GPUS) < 2, reason=f"needs >= 2 GPUs, found {len(GPUS)}"),
]


def _layout(rng, batch, length, num_docs, pad):
  seg = np.full((batch, length), -1, np.int32)
  pos = np.zeros((batch, length), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length - pad), size=num_docs - 1, replace=False))
    bounds = [0, *cuts.tolist(), length - pad]
    for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[b, lo:hi], pos[b, lo:hi] = d, np.arange(hi - lo)
  return pos, seg


CASES = [  # (backend, context shards, token order, overlap_kv_gather, kv_grad_reduce_dtype)
    *[("triton", 2, order, False, "auto") for order in ("natural", "llama3", "balanced")],
    ("triton", 2, "balanced", True, "auto"),
    *[("hopper", 2, order, False, "auto") for order in ("natural", "llama3", "balanced")],
    ("hopper", 2, "natural", True, "auto"), ("hopper", 2, "balanced", True, "auto"),
    ("hopper", 4, "balanced", False, "auto"), ("hopper", 4, "balanced", False, "input"),
    ("hopper", 4, "balanced", True, "auto"),
]


@pytest.mark.parametrize("backend,cp,order,overlap,reduce", CASES)
def test_context_parallel_matches_one_gpu(backend, cp, order, overlap, reduce):
  ok, reason = availability(backend)
  if not ok:
    pytest.skip(reason)
  if len(GPUS) < cp:
    pytest.skip(f"{cp} context shards need {cp} GPUs, found {len(GPUS)}")
  b, s, h, kh, d = 2, 4096, 8, 2, 64
  rng = np.random.default_rng(0)
  pos, seg = _layout(rng, b, s, 5, 300)
  host = [rng.standard_normal(shape, np.float32).astype(jnp.bfloat16)
          for shape in ((b, s, h, d), (b, s, kh, d), (b, s, kh, d), (b, s, h, d))]
  sinks = rng.standard_normal((h,), np.float32)

  def step(q, k, v, w, sinks, pos, seg, mesh, order):
    kw = dict(mesh=mesh, query_specs=(None, "context", None, None),
              token_order=order) if mesh is not None else {}
    cp_kw = dict(overlap_kv_gather=overlap, kv_grad_reduce_dtype=reduce) if mesh is not None else {}
    mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, **kw, **cp_kw)

    def loss(q, k, v, sinks):
      out = flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=d ** -0.5, sinks=sinks,
                            backend=backend, **kw)
      return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v,
                                                                                     sinks)
    return out, grads

  args = [*host, sinks, pos, seg]
  want = jax.jit(lambda *a: step(*a, None, None))(*(jax.device_put(x, GPUS[0]) for x in args))
  mesh = Mesh(np.array(GPUS[:cp]), ("context",))
  tok = token_order.token_order(pos, seg, cp, order=order)
  tok_args = [np.asarray(x) for x in token_order.apply_token_order(tuple(args[:4] + args[5:]),
                                                                   tok)]
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "context",
                                                           *([None] * (x.ndim - 2)))))
  q, k, v, w, p, sg = (put(x) for x in tok_args)
  got = jax.jit(lambda *a: step(*a, mesh, order))(q, k, v, w, sinks, p, sg)
  got_out, (dq, dk, dv, ds) = got
  got_list = [np.asarray(token_order.undo_token_order(np.asarray(x.astype(jnp.float32)), tok))
              for x in (got_out, dq, dk, dv)]
  want_out, (wq, wk, wv, wsinks) = want
  for name, g, r in zip(("out", "dq", "dk", "dv"), got_list, (want_out, wq, wk, wv)):
    r = np.asarray(r.astype(jnp.float32))
    rel = np.linalg.norm(g - r) / np.linalg.norm(r)
    assert rel < 2e-2, f"{name}: relative L2 error {rel:.3g}"
  np.testing.assert_allclose(np.asarray(ds), np.asarray(wsinks), rtol=2e-2, atol=2e-2)
