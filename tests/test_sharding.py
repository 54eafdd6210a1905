"""Sharding and context parallelism on 8 simulated CPU devices (tests/conftest.py sets the flag).

The matrix: every split of 8 devices into (batch = data x fsdp, tensor, context) shards (one
(data, fsdp, tensor, context) mesh each: REPRESENTATIVES), inputs in natural and in the Llama 3
load-balanced order, and on a few meshes in the per-batch balanced order (whose
rows each get their own permutation), packed documents with padding; forward output and the
gradients of query, key, value and sinks must equal the single-device jax-backend result.
"""

from __future__ import annotations

import itertools
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kvax_plugin.attention import context_parallel, token_order
from kvax_plugin.attention import specs as specs_lib
from kvax_plugin.attention.api import attention, create_attention_mask, flash_attention
from kvax_plugin.attention.block_mask import AttentionMask, mask_sparsity
from kvax_plugin.attention.params import FlashAttentionParamsConfig

NUM_DEVICES = 8
try:
  CPUS = jax.devices("cpu")
except RuntimeError:  # no CPU backend at all
  CPUS = []
pytestmark = pytest.mark.skipif(
    len(CPUS) < NUM_DEVICES,
    reason=f"needs {NUM_DEVICES} CPU devices, jax started with {len(CPUS)}: XLA_FLAGS="
    "--xla_force_host_platform_device_count=8 must be set before jax initialises "
    "(tests/conftest.py does this unless something initialised jax earlier)")

AXES = ("data", "fsdp", "tensor", "context")
QUERY_SPECS = (("data", "fsdp"), "context", "tensor", None)
KV_SPECS = (("data", "fsdp"), None, "tensor", None)
# Small blocks so that S=256 spans several blocks per shard even at cp=8.
FWD = FlashAttentionParamsConfig(query_block_size=32, kv_block_size=32)
BWD = FlashAttentionParamsConfig(query_block_size=16, kv_block_size=32)
# Head dim 16: the sharding logic is what is tested here (head dims: test_attention_cpu.py), and
# the smallest head dim keeps the 30-odd sharded runs cheap.
B, S, H, K, D = 8, 256, 16, 8, 16
# XLA's CPU backend at optimisation level 0 compiles these programs ~3x faster and runs them about
# as fast; compilation is most of this file's time. Numerics are unchanged (f32 throughout).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _jit(fn, *args):
  return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _mesh_shapes():
  """All (data, fsdp, tensor, context) sizes, powers of two, whose product is 8."""
  out = []
  for e in itertools.product(range(4), repeat=4):
    if sum(e) == 3:
      out.append(tuple(2 ** x for x in e))
  return out


MESH_SHAPES = _mesh_shapes()
# One mesh per (batch = data x fsdp, tensor, context) split: the batch is sharded over
# ("data", "fsdp") together and the op reads only their product, so meshes that differ only in
# how data and fsdp divide it run the same per-device program (each such run costs ~7 s of
# compiling on a CPU). The picks cover both axes > 1, and data = 1 and fsdp = 1 (a size-1 axis
# in the batch spec); the balanced order's meshes below add two more.
REPRESENTATIVES = [(2, 4, 1, 1), (1, 4, 2, 1), (2, 1, 4, 1), (1, 1, 8, 1), (2, 2, 1, 2),
                   (1, 2, 2, 2), (1, 1, 4, 2), (2, 1, 1, 4), (1, 1, 2, 4), (1, 1, 1, 8)]
CASES = [(shape, order) for shape in REPRESENTATIVES
         for order in (("natural", "llama3") if shape[3] > 1 else ("natural",))]
# The balanced order on meshes with context 2, 4 and 8 (batch and heads sharded too).
CASES += [((2, 1, 2, 2), "balanced"), ((1, 2, 1, 4), "balanced"), ((1, 1, 1, 8), "balanced")]


def _split(shape):
  """(batch, tensor, context) shard counts of a (data, fsdp, tensor, context) mesh shape."""
  return shape[0] * shape[1], shape[2], shape[3]


def _mesh(shape, names=AXES):
  return Mesh(np.array(CPUS[:NUM_DEVICES]).reshape(shape), names)


