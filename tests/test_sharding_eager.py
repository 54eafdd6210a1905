"""The README's sharded example: eager calls on plain arrays, Explicit (jax.make_mesh) and Auto meshes."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvax_plugin as kvax


# The kvax calls are eager (what is tested); the reference is jitted (one compile, not one per
# op), module-level so both cases share it, with every array an argument (closed over, XLA would
# constant-fold their part of it).
_reference = jax.jit(lambda q, k, v, pos, seg: kvax.reference_attention(q, k, v, pos, seg, pos,
                                                                         seg, scale=0.125))
_reference_grad = jax.jit(jax.grad(lambda q, *a: jnp.sum(_reference(q, *a) ** 2)))


@pytest.mark.parametrize("explicit", [True, False], ids=["make_mesh-explicit", "Mesh-auto"])
def test_eager_sharded_call_matches_reference(explicit):
  if len(jax.devices()) < 8:
    pytest.fail("tests/conftest.py should have given 8 CPU devices")
  b, s, h, k, d = 2, 256, 4, 2, 64
  seg = jnp.concatenate([jnp.zeros((b, 100), jnp.int32), jnp.ones((b, 140), jnp.int32),
                         -jnp.ones((b, 16), jnp.int32)], axis=1)
  pos = kvax.positions_from_segment_ids(seg)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (b, s, h, d))
  kk = jax.random.normal(keys[1], (b, s, k, d))
  v = jax.random.normal(keys[2], (b, s, k, d))
  if explicit:
    mesh = jax.make_mesh((2, 4), ("fsdp", "context"))
    ctx = jax.set_mesh(mesh)
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "context"))
    ctx = contextlib.nullcontext()
  ref_fn = lambda q: _reference(q, kk, v, pos, seg)  # noqa: E731
  with ctx, kvax.attention_specs((("fsdp",), "context", None, None)):
    mask = kvax.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, mesh=mesh)
    fn = lambda q: kvax.flash_attention(q, kk, v, pos, seg, pos, seg, mask, scale=0.125,
                                        mesh=mesh, backend="jax")
    out = fn(q)
    grad = jax.grad(lambda q: jnp.sum(fn(q) ** 2))(q)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_fn(q)), atol=2e-5)
  grad_ref = _reference_grad(q, kk, v, pos, seg)
  rel = float(jnp.linalg.norm(grad - grad_ref) / jnp.linalg.norm(grad_ref))
  assert rel < 1e-5, rel
