"""create_attention_mask(kv_grad_reduce_dtype=...): the dtype context parallelism sums the
shards' dk / dv in, recorded in the mask and followed by flash_attention's backward (MaxText's
kvax_kv_grad_reduce_dtype key reaches it through the provider). The numerics of each choice:
tests/test_sharding.py::test_kv_gradient_sum_dtype; here the choice itself, read off the
program jax emits (lowering only, nothing compiled)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kvax_plugin.attention import context_parallel
from kvax_plugin.attention.api import create_attention_mask, flash_attention
from kvax_plugin.attention.params import FlashAttentionParamsConfig
from kvax_plugin.providers.kvax_provider import KvaxOptions, prepare

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 CPU devices (tests/conftest.py)")
SPECS = dict(query_specs=(None, "context", None, None), kv_specs=(None, None, None, None))
FWD = FlashAttentionParamsConfig(query_block_size=32, kv_block_size=32)
B, S, H, D = 1, 256, 2, 16


def _scatter_types(choice, cp):
  """The operand types of the reduce-scatters in the lowered backward."""
  mesh = Mesh(np.array(CPUS[:cp]), ("context",))
  pos = jnp.arange(S, dtype=jnp.int32)[None]
  seg = (pos // 100).astype(jnp.int32)  # 3 documents
  q, k, v = (jnp.ones((B, S, H, D), jnp.bfloat16) for _ in range(3))
  mask = create_attention_mask(pos, seg, pos, seg, FWD, FWD, calc_bwd_mask=True, mesh=mesh,
                               token_order="natural", kv_grad_reduce_dtype=choice, **SPECS)

  def loss(k, v):
    out = flash_attention(q, k, v, pos, seg, pos, seg, mask, fwd_params=FWD, bwd_params=FWD,
                          backend="jax", mesh=mesh, token_order="natural", **SPECS)
    return jnp.sum(out.astype(jnp.float32))

  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(k, v).as_text()
  return re.findall(r'"stablehlo\.reduce_scatter".*?\}\) : \(tensor<([^>]*)>\)', text, flags=re.S)


@pytest.mark.parametrize("choice,cp,want", [("auto", 2, "xbf16"), ("auto", 4, "xf32"),
                                             ("input", 4, "xbf16"), ("float32", 2, "xf32")])
def test_mask_choice_sets_the_reduce_dtype(choice, cp, want):
  types = _scatter_types(choice, cp)
  assert types and all(t.endswith(want) for t in types), types


def test_bad_choice_names_the_argument():
  mesh = Mesh(np.array(CPUS[:2]), ("context",))
  pos = jnp.arange(S, dtype=jnp.int32)[None]
  with pytest.raises(ValueError, match="kv_grad_reduce_dtype must be one of"):
    create_attention_mask(pos, pos * 0, pos, pos * 0, mesh=mesh, token_order="natural",
                          kv_grad_reduce_dtype="bfloat16", **SPECS)
  assert context_parallel.KV_GRAD_REDUCE_CHOICES == ("auto", "float32", "input")


def test_provider_options_reach_the_mask():
  """KvaxOptions (MaxText's kvax_kv_grad_reduce_dtype / kvax_overlap_kv_gather) -> the mask."""
  mesh = Mesh(np.array(CPUS[:2]), ("context",))
  pos = jnp.arange(S, dtype=jnp.int32)[None]
  opts = KvaxOptions(backend="jax", fwd_params=FWD, bwd_params=FWD, mesh=mesh,
                     token_order="natural", query_specs=SPECS["query_specs"],
                     kv_specs=SPECS["kv_specs"], kv_grad_reduce_dtype="input",
                     overlap_kv_gather=True)
  (mask,) = prepare(pos, pos // 100, options=opts).masks.values()
  assert mask.layout.kv_grad_reduce_dtype == "input" and mask.layout.overlap_kv_gather