def _documents(rng, batch, length):
  """Packed documents per row, contiguous with per-document positions, then padding; one row
  has a document split in two pieces around another (non-contiguous) and padding in the middle."""
  seg = np.full((batch, length), -1, np.int32)
  pos = np.zeros((batch, length), np.int32)
  for b in range(batch):
    pad = int(rng.integers(0, length // 4))
    cuts = np.sort(rng.choice(np.arange(1, length - pad), size=int(rng.integers(1, 6)),
                              replace=False))
    bounds = [0, *cuts.tolist(), length - pad]
    for d, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[b, a:z] = d + 3 * b  # ids need not start at 0 nor be < S
      pos[b, a:z] = np.arange(z - a)
  # Row 0: document 100 in two pieces around document 101, padding in the middle.
  seg[0] = -1
  seg[0, 0:60], seg[0, 60:100], seg[0, 130:200] = 100, 101, 100
  pos[0] = 0
  pos[0, 0:60], pos[0, 60:100], pos[0, 130:200] = np.arange(60), np.arange(40), 60 + np.arange(70)
  return pos, seg


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(1234)
  with jax.default_device(CPUS[0]):
    pos, seg = _documents(rng, B, S)
    arrays = dict(
        q=jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32),
        k=jnp.asarray(rng.standard_normal((B, S, K, D)), jnp.float32),
        v=jnp.asarray(rng.standard_normal((B, S, K, D)), jnp.float32),
        sinks=jnp.asarray(rng.standard_normal((H,)), jnp.float32),
        w=jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32),  # output cotangent
        pos=jnp.asarray(pos), seg=jnp.asarray(seg))
  return arrays


def _run(d, *, mesh=None, order="natural", soft_cap=None, causal=True, window=None,
         query_specs=QUERY_SPECS, kv_specs=KV_SPECS):
  """(out, (dq, dk, dv, dsinks)) of one jitted mask + forward + backward, in natural order."""
  cp = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in
                                            specs_lib.normalise_spec(query_specs, "q")[1]]))
  names = ("q", "k", "v", "w", "pos", "seg")
  q, k, v, w, pos, seg = (d[n] for n in names)
  tok = None
  if order != "natural":  # on the host (numpy): eager jax ops would compile a kernel per slice
    tok = token_order.token_order(np.asarray(pos), np.asarray(seg), cp, order=order,
                                  block=FWD.query_block_size, causal=causal,
                                  sliding_window=window)
    q, k, v, w, pos, seg = (np.asarray(x) for x in token_order.apply_token_order(
        tuple(np.asarray(x) for x in (q, k, v, w, pos, seg)), tok))
  kw = dict(mesh=mesh, query_specs=query_specs, kv_specs=kv_specs) if mesh is not None else {}
  sinks = d["sinks"]
  if mesh is not None:
    # Host arrays: jax arrays committed to one device are resharded for the mesh by a compiled
    # slicing program per shape and sharding.
    q, k, v, w, pos, seg, sinks = (np.asarray(x) for x in (q, k, v, w, pos, seg, sinks))

  def step(q, k, v, sinks, w, pos, seg):
    mask = create_attention_mask(pos, seg, pos, seg, fwd_params=FWD, bwd_params=BWD,
                                 calc_bwd_mask=True, causal=causal, sliding_window=window,
                                 token_order=order, **kw)

    def loss(q, k, v, sinks):
      out = flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=D ** -0.5,
                            logits_soft_cap=soft_cap, sinks=sinks, backend="jax",
                            token_order=order, **kw)
      return jnp.sum(out * w), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return out, grads

  out, (dq, dk, dv, ds) = _jit(step, q, k, v, sinks, w, pos, seg)
  out, dq, dk, dv, ds = (np.asarray(x) for x in (out, dq, dk, dv, ds))
  if tok is not None:
    out, dq, dk, dv = (np.asarray(x) for x in token_order.undo_token_order((out, dq, dk, dv), tok))
  return out, dq, dk, dv, ds


@pytest.fixture(scope="module")
def single_device(data):
  with jax.default_device(CPUS[0]):
    return _run(data)


