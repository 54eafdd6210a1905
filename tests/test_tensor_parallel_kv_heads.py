"""Tensor parallelism with replicated or fewer key/value heads, as kvax runs it: query heads
sharded over a 'model' axis, kv_specs[2] None (kv heads replicated) for MHA, GQA and MQA, also
with fewer kv heads than head shards, kv groups straddling shard borders, and a context axis.
Forward output and dq / dk / dv must equal the single-device float32 reference (the kv
gradients are the sum over every shard that read a kv head). 8 simulated CPU devices
(tests/conftest.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import kvax_plugin as kp
from kvax_plugin.attention import context_parallel

try:
  CPUS = jax.devices("cpu")
except RuntimeError:
  CPUS = []
pytestmark = pytest.mark.skipif(len(CPUS) < 8, reason="needs 8 CPU devices (tests/conftest.py "
                                "sets XLA_FLAGS before jax starts)")

B, S, D = 2, 64, 16
PARAMS = kp.FlashAttentionParamsConfig(16, 16)
DM = ((2, 4), ("data", "model"))
DMC = ((2, 2, 2), ("data", "model", "context"))
Q_DM = ("data", None, "model", None)
Q_DMC = ("data", "context", "model", None)
KV_REPLICATED = ("data", None, None, None)


def _mesh(shape, names):
  return Mesh(np.array(CPUS[:8]).reshape(shape), names)


def _problem(h, kh, seed=0):
  rng = np.random.default_rng(seed)
  arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q, k, v, w = arr(B, S, h, D), arr(B, S, kh, D), arr(B, S, kh, D), arr(B, S, h, D)
  # Two documents per row, padding at the end of row 1.
  seg = jnp.zeros((B, S), jnp.int32).at[:, 40:].set(1).at[1, 56:].set(-1)
  pos = kp.positions_from_segment_ids(seg)
  return q, k, v, w, pos, seg


@jax.jit
def _reference(q, k, v, w, pos, seg):
  # Jitted (every array an argument): one compile per head layout instead of one per operation.
  def loss(q, k, v):
    out = kp.reference_attention(q, k, v, pos, seg, pos, seg, scale=D ** -0.5)
    return jnp.sum(out * w), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, *grads


def _sharded(q, k, v, w, pos, seg, mesh, query_specs, kv_specs, order="natural"):
  """(out, dq, dk, dv) of one jitted mask + forward + backward on `mesh`; the tokens arrive in
  `order` and the results are returned in natural order."""
  cp = context_parallel.context_size(mesh, query_specs)
  if order == "llama3":
    q, k, v, w, pos, seg = context_parallel.to_load_balanced_order((q, k, v, w, pos, seg), cp)
  kw = dict(mesh=mesh, query_specs=query_specs, kv_specs=kv_specs, token_order=order)

  def step(q, k, v):
    mask = kp.create_attention_mask(pos, seg, pos, seg, PARAMS, PARAMS, True, **kw)

    def loss(q, k, v):
      out = kp.flash_attention(q, k, v, pos, seg, pos, seg, mask, D ** -0.5, backend="jax", **kw)
      return jnp.sum(out * w), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, *grads

  got = jax.jit(step)(q, k, v)
  if order == "llama3":
    got = context_parallel.from_load_balanced_order(tuple(got), cp)
  return got


def _assert_close(got, want, label):
  for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5,
                               err_msg=f"{label}: {name}")


# (heads, kv heads) over 4 'model' shards, kv heads replicated: MHA (each shard takes its 2 kv
# heads), GQA with K = shards (1 each), GQA with K < shards (a kv head shared by 2 shards), MQA,
# and 3 kv heads of 12 query heads, whose groups of 4 straddle the shards' 3 query heads.
REPLICATED = [(8, 8), (8, 4), (8, 2), (8, 1), (12, 3)]


@pytest.mark.parametrize("h,kh", REPLICATED, ids=[f"H{h}-K{k}" for h, k in REPLICATED])
def test_replicated_kv_heads_data_model(h, kh):
  args = _problem(h, kh)
  got = _sharded(*args, _mesh(*DM), Q_DM, KV_REPLICATED)
  _assert_close(got, _reference(*args), f"2x4 data x model, H={h} K={kh}, kv heads replicated")


@pytest.mark.parametrize("h,kh,order", [(8, 2, "llama3"), (8, 1, "natural")])
def test_replicated_kv_heads_with_context_axis(h, kh, order):
  # Heads over 'model' (2) and the sequence over 'context' (2): the kv heads a shard takes are
  # then all-gathered over the context axis, and their gradients reduced over both.
  args = _problem(h, kh, seed=1)
  got = _sharded(*args, _mesh(*DMC), Q_DMC, KV_REPLICATED, order=order)
  _assert_close(got, _reference(*args), f"2x2x2 data x model x context, H={h} K={kh} {order}")


def test_kv_heads_sharded_like_query_heads_still_work():
  # The existing path: kv heads sharded on the same axis (K = 4 over 4 shards, and K = 2 < 4
  # shards, where the kv heads enter whole and each shard takes the one it reads).
  for kh in (4, 2):
    args = _problem(8, kh, seed=2)
    got = _sharded(*args, _mesh(*DM), Q_DM, ("data", None, "model", None))
    _assert_close(got, _reference(*args), f"kv heads sharded over 'model', K={kh}")


def test_kvax_style_surrounding_mesh_mqa():
  # kvax's way: jax.set_mesh + attention_specs, no mesh= or specs at the calls; MQA.
  q, k, v, w, pos, seg = _problem(8, 1, seed=3)
  mesh = _mesh(*DM)
  with jax.set_mesh(mesh), kp.attention_specs(Q_DM, KV_REPLICATED):
    mask = kp.create_attention_mask(pos, seg, pos, seg, PARAMS, PARAMS, True)
    out = kp.flash_attention(q, k, v, pos, seg, pos, seg, mask, D ** -0.5, backend="jax")
  np.testing.assert_allclose(np.asarray(out), np.asarray(_reference(q, k, v, w, pos, seg)[0]),
                             rtol=2e-5, atol=2e-5)


def test_head_spec_errors_name_both_specs():
  q, k, v, _, pos, seg = _problem(8, 2)
  mesh = _mesh(*DM)
  # The mask does not depend on heads: build a valid one, then call with wrong kv specs.
  mask = kp.create_attention_mask(pos, seg, pos, seg, PARAMS, mesh=mesh, query_specs=Q_DM,
                                  kv_specs=KV_REPLICATED)
  call = lambda qs, kvs: kp.flash_attention(  # noqa: E731
      q, k, v, pos, seg, pos, seg, mask, backend="jax", mesh=mesh, query_specs=qs, kv_specs=kvs)
  with pytest.raises(ValueError, match=r"kv_specs\[2\] \(heads\) shards the key/value heads over "
                     r"'model' but query_specs\[2\] leaves the query heads unsharded: expected "
                     r"kv_specs\[2\] None"):
    call(("data", None, None, None), ("data", None, "model", None))
  with pytest.raises(ValueError, match=r"query_specs\[2\] and kv_specs\[2\] \(heads\) name "
                     r"different mesh axes, 'model' and 'data'"):
    call((None, None, "model", None), (None, None, "data", None))
  # Sharded kv heads that neither split over nor are shared by the 4 shards: the error names
  # the replicated alternative.
  k3, v3 = k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2)
  q12 = jnp.concatenate([q, q[:, :, :4]], axis=2)
  with pytest.raises(ValueError, match=r"key/value heads \(3\).*must divide one another.*"
                     r"kv_specs\[2\]=None"):
    kp.flash_attention(q12, k3, v3, pos, seg, pos, seg, mask, backend="jax", mesh=mesh,
                       query_specs=Q_DM, kv_specs=("data", None, "model", None))
