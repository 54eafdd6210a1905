"""A mask knows what it was built for: the mesh (and specs) of a sharded mask, and a fingerprint
of the positions / segment ids and their order, checked on request. Runs on 4 (one test: all 8)
of the 8 simulated CPU devices (tests/conftest.py).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvax_plugin as kp
from kvax_plugin.attention import context_parallel, token_order, validation
from kvax_plugin.attention.block_mask import token_fingerprint

B, S, H, K, D = 2, 64, 2, 1, 16
SPECS = ("data", "context", None, None)
P = kp.FlashAttentionParamsConfig(16, 16)


def _mesh(devices=None):
  devices = jax.devices()[:4] if devices is None else devices
  return jax.make_mesh((2, 2), ("data", "context"), devices=devices,
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)


@pytest.fixture(scope="module")
def problem():
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (B, S, H, D))
  k = jax.random.normal(ks[1], (B, S, K, D))
  v = jax.random.normal(ks[2], (B, S, K, D))
  seg = jnp.zeros((B, S), jnp.int32).at[:, 40:].set(1).at[1, 60:].set(-1)
  pos = kp.positions_from_segment_ids(seg)
  ref = jax.jit(lambda q, k, v: kp.reference_attention(q, k, v, pos, seg, pos, seg))
  return q, k, v, pos, seg, ref(q, k, v)


def _mask(pos, seg, **kw):
  return kp.create_attention_mask(pos, seg, pos, seg, fwd_params=P, bwd_params=P,
                                  permute_tokens_for_load_balance=False, **kw)


def _call(q, k, v, pos, seg, mask, **kw):
  return kp.flash_attention(q, k, v, pos, seg, pos, seg, mask, backend="jax",
                            permute_tokens_for_load_balance=False, **kw)


def test_sharded_mask_brings_its_mesh_and_specs(problem):
  # Built on a mesh, called without mesh= (and outside any attention_specs): it runs sharded on
  # the mask's mesh and specs instead of feeding per-shard tables to a single-device kernel.
  q, k, v, pos, seg, ref = problem
  mesh = _mesh()
  mask = _mask(pos, seg, mesh=mesh, query_specs=SPECS)
  assert isinstance(mask, kp.ShardedAttentionMask) and mask.layout.mesh is mesh
  np.testing.assert_allclose(_call(q, k, v, pos, seg, mask), ref, atol=2e-6)
  # An explicit mesh must be the mask's: same axes but other devices is an error naming it.
  other = _mesh(jax.devices()[3::-1])
  with pytest.raises(ValueError, match="mesh has the axes of the mask's mesh but other devices"):
    _call(q, k, v, pos, seg, mask, mesh=other, query_specs=SPECS)


def test_surrounding_mesh_as_kvax_does(problem):
  # kvax's style: jax.set_mesh + attention_specs, no mesh= anywhere. The mask is built on the
  # surrounding mesh; a mask built outside that context is refused, not run unsharded.
  q, k, v, pos, seg, ref = problem
  mesh = _mesh()
  plain = _mask(pos, seg)
  with jax.set_mesh(mesh), kp.attention_specs(SPECS):
    mask = _mask(pos, seg)
    assert isinstance(mask, kp.ShardedAttentionMask)
    with pytest.raises(TypeError, match=r"mask must come from create_attention_mask\(\.\.\., "
                       r"mesh=mesh\).*surrounding jax.set_mesh.*built without a mesh"):
      _call(q, k, v, pos, seg, plain)
  # Without specs the surrounding mesh is not used: one device, as before.
  with jax.set_mesh(mesh):
    assert not isinstance(_mask(pos, seg), kp.ShardedAttentionMask)


def test_token_fingerprint_ignores_order_not_content():
  rng = np.random.default_rng(0)
  seg = np.sort(rng.integers(0, 4, (3, 50)), axis=1).astype(np.int32)
  pos = np.asarray(kp.positions_from_segment_ids(jnp.asarray(seg)))
  f = np.asarray(token_fingerprint(jnp.asarray(pos), jnp.asarray(seg)))
  perm = rng.permutation(50)
  np.testing.assert_array_equal(f, token_fingerprint(jnp.asarray(pos[:, perm]),
                                                     jnp.asarray(seg[:, perm])))
  seg2 = seg.copy()
  seg2[1, 10:] = 7  # row 1: other document boundaries
  pos2 = np.asarray(kp.positions_from_segment_ids(jnp.asarray(seg2)))
  f2 = np.asarray(token_fingerprint(jnp.asarray(pos2), jnp.asarray(seg2)))
  assert f2[0] == f[0] and f2[2] == f[2] and f2[1] != f[1]


def test_mask_of_another_batch_is_caught_when_checks_are_on(problem, monkeypatch):
  q, k, v, pos, seg, ref = problem
  mask = _mask(pos, seg)
  seg2 = seg.at[0, 20:].set(1)  # row 0: another document layout, same shapes
  pos2 = kp.positions_from_segment_ids(seg2)
  message = r"mask was built from other positions / segment ids .*batch rows \[0\]"
  _call(q, k, v, pos2, seg2, mask)  # off by default: no check (the answer is then wrong)
  with kp.check_mask_inputs():
    with pytest.raises(ValueError, match=message):
      _call(q, k, v, pos2, seg2, mask)
    jitted = jax.jit(lambda p, s: _call(q, k, v, p, s, mask))
    np.testing.assert_allclose(jitted(pos, seg), ref, atol=2e-6)  # same tokens: passes
    with pytest.raises(Exception, match=message):  # a host callback fails the jitted call
      jitted(pos2, seg2).block_until_ready()
  with pytest.raises(ValueError, match=message):
    _call(q, k, v, pos2, seg2, mask, debug=True)
  monkeypatch.setenv("KVAX_CHECK_MASK_INPUTS", "1")
  assert validation.mask_input_checks_enabled()
  with kp.check_mask_inputs(False):
    assert not validation.mask_input_checks_enabled()


def _grads(q, k, v, fn):
  """(out, dq, dk, dv) of sum(fn(q, k, v) * w) for a fixed random cotangent w."""
  w = jax.random.normal(jax.random.PRNGKey(1), q.shape)
  (_, out), grads = jax.value_and_grad(lambda q, k, v: (jnp.sum(fn(q, k, v) * w), fn(q, k, v)),
                                       argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return (out, *grads)


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_mask_on_2x4_mesh_runs_there_with_inputs_on_one_device(problem, axis_types):
  # The mask brings its mesh (2 x 4, data x context) while every input sits committed on one
  # device: the call runs on the mask's mesh (the inputs are moved there), forward and
  # gradients equal to the single-device reference.
  q, k, v, pos, seg, _ = problem
  dev = jax.devices()[0]
  q, k, v, pos, seg = (jax.device_put(x, dev) for x in (q, k, v, pos, seg))
  if axis_types == "explicit":
    mesh = jax.make_mesh((2, 4), ("data", "context"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context"))
  mask = _mask(pos, seg, mesh=mesh, query_specs=SPECS, calc_bwd_mask=True)
  assert mask.layout.mesh is mesh
  flash = lambda q, k, v: _call(q, k, v, pos, seg, mask)  # noqa: E731
  # The reference jitted, its arrays as arguments (one compile, not one per operation); the
  # flash calls stay eager: what is tested.
  want = jax.jit(lambda q, k, v, pos, seg: _grads(q, k, v, lambda q, k, v: kp.reference_attention(
      q, k, v, pos, seg, pos, seg)))(q, k, v, pos, seg)
  # Explicit axes: JAX wants eager work on their outputs (here grad's cotangent) inside the
  # mesh context; the forward runs without it.
  np.testing.assert_allclose(flash(q, k, v), want[0], atol=2e-6)
  with jax.set_mesh(mesh) if axis_types == "explicit" else contextlib.nullcontext():
    got = _grads(q, k, v, flash)
  for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5, err_msg=name)


ORDER_MESSAGE = (r"token order mismatch: mask was built from the same positions / segment ids as "
                 r"this call's but in another order \(query and kv side, batch rows \[0, 1\]\).*"
                 r"natural order and called in load-balanced order.*in the order flash_attention "
                 r"receives them")


def _load_balanced(problem, cp=2):
  q, k, v, pos, seg, ref = problem
  return context_parallel.to_load_balanced_order((q, k, v, pos, seg, ref), cp)


def test_token_fingerprint_ordered_sees_order():
  rng = np.random.default_rng(1)
  seg = np.sort(rng.integers(0, 4, (3, 48)), axis=1).astype(np.int32)
  pos = np.asarray(kp.positions_from_segment_ids(jnp.asarray(seg)))
  f = np.asarray(token_fingerprint(jnp.asarray(pos), jnp.asarray(seg), ordered=True))
  lb = context_parallel.to_load_balanced_order((pos, seg), 2)
  g = np.asarray(token_fingerprint(jnp.asarray(lb[0]), jnp.asarray(lb[1]), ordered=True))
  assert np.all(f != g)
  np.testing.assert_array_equal(  # the same order: the same value
      f, token_fingerprint(jnp.asarray(pos.copy()), jnp.asarray(seg.copy()), ordered=True))


def test_one_device_mask_called_in_another_token_order_is_caught(problem):
  # Built in natural order on one device, called with the tokens in load-balanced order: the
  # tables describe other blocks, so the answer is wrong; with checks on, the call raises.
  q, k, v, pos, seg, ref = problem
  mask = _mask(pos, seg)
  lq, lk, lv, lpos, lseg, lref = _load_balanced(problem)
  wrong = _call(lq, lk, lv, lpos, lseg, mask)  # checks off (default): silently wrong
  assert float(jnp.max(jnp.abs(wrong - lref))) > 0.1
  with kp.check_mask_inputs():
    with pytest.raises(ValueError, match=ORDER_MESSAGE):
      _call(lq, lk, lv, lpos, lseg, mask)
    jitted = jax.jit(lambda *a: _call(*a, mask))
    with pytest.raises(Exception, match=ORDER_MESSAGE):  # under jit: the host callback fails
      jitted(lq, lk, lv, lpos, lseg).block_until_ready()
    # The per-batch balanced order is caught the same way.
    tok = token_order.balanced_order(np.asarray(pos), np.asarray(seg), 2, block=16)
    bq, bk, bv, bpos, bseg = token_order.apply_token_order((q, k, v, pos, seg), tok)
    with pytest.raises(ValueError, match=r"token order mismatch"):
      _call(bq, bk, bv, bpos, bseg, mask)
  with pytest.raises(ValueError, match=ORDER_MESSAGE):
    _call(lq, lk, lv, lpos, lseg, mask, debug=True)


def test_masks_in_the_call_order_pass_the_order_check(problem):
  q, k, v, pos, seg, ref = problem
  lq, lk, lv, lpos, lseg, lref = _load_balanced(problem)
  with kp.check_mask_inputs():
    # One device, mask built from the load-balanced tokens: accepted and exact.
    np.testing.assert_allclose(_call(lq, lk, lv, lpos, lseg, _mask(lpos, lseg)), lref, atol=2e-6)
    # Natural order, one mask reused by two layers inside lax.scan under jit.
    mask = _mask(pos, seg)

    def two_layers(q, mask):
      layer = lambda x, _: (_call(x, k, v, pos, seg, mask), None)  # noqa: E731
      return jax.lax.scan(layer, q, None, length=2)[0]

    out = jax.jit(two_layers)(q, mask)
    assert bool(jnp.all(jnp.isfinite(out)))
    # Context parallelism (2 x 2 data x context): mask and call in the llama3 order.
    mesh = _mesh()
    kw = dict(mesh=mesh, query_specs=SPECS)
    cp_mask = kp.create_attention_mask(lpos, lseg, lpos, lseg, fwd_params=P, token_order="llama3",
                                       **kw)
    got = kp.flash_attention(lq, lk, lv, lpos, lseg, lpos, lseg, cp_mask, backend="jax", **kw)
    np.testing.assert_allclose(got, lref, atol=2e-6)
    # kvax's convention (kvax_plugin.ops): query side permuted, kv ids in natural order at both
    # calls; the op reorders the kv ids itself, which the check accepts.
    ops_mask = kp.ops.create_attention_mask(lpos, lseg, pos, seg, P, mesh=mesh, query_specs=SPECS)
    got = kp.ops.flash_attention(lq, lk, lv, lpos, lseg, pos, seg, ops_mask, backend="jax",
                                 permute_tokens_for_load_balance=True, **kw)
    np.testing.assert_allclose(got, lref, atol=2e-6)


def test_sharded_mask_built_from_natural_query_order_is_caught(problem):
  # Under context parallelism the mask records its order ("llama3" here), but built from
  # natural-order tokens its query tables describe other tokens than the call's.
  q, k, v, pos, seg, ref = problem
  lq, lk, lv, lpos, lseg, lref = _load_balanced(problem)
  kw = dict(mesh=_mesh(), query_specs=SPECS, token_order="llama3")
  mask = kp.create_attention_mask(pos, seg, pos, seg, fwd_params=P, **kw)
  with kp.check_mask_inputs():
    with pytest.raises(ValueError, match=r"token order mismatch.*\(query side, batch rows"):
      kp.flash_attention(lq, lk, lv, lpos, lseg, lpos, lseg, mask, backend="jax", **kw)