def _assert_same(got, want, label):
  for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f"{label}: {name}")


def test_matrix_covers_every_split():
  assert len(MESH_SHAPES) == 20 and all(np.prod(s) == 8 for s in MESH_SHAPES)
  assert (8, 1, 1, 1) in MESH_SHAPES and (1, 1, 1, 8) in MESH_SHAPES and (2, 1, 2, 2) in MESH_SHAPES
  # every (batch, tensor, context) split of the 20 meshes runs once, in every order it has
  assert set(REPRESENTATIVES) <= set(MESH_SHAPES) and len(REPRESENTATIVES) == len(
      {_split(s) for s in REPRESENTATIVES})
  assert {_split(s) for s in MESH_SHAPES} == {_split(s) for s in REPRESENTATIVES}
  assert {s[:2] for s in REPRESENTATIVES if s[0] * s[1] > 1} >= {(2, 4), (1, 4), (2, 1), (2, 2),
                                                                  (1, 2)}


def test_reference_is_not_trivial(single_device):
  out, dq, dk, dv, ds = single_device
  # Padding rows are 0 and real rows are not: the comparison below checks real numbers.
  assert np.abs(out).max() > 0.1 and np.abs(dk).max() > 0.1 and np.abs(ds).max() > 1e-3
  assert np.all(out[0, 100:130] == 0)


@pytest.mark.parametrize("shape,order", CASES,
                         ids=[f"{'x'.join(map(str, s))}-{o}" for s, o in CASES])
def test_sharded_equals_single_device(data, single_device, shape, order):
  got = _run(data, mesh=_mesh(shape), order=order)
  _assert_same(got, single_device, f"mesh {dict(zip(AXES, shape))} order={order}")


@pytest.mark.parametrize("causal,window,soft_cap", [(True, 48, 30.0), (False, 40, None)])
def test_window_softcap_noncausal(data, causal, window, soft_cap):
  with jax.default_device(CPUS[0]):
    want = _run(data, causal=causal, window=window, soft_cap=soft_cap)
  got = _run(data, mesh=_mesh((1, 2, 1, 4)), order="balanced" if causal else "llama3",
             causal=causal, window=window, soft_cap=soft_cap)
  _assert_same(got, want, f"causal={causal} window={window}")


def test_context_over_two_mesh_axes(data, single_device):
  """A context "axis" made of two mesh axes (like MaxText's context + context_autoregressive)."""
  mesh = _mesh((2, 2, 2), ("data", "ctx_a", "ctx_b"))
  got = _run(data, mesh=mesh, order="llama3",
             query_specs=("data", ("ctx_a", "ctx_b"), None, None),
             kv_specs=("data", None, None, None))
  _assert_same(got, single_device, "context over ('ctx_a', 'ctx_b')")


