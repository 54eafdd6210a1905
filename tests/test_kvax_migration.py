"""kvax 0.1.0 code runs on kvax_plugin with only its import lines changed.

`KVAX_PROGRAM` is written as kvax's README shows (a mesh with a context axis, attention_specs,
permute the inputs, one mask for every layer, flash_attention in each layer, unpermute the
outputs; scale passed positionally). The test swaps `kvax.` for `kvax_plugin.` in its two import
lines and nothing else, runs it on 8 simulated CPU devices (tests/conftest.py), jitted, under
kvax's `with mesh, attention_specs(...)` and under `jax.set_mesh`, with mesh= passed and left to
the context, and checks the forward output and the gradients of every input and weight against
the same model on the float32 reference in natural order. The rest checks kvax's signatures and
return structures (recorded from kvax 0.1.0's source) and its helpers.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import kvax_plugin
from kvax_plugin.attention.reference import reference_attention

KVAX_PROGRAM = '''
import jax
import jax.numpy as jnp

from kvax.ops import create_attention_mask, flash_attention
from kvax.utils import (PADDING_SEGMENT_ID, FlashAttentionParamsConfig, attention_specs,
                        permute_tokens_context_parallelism, unpermute_tokens_context_parallelism)

FWD_PARAMS = FlashAttentionParamsConfig(query_block_size=16, kv_block_size=16, num_warps=4,
                                        num_stages=2)
BWD_PARAMS = FlashAttentionParamsConfig(query_block_size=16, kv_block_size=16, num_warps=4,
                                        num_stages=2)


def attention_layer(x, weights, query_positions, query_segment_ids, kv_positions,
                    kv_segment_ids, attn_mask, mesh):
    wq, wk, wv, wo = weights
    query = jnp.einsum("bsd,dhk->bshk", x, wq)
    key = jnp.einsum("bsd,dhk->bshk", x, wk)
    value = jnp.einsum("bsd,dhk->bshk", x, wv)
    scale = query.shape[-1] ** -0.5
    attn_out = flash_attention(query, key, value, query_positions, query_segment_ids,
                               kv_positions, kv_segment_ids, attn_mask, scale, mesh=mesh)
    return x + jnp.einsum("bshk,hkd->bsd", attn_out, wo)


def transformer(layers, embeddings, positions, segment_ids, mesh=None):
    # For training: kv positions / segment ids are the unpermuted ones.
    kv_positions, kv_segment_ids = positions, segment_ids
    embeddings, query_positions, query_segment_ids = permute_tokens_context_parallelism(
        (embeddings, positions, segment_ids), mesh=mesh)
    attention_mask = create_attention_mask(
        query_positions, query_segment_ids, kv_positions, kv_segment_ids,
        fwd_params=FWD_PARAMS, bwd_params=BWD_PARAMS, skip_pad_tokens=True, calc_bwd_mask=True,
        mesh=mesh)
    x = embeddings
    for weights in layers:
        x = attention_layer(x, weights, query_positions, query_segment_ids, kv_positions,
                            kv_segment_ids, attention_mask, mesh)
    return unpermute_tokens_context_parallelism(x, mesh=mesh)


def train_step(layers, embeddings, positions, segment_ids, cotangent, mesh=None):
    def loss_fn(layers, embeddings):
        out = transformer(layers, embeddings, positions, segment_ids, mesh)
        return jnp.sum(out * cotangent), out
    (_, out), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(layers,
                                                                                embeddings)
    return out, grads


QUERY_SPECS = ("data", "context", None, None)
KV_SPECS = ("data", None, None, None)
'''

B, S, D, H, KH, DH, LAYERS = 2, 128, 32, 4, 2, 16, 2


def load_program(package: str) -> dict:
  """KVAX_PROGRAM with its imports pointed at `package`; only the import lines may change."""
  source = KVAX_PROGRAM.replace("from kvax.", f"from {package}.")
  changed = [(a, b) for a, b in zip(KVAX_PROGRAM.splitlines(), source.splitlines()) if a != b]
  assert [a for a, _ in changed] == ["from kvax.ops import create_attention_mask, flash_attention",
                                     "from kvax.utils import (PADDING_SEGMENT_ID, "
                                     "FlashAttentionParamsConfig, attention_specs,"]
  namespace: dict = {}
  exec(compile(source, f"<kvax program on {package}>", "exec"), namespace)  # noqa: S102
  return namespace


def inputs(seed: int):
  """Packed documents with padding (PADDING_SEGMENT_ID), per-document positions, weights."""
  seg = np.full((B, S), kvax_plugin.PADDING_SEGMENT_ID, np.int32)
  pos = np.zeros((B, S), np.int32)
  for row, lengths in enumerate(([37, 50, 29], [S - 9])):  # 12 and 9 padding tokens at the end
    start = 0
    for doc, n in enumerate(lengths):
      seg[row, start:start + n] = 3 * doc + 1 + row  # any ids >= 0, not 0..n
      pos[row, start:start + n] = np.arange(n)
      start += n
  ks = jax.random.split(jax.random.key(seed), 2 + 4 * LAYERS)
  layers = [tuple(jax.random.normal(ks[2 + 4 * i + j], shape, jnp.float32) * 0.3
                  for j, shape in enumerate([(D, H, DH), (D, KH, DH), (D, KH, DH), (H, DH, D)]))
            for i in range(LAYERS)]
  emb = jax.random.normal(ks[0], (B, S, D), jnp.float32)
  cot = jax.random.normal(ks[1], (B, S, D), jnp.float32)
  return layers, emb, jnp.asarray(pos), jnp.asarray(seg), cot


def reference_step(layers, emb, pos, seg, cot):
  """The same model on the dense float32 reference, natural order, one device."""
  def model(layers, x):
    for wq, wk, wv, wo in layers:
      q, k, v = (jnp.einsum("bsd,dhk->bshk", x, w) for w in (wq, wk, wv))
      out = reference_attention(q, k, v, pos, seg, pos, seg, causal=True,
                                scale=q.shape[-1] ** -0.5)
      x = x + jnp.einsum("bshk,hkd->bsd", out, wo)
    return x

  def loss_fn(layers, x):
    out = model(layers, x)
    return jnp.sum(out * cot), out

  (_, out), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(layers, emb)
  return out, grads


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


@pytest.fixture(scope="module")
def program():
  return load_program("kvax_plugin")


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS for 8 CPU devices)")
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context"))


# Lowered program text (no source locations) -> its results on inputs(seed=1): the three ways of
# giving kvax's program the mesh lower to the same program (asserted through this cache: a
# different text compiles and runs on its own), which is compiled and run once (~10 s of
# compiling on a CPU).
_STEP_RESULTS: dict = {}


@pytest.mark.parametrize("context, pass_mesh", [("with mesh", True), ("with mesh", False),
                                                ("jax.set_mesh", False)])
def test_kvax_program_runs_unchanged(program, mesh, context, pass_mesh):
  layers, emb, pos, seg, cot = inputs(seed=1)
  want_out, (want_layers, want_emb) = jax.jit(reference_step)(layers, emb, pos, seg, cot)
  step = jax.jit(lambda *a: program["train_step"](*a, mesh=mesh if pass_mesh else None))
  mesh_context = mesh if context == "with mesh" else jax.set_mesh(mesh)
  with mesh_context, program["attention_specs"](query_specs=program["QUERY_SPECS"],
                                                kv_specs=program["KV_SPECS"]):
    lowered = step.lower(layers, emb, pos, seg, cot)
  text = lowered.as_text(debug_info=False)
  assert "loc(" not in text
  if text not in _STEP_RESULTS:
    _STEP_RESULTS[text] = lowered.compile()(layers, emb, pos, seg, cot)
  assert len(_STEP_RESULTS) == 1, "the ways of passing the mesh lowered to different programs"
  out, (got_layers, got_emb) = _STEP_RESULTS[text]
  errors = {"out": rel(out, want_out), "d_embeddings": rel(got_emb, want_emb)}
  for i, (g, w) in enumerate(zip(got_layers, want_layers)):
    for name, a, b in zip(("wq", "wk", "wv", "wo"), g, w):
      errors[f"d_{name}{i}"] = rel(a, b)
  assert max(errors.values()) < 2e-5, errors
  # Padding rows: output is the residual alone (attention gives 0 there), gradient the cotangent.
  pad = np.asarray(seg) == kvax_plugin.PADDING_SEGMENT_ID
  np.testing.assert_allclose(np.asarray(out)[pad], np.asarray(emb)[pad], atol=1e-6)


# kvax 0.1.0's public signatures (kvax/ops/flash_attention_triton.py, mask_creator.py,
# utils/permutation.py, utils/specs.py): name, default (inspect.Parameter.empty = required).
_REQ = inspect.Parameter.empty
KVAX_SIGNATURES = {
    "flash_attention": [
        ("query", _REQ), ("key", _REQ), ("value", _REQ), ("query_positions", _REQ),
        ("query_segment_ids", _REQ), ("kv_positions", _REQ), ("kv_segment_ids", _REQ),
        ("mask", _REQ), ("scale", 1.0), ("bias", None), ("fwd_params", None),
        ("bwd_params", None), ("assume_sequential_positions", False),
        ("memory_optimized_gqa_backward", False), ("permute_tokens_for_load_balance", True),
        ("debug", False), ("mesh", None)],
    "create_attention_mask": [
        ("query_positions", _REQ), ("query_segment_ids", _REQ), ("kv_positions", _REQ),
        ("kv_segment_ids", _REQ), ("fwd_params", None), ("bwd_params", None),
        ("calc_bwd_mask", False), ("skip_pad_tokens", True), ("mesh", None)],
    "print_mask": [("mask", _REQ), ("num_inner_blocks", _REQ),
                   ("print_only_first_in_batch", True), ("fit_in_screen", True)],
    "calculate_mask_sparsity": [("mask", _REQ), ("query_block_size", _REQ),
                                ("kv_block_size", _REQ), ("query_seq_len", _REQ),
                                ("kv_seq_len", _REQ)],
    "permute_tokens_context_parallelism": [("inputs", _REQ), ("mesh", None)],
    "unpermute_tokens_context_parallelism": [("inputs", _REQ), ("mesh", None)],
    "attention_specs": [("query_specs", _REQ)],  # kv_specs: required in kvax, optional here
}


@pytest.mark.parametrize("name", sorted(KVAX_SIGNATURES))
def test_kvax_signatures(name):
  module = kvax_plugin.utils if hasattr(kvax_plugin.utils, name) else kvax_plugin.ops
  params = list(inspect.signature(getattr(module, name)).parameters.values())
  positional = [(p.name, p.default) for p in params
                if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
  assert positional[:len(KVAX_SIGNATURES[name])] == KVAX_SIGNATURES[name]
  extra = positional[len(KVAX_SIGNATURES[name]):]
  if name == "attention_specs":
    assert extra == [("kv_specs", None)]
  else:
    assert not extra, f"{name}: our extensions must be keyword-only, got {extra}"
  assert name in module.__all__
  for other in ("FlashAttentionParamsConfig", "PADDING_SEGMENT_ID"):
    assert other in kvax_plugin.utils.__all__
  assert kvax_plugin.utils.PADDING_SEGMENT_ID == -1
  assert [f for f in kvax_plugin.utils.FlashAttentionParamsConfig.__dataclass_fields__] == [
      "query_block_size", "kv_block_size", "num_warps", "num_stages"]


def test_mask_reads_like_kvax_tuple_and_stays_one_pytree():
  _, _, pos, seg, _ = inputs(seed=3)
  params = kvax_plugin.FlashAttentionParamsConfig(16, 16, 4, 2)
  fwd_only = kvax_plugin.ops.create_attention_mask(pos, seg, pos, seg, params)
  assert len(fwd_only) == 1
  (view,) = fwd_only
  mask = kvax_plugin.ops.create_attention_mask(pos, seg, pos, seg, params, params, True)
  fwd, dq, dkv = mask
  # Unpacked: the tables in kvax's layout (tests/test_kvax_tables.py checks their values).
  assert len(mask) == 3 and mask[0] is mask.kvax_views[0] and mask[-1] is mask.kvax_views[2]
  assert mask[1] is dq and dq is mask.kvax_views[1] and mask[1:][1] is dkv
  np.testing.assert_array_equal(view.lower_bounds, fwd.lower_bounds)
  np.testing.assert_array_equal(fwd.lower_bounds[:, 0], mask.fwd.lower)
  for v in mask:
    lo, up, flo, fup = v.flatten()
    assert (lo is v.lower_bounds and up is v.upper_bounds and flo is v.lower_full_bounds
            and fup is v.upper_full_bounds)
    assert all(a is b for a, b in zip(type(v).unflatten(v.flatten()), v))
    assert v.lower_bounds.shape == (B, 1, S // 16)
    assert bool(jnp.all((v.lower_bounds <= v.lower_full_bounds)
                        & (v.lower_full_bounds <= v.upper_full_bounds)
                        & (v.upper_full_bounds <= v.upper_bounds)))
  # One pytree: through jit and scan, and back as the same kind of object.
  leaves, tree = jax.tree.flatten(mask)
  # 12 int32 tables, the fingerprint of the positions / segment ids (uint32 [B, 4]: order-free
  # and order-sensitive hashes of the query and kv sides) and the 12 tables in kvax's layout
  assert len(leaves) == 25 and jax.tree.unflatten(tree, leaves).spec == mask.spec
  through = jax.jit(lambda m: jax.lax.scan(lambda c, _: (c, None), m, None, length=2)[0])(mask)
  assert type(through) is type(mask) and len(through) == 3
  np.testing.assert_array_equal(through[2].upper_bounds, dkv.upper_bounds)


def test_mask_helpers():
  _, _, pos, seg, _ = inputs(seed=4)
  params = kvax_plugin.FlashAttentionParamsConfig(16, 16, 4, 2)
  mask = kvax_plugin.ops.create_attention_mask(pos, seg, pos, seg, params)
  share = kvax_plugin.ops.calculate_mask_sparsity(mask[0], 16, 16, S, S)
  expected = kvax_plugin.mask_sparsity(mask)["visited"]
  assert share == pytest.approx(expected) and 0.0 < share < 0.6  # causal documents: < half
  text = kvax_plugin.ops.print_mask(mask[0], S // 16, fit_in_screen=False)
  rows = [line for line in text.splitlines() if line.startswith("||")]
  assert len(rows) == S // 16 and all(len(r) == 4 + 2 * (S // 16) for r in rows)
  assert rows[0][2:4] == "░░" and rows[0][4:].strip("|").strip() == ""  # a diagonal block
  both = kvax_plugin.ops.print_mask(mask, S // 16, print_only_first_in_batch=False)
  assert both.count("||\n") == 2 * (S // 16)
  with pytest.raises(TypeError, match="mask must be an AttentionMask"):
    kvax_plugin.ops.print_mask("not a mask", 4)


def test_bias_and_missing_mesh_are_clear_errors(mesh):
  _, emb, pos, seg, _ = inputs(seed=5)
  q, k, v = (jax.random.normal(key, (B, S, n, DH)) for key, n in
             zip(jax.random.split(jax.random.key(5), 3), (H, KH, KH)))
  mask = kvax_plugin.ops.create_attention_mask(pos, seg, pos, seg)
  with pytest.raises(NotImplementedError, match="bias is not supported"):
    kvax_plugin.ops.flash_attention(q, k, v, pos, seg, pos, seg, mask, 1.0,
                                    jnp.zeros((B, H, S, S)))
  with pytest.raises(ValueError, match="reads the context size from a mesh"):
    kvax_plugin.utils.permute_tokens_context_parallelism(emb)
  with pytest.raises(ValueError, match="no query_specs"):
    kvax_plugin.utils.permute_tokens_context_parallelism(emb, mesh=mesh)
  # Positional scale reaches the kernel: 0.5 here equals scale=0.5 there.
  a = kvax_plugin.ops.flash_attention(q, k, v, pos, seg, pos, seg, mask, 0.5, backend="jax")
  b = kvax_plugin.flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=0.5, backend="jax")
  c = kvax_plugin.flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=1.0, backend="jax")
  np.testing.assert_array_equal(a, b)
  assert rel(a, c) > 1e-2  # the scale did change the result