def test_specs_from_context_manager_and_attention(data):
  """attention() with a mesh and specs from attention_specs equals attention() on one device."""
  mesh = _mesh((2, 1, 2, 2))
  q, k, v, pos, seg = (data[n] for n in ("q", "k", "v", "pos", "seg"))
  with jax.default_device(CPUS[0]):
    want = _jit(lambda q, k, v, seg, pos: attention(q, k, v, segment_ids=seg, positions=pos,
                                                    backend="jax"), q, k, v, seg, pos)
  with context_parallel.attention_specs(QUERY_SPECS, KV_SPECS):
    got = _jit(lambda q, k, v, seg, pos: attention(q, k, v, segment_ids=seg, positions=pos,
                                                   backend="jax", mesh=mesh), q, k, v, seg, pos)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_sharded_mask_layout_and_sparsity(data):
  """Per-shard tables: [B, cp * n_local] sharded (batch, context); global sparsity still reads."""
  mesh = _mesh((2, 1, 1, 4))
  pos, seg = data["pos"], data["seg"]
  m = create_attention_mask(pos, seg, pos, seg, fwd_params=FWD, bwd_params=BWD,
                            calc_bwd_mask=True, mesh=mesh, query_specs=QUERY_SPECS,
                            permute_tokens_for_load_balance=False)
  assert isinstance(m, context_parallel.ShardedAttentionMask) and isinstance(m, AttentionMask)
  assert (m.spec.batch, m.spec.q_len, m.spec.kv_len) == (B, S, S)
  assert m.layout.local_spec.q_len == S // 4 and m.layout.local_spec.batch == B // 2
  assert m.fwd.lower.shape == (B, S // FWD.query_block_size)
  assert m.dkv.lower.shape == (B, 4 * S // BWD.kv_block_size)
  # Unpermuted, the forward tables of the shards tile the global table exactly.
  plain = create_attention_mask(pos, seg, pos, seg, fwd_params=FWD)
  for got, want in zip(m.fwd, plain.fwd):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert mask_sparsity(m) == mask_sparsity(plain)


# ----------------------------------------------------------------------------- validation


def _small(d):
  return (d[n] for n in ("q", "k", "v", "pos", "seg"))


@pytest.mark.parametrize("query_specs,kv_specs,match", [
    (QUERY_SPECS, (("data", "fsdp"), "context", "tensor", None), r"kv_specs\[1\]"),
    (("data", "context", "tensor", "fsdp"), None, r"query_specs\[3\] \(head_dim\)"),
    (QUERY_SPECS, ("data", None, "tensor", None), r"query_specs\[0\] and kv_specs\[0\] \(batch\)"),
    ((("data", "fsdp"), "context", None, None), (("data", "fsdp"), None, "tensor", None),
     r"kv_specs\[2\] \(heads\) shards .*'tensor' but query_specs\[2\] leaves the query heads "
     r"unsharded"),
    (("data", "context", "tensor", None), ("data", None, "fsdp", None),
     r"query_specs\[2\] and kv_specs\[2\] \(heads\) name different mesh axes.*or None"),
    (("data", "context", "model", None), None, r"query_specs\[2\].*'model'"),
    (("data", "data", None, None), None, r"more than once"),
    (("data", None, None), None, r"4-entry spec"),
    (("data", 3, None, None), None, r"query_specs\[1\] \(sequence\)"),
])
def test_spec_errors_name_the_argument(data, query_specs, kv_specs, match):
  mesh = _mesh((2, 2, 1, 2))
  pos, seg = data["pos"], data["seg"]
  with pytest.raises((ValueError, TypeError), match=match):
    create_attention_mask(pos, seg, pos, seg, mesh=mesh, query_specs=query_specs,
                          kv_specs=kv_specs)


def test_shape_errors(data):
  q, k, v, pos, seg = _small(data)
  # 16 or 4 kv heads over a tensor axis of 8 divide one way or the other; 12 does not.
  mesh = _mesh((1, 1, 8, 1))
  specs = context_parallel.resolve_specs(QUERY_SPECS, KV_SPECS)
  for kv_heads in (16, 8, 4, 1):
    specs_lib.check_shapes(specs, mesh, batch=B, q_len=S, kv_len=S, heads=24, kv_heads=kv_heads)
  with pytest.raises(ValueError, match=r"key/value heads \(12\).*kv_specs\[2\]"):
    specs_lib.check_shapes(specs, mesh, batch=B, q_len=S, kv_len=S, heads=24, kv_heads=12)
  with pytest.raises(ValueError, match=r"query heads \(12\).*query_specs\[2\]"):
    specs_lib.check_shapes(specs, mesh, batch=B, q_len=S, kv_len=S, heads=12, kv_heads=4)
  mesh = _mesh((1, 1, 1, 8))
  with pytest.raises(ValueError, match=r"divisible by 2 \* cp = 16"):
    create_attention_mask(pos[:, :248], seg[:, :248], pos[:, :248], seg[:, :248], mesh=mesh,
                          query_specs=QUERY_SPECS)
  with pytest.raises(ValueError, match=r"batch \(4\).*query_specs\[0\]"):
    specs_lib.check_shapes(
        context_parallel.resolve_specs(((("data", "fsdp", "tensor", "context")), None, None,
                                        None)), _mesh((2, 2, 2, 1)), batch=4, q_len=S, kv_len=S)
  with pytest.raises(ValueError, match=r"no query_specs"):
    create_attention_mask(pos, seg, pos, seg, mesh=mesh)


def test_mask_mismatch_errors(data):
  q, k, v, pos, seg = _small(data)
  mesh = _mesh((1, 1, 2, 4))
  plain = create_attention_mask(pos, seg, pos, seg)
  with pytest.raises(TypeError, match=r"mask must come from create_attention_mask\(\.\.\., mesh"):
    flash_attention(q, k, v, pos, seg, pos, seg, plain, backend="jax", mesh=mesh,
                    query_specs=QUERY_SPECS)
  m = create_attention_mask(pos, seg, pos, seg, mesh=mesh, query_specs=QUERY_SPECS,
                            permute_tokens_for_load_balance=True)
  with pytest.raises(ValueError, match=r"token_order 'natural' differs from the mask's \('llama3'\)"):
    flash_attention(q, k, v, pos, seg, pos, seg, m, backend="jax", mesh=mesh,
                    query_specs=QUERY_SPECS, permute_tokens_for_load_balance=False)
  with pytest.raises(ValueError, match=r"token_order 'balanced' differs from the mask's"):
    flash_attention(q, k, v, pos, seg, pos, seg, m, backend="jax", mesh=mesh,
                    query_specs=QUERY_SPECS, token_order="balanced")
  with pytest.raises(ValueError, match=r"token_order must be one of"):
    create_attention_mask(pos, seg, pos, seg, mesh=mesh, query_specs=QUERY_SPECS,
                          token_order="striped")
  with pytest.raises(ValueError, match=r"permute_tokens_for_load_balance=True contradicts "
                     r"token_order='balanced'"):
    create_attention_mask(pos, seg, pos, seg, mesh=mesh, query_specs=QUERY_SPECS,
                          token_order="balanced", permute_tokens_for_load_balance=True)
  with pytest.raises(ValueError, match=r"built on a mesh with axes"):
    flash_attention(q, k, v, pos, seg, pos, seg, m, backend="jax", mesh=_mesh((2, 1, 1, 4)),
                    query_specs=QUERY_SPECS)


def test_attention_specs_is_context_local():
  q1 = ("data", "context", None, None)
  q2 = (None, "context", "tensor", None)
  assert context_parallel.current_attention_specs() is None
  seen = {}

  def other_thread():
    seen["thread"] = context_parallel.current_attention_specs()
    with context_parallel.attention_specs(q2):
      seen["thread_inner"] = context_parallel.resolve_specs().query

  with context_parallel.attention_specs(q1):
    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert context_parallel.resolve_specs().query == (("data",), ("context",), (), ())
    assert context_parallel.resolve_specs().kv == (("data",), (), (), ())  # derived from the query
    with context_parallel.attention_specs(q2, (None, None, "tensor", None)):
      assert context_parallel.resolve_specs().query[2] == ("tensor",)
    assert context_parallel.resolve_specs().query == (("data",), ("context",), (), ())
    # Explicit arguments win over the context.
    assert context_parallel.resolve_specs(q2).query[0] == ()
  assert context_parallel.current_attention_specs() is None
  assert seen["thread"] is None and seen["thread_inner"][2] == ("tensor",)


# ----------------------------------------------------------------------------- permutation


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_permutation_round_trip_and_chunk_order(cp):
  x = np.arange(2 * 48 * cp).reshape(2, 48 * cp)
  y = context_parallel.to_load_balanced_order(x, cp)
  c = x.shape[1] // (2 * cp)
  shards = y.reshape(2, cp, 2 * c)
  for r in range(cp):  # rank r holds chunks r and 2cp-1-r
    np.testing.assert_array_equal(shards[:, r, :c], x[:, r * c:(r + 1) * c])
    np.testing.assert_array_equal(shards[:, r, c:], x[:, (2 * cp - 1 - r) * c:(2 * cp - r) * c])
  back = context_parallel.from_load_balanced_order(y, cp)
  np.testing.assert_array_equal(back, x)
  # Tuples (nested, with None), jax arrays, another axis.
  z = jnp.asarray(np.arange(4 * 2 * cp * 3).reshape(4, 2 * cp, 3))
  a, (b, none) = context_parallel.to_load_balanced_order((z, (z[:, :, 0], None)), cp)
  assert none is None and isinstance(a, jax.Array)
  np.testing.assert_array_equal(np.asarray(a[:, :, 0]), np.asarray(b))
  zt = context_parallel.to_load_balanced_order(z.transpose(1, 0, 2), cp, axis=0)
  np.testing.assert_array_equal(np.asarray(zt.transpose(1, 0, 2)), np.asarray(a))


def test_permutation_errors():
  with pytest.raises(ValueError, match=r"axis 1, length 10\) must be divisible by 2 \* cp = 4"):
    context_parallel.to_load_balanced_order(np.zeros((1, 10)), 2)
  with pytest.raises(ValueError, match=r"cp must be a positive int"):
    context_parallel.to_load_balanced_order(np.zeros((1, 8)), 0)


# ----------------------------------------------------------------------------- balance


def test_balance_one_long_causal_document():
  s, cp = 4096, 4
  pos = np.arange(s, dtype=np.int32)[None]
  seg = np.zeros((1, s), np.int32)
  plain = context_parallel.context_parallel_balance(pos, seg, cp, permute=False)
  perm = context_parallel.context_parallel_balance(pos, seg, cp, permute=True)
  # Exact counts: contiguous shard r keeps sum_{i in shard} (i + 1) pairs.
  n = s // cp
  want = [sum(range(r * n + 1, (r + 1) * n + 1)) for r in range(cp)]
  assert plain["kept_pairs"] == want
  assert sum(perm["kept_pairs"]) == sum(want) == s * (s + 1) // 2
  assert plain["kept_max_over_min"] > 6.5  # (2cp - 1) = 7 in the limit
  assert perm["kept_max_over_min"] < 1.1
  assert perm["visited_max_over_min"] < 1.1 < 5 < plain["visited_max_over_min"]


def test_balance_counts_match_dense_mask():
  rng = np.random.default_rng(7)
  pos, seg = _documents(rng, 2, 256)
  from kvax_plugin.attention.block_mask import dense_mask
  # Jitted: eagerly, each of its operations compiles a program per shape and setting.
  dense_mask = jax.jit(dense_mask, static_argnames=("causal", "sliding_window"))
  for causal, window in ((True, None), (True, 20), (False, 20), (False, None)):
    rep = context_parallel.context_parallel_balance(pos, seg, 2, permute=True, causal=causal,
                                            sliding_window=window)
    qpos, qseg = context_parallel.to_load_balanced_order((pos, seg), 2)
    dense = np.asarray(dense_mask(jnp.asarray(qpos), jnp.asarray(qseg), jnp.asarray(pos),
                                  jnp.asarray(seg), causal=causal, sliding_window=window))
    want = [int(dense[:, :128].sum()), int(dense[:, 128:].sum())]
    assert rep["kept_pairs"] == want, (causal, window)


def test_forward_only_mask_passed_into_jit(data):
  """A mask built eagerly without backward tables (balanced order: it carries its kv
  arrangement) crosses a jit boundary as a pytree argument and is reused by two layers inside
  lax.scan."""
  mesh = _mesh((2, 1, 2, 2))
  cp = 2
  q, k, v, pos, seg = (np.asarray(data[n]) for n in ("q", "k", "v", "pos", "seg"))
  tok = token_order.balanced_order(pos, seg, cp, block=FWD.query_block_size)
  q, k, v, pos, seg = (np.asarray(x) for x in token_order.apply_token_order((q, k, v, pos, seg),
                                                                           tok))
  with context_parallel.attention_specs(QUERY_SPECS, KV_SPECS):
    mask = create_attention_mask(pos, seg, pos, seg, fwd_params=FWD, mesh=mesh,
                                 token_order="balanced")
    assert mask.dq is None and mask.token_order == "balanced"
    assert mask.kv_arrangement.shape == (B, cp * S)

    def two_layers(q, k, v, sinks, mask):
      def layer(x, _):
        # No token_order here: flash_attention takes the order the mask was built for.
        out = flash_attention(x, k, v, pos, seg, pos, seg, mask, scale=D ** -0.5, sinks=sinks,
                              backend="jax", mesh=mesh)
        return out, None
      return jax.lax.scan(layer, q, None, length=2)[0]

    out = _jit(two_layers, q, k, v, data["sinks"], mask)
  with jax.default_device(CPUS[0]):
    plain = create_attention_mask(data["pos"], data["seg"], data["pos"], data["seg"],
                                  fwd_params=FWD)
    want = _jit(lambda q: flash_attention(
        flash_attention(q, data["k"], data["v"], data["pos"], data["seg"], data["pos"],
                        data["seg"], plain, scale=D ** -0.5, sinks=data["sinks"],
                        backend="jax"),
        data["k"], data["v"], data["pos"], data["seg"], data["pos"], data["seg"], plain,
        scale=D ** -0.5, sinks=data["sinks"], backend="jax"), data["q"])
  got = np.asarray(token_order.undo_token_order(np.asarray(out), tok))
  np.testing.assert_allclose(got, np.asarray(want), rtol=2e-5, atol=2e-5)


def test_balanced_mask_arranges_kv_in_document_order(data):
  """Each context shard's kv arrangement puts the (permuted, gathered) kv in document order,
  and its forward tables equal the rows of one table built on document-ordered kv."""
  cp = 4
  mesh = _mesh((2, 1, 1, 4))
  pos, seg = np.asarray(data["pos"]), np.asarray(data["seg"])
  tok = token_order.balanced_order(pos, seg, cp, block=FWD.query_block_size)
  ppos, pseg = (np.asarray(x) for x in token_order.apply_token_order((pos, seg), tok))
  m = create_attention_mask(ppos, pseg, ppos, pseg, fwd_params=FWD, mesh=mesh,
                            query_specs=QUERY_SPECS, token_order="balanced")
  doc = np.asarray(token_order.document_order(pos, seg))
  want_pos = np.take_along_axis(pos, doc, axis=1)
  want_seg = np.take_along_axis(seg, doc, axis=1)
  arrangement = np.asarray(m.kv_arrangement)
  for r in range(cp):
    a = arrangement[:, r * S:(r + 1) * S]
    np.testing.assert_array_equal(np.take_along_axis(ppos, a, axis=1), want_pos)
    np.testing.assert_array_equal(np.take_along_axis(pseg, a, axis=1), want_seg)
  ref = create_attention_mask(jnp.asarray(ppos), jnp.asarray(pseg), jnp.asarray(want_pos),
                              jnp.asarray(want_seg), fwd_params=FWD)
  for got, want in zip(m.fwd, ref.fwd):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


_FEWER_KV_WANT: dict = {}


@pytest.mark.parametrize("shape,kv_heads", [((1, 1, 4, 2), 2), ((1, 1, 8, 1), 1),
                                            ((2, 1, 4, 1), 1)])
def test_fewer_kv_heads_than_tensor_shards(data, shape, kv_heads):
  """GQA / MQA with tensor parallelism larger than the kv heads: kv heads are shared by shards."""
  d = dict(data)
  d["k"], d["v"] = d["k"][:, :, :kv_heads], d["v"][:, :, :kv_heads]
  if kv_heads not in _FEWER_KV_WANT:  # one single-device run per kv head count
    with jax.default_device(CPUS[0]):
      _FEWER_KV_WANT[kv_heads] = _run(d)
  want = _FEWER_KV_WANT[kv_heads]
  got = _run(d, mesh=_mesh(shape), order="llama3" if shape[3] > 1 else "natural")
  _assert_same(got, want, f"mesh {shape}, {kv_heads} kv heads")


@pytest.mark.parametrize("shape", [(4, 1, 1, 2), (2, 1, 1, 4)])
def test_kv_gradient_sum_dtype(data, shape):
  """bfloat16 inputs: with two context shards dk / dv are summed in bfloat16 (half the bytes) and
  equal the float32 sum bit for bit; with four they are summed in float32."""
  cp = shape[3]
  mesh = _mesh(shape)
  kw = dict(mesh=mesh, query_specs=QUERY_SPECS, kv_specs=KV_SPECS)
  q, k, v, w = (data[n].astype(jnp.bfloat16) for n in ("q", "k", "v", "w"))
  # The arguments on the host, as in _run: no resharding programs to compile.
  q, k, v = (np.asarray(x) for x in (q, k, v))
  pos, seg = data["pos"], data["seg"]

  def run(choice):
    def grads(q, k, v):
      mask = create_attention_mask(pos, seg, pos, seg, fwd_params=FWD, bwd_params=BWD,
                                   calc_bwd_mask=True, kv_grad_reduce_dtype=choice, **kw)
      loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, pos, seg, pos, seg, mask,
                                                     backend="jax", **kw).astype(jnp.float32)
                                     * w.astype(jnp.float32))
      return jax.grad(loss, argnums=(1, 2))(q, k, v)

    lowered = jax.jit(grads).lower(q, k, v)
    # The program as jax emits it (XLA's CPU backend later promotes 16-bit collectives to
    # float32 on its own; NCCL on a GPU sums in the dtype it is given).
    scatters = re.findall(r'"stablehlo\.reduce_scatter".*?\}\) : \(tensor<([^>]*)>\)',
                          lowered.as_text(), flags=re.S)
    compiled = lowered.compile(compiler_options=FAST_COMPILE)
    return [np.asarray(x.astype(jnp.float32)) for x in compiled(q, k, v)], scatters

  (dk, dv), scatters = run("auto")
  assert scatters, "no reduce_scatter in the lowered backward"
  want = "xbf16" if cp == 2 else "xf32"
  assert all(t.endswith(want) for t in scatters), scatters
  assert context_parallel.kv_grad_reduce_dtype(jnp.bfloat16, cp) == (
      jnp.bfloat16 if cp == 2 else jnp.float32)
  assert context_parallel.kv_grad_reduce_dtype(jnp.float16, 8) == jnp.float32
  for wide in (jnp.float32, jnp.float64):  # never narrowed
    assert context_parallel.kv_grad_reduce_dtype(wide, cp) == wide
  (dk32, dv32), _ = run("float32")
  if cp == 2:
    np.testing.assert_array_equal(dk, dk32)
    np.testing.assert_array_equal(dv, dv32)
  else:  # more than one rounding: close, not necessarily equal
    np.testing.assert_allclose(dk, dk32, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(dv, dv32, rtol=2e-2, atol=2e-2)


def test_two_term_bfloat16_sum_rounds_like_float32():
  """The claim behind summing two context shards' dk / dv in bfloat16: for two bfloat16 values,
  the correctly rounded bfloat16 sum equals float32(a + b) rounded to bfloat16 (checked against
  exact rational arithmetic on pairs with every exponent gap, ties and cancellations)."""
  from fractions import Fraction

  import ml_dtypes
  bf16 = ml_dtypes.bfloat16
  rng = np.random.default_rng(0)
  n = 4000
  a = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))
  gap = np.exp2(-rng.integers(0, 30, n).astype(np.float64))
  b = a * gap * rng.choice([-1.0, 1.0], n) * (1 + rng.integers(0, 256, n) / 256)
  a, b = a.astype(bf16), b.astype(bf16)

  def correctly_rounded(x: Fraction):
    """Nearest bfloat16 to the exact x, ties to the even bit pattern."""
    guess = np.array([float(x)], np.float32).astype(bf16)
    bits = guess.view(np.uint16).astype(np.int32)[0]
    cands = [np.array([c], np.uint16).view(bf16)[0] for c in (bits - 1, bits, bits + 1)
             if 0 <= c < 2 ** 16]
    cands = [c for c in cands if np.isfinite(np.float32(c))]
    best = min(abs(Fraction(float(c)) - x) for c in cands)
    ties = [c for c in cands if abs(Fraction(float(c)) - x) == best]
    return min(ties, key=lambda c: int(np.array([c]).view(np.uint16)[0]) % 2)

  via_f32 = (a.astype(np.float32) + b.astype(np.float32)).astype(bf16)
  for x, y, got in zip(a, b, via_f32):
    want = correctly_rounded(Fraction(float(x)) + Fraction(float(y)))
    assert float(got) == float(want), (float(x), float(y), float(got), float(want))
