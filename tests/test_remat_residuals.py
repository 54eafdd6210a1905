"""The kernel backends' residuals under rematerialization (kvax_plugin/attention/kernels/
custom_vjp.py): the forward's output and lse carry the name "context", so a jax.checkpoint policy
that saves that name (MaxText's remat_policy minimal_with_context) keeps them and the backward
does not rerun the forward; any other policy reruns it. Backend-agnostic (a stand-in forward);
tests/test_mosaic_interpret.py checks the same on the Mosaic kernels' lowered step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kvax_plugin.attention.block_mask import create_attention_mask
from kvax_plugin.attention.kernels.custom_vjp import RESIDUAL_NAME, kernel_attention


def _forward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
  lse = jax.nn.logsumexp(s, axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v)
  return jnp.sin(out), lse  # sin: a marker that counts the forward's runs


def _backward(cfg, q, k, v, sinks, q_pos, q_seg, kv_pos, kv_seg, mask, out, lse, d_out):
  return d_out * lse.mean(), jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros_like(sinks)


@pytest.mark.parametrize("policy,forward_runs", [
    (jax.checkpoint_policies.nothing_saveable, 2),
    (jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME), 1),
    (jax.checkpoint_policies.save_only_these_names("query_proj"), 2),
])
def test_a_policy_saving_context_keeps_the_forward(policy, forward_runs):
  attention = kernel_attention(_forward, _backward)
  seg = jnp.zeros((1, 8), jnp.int32)
  pos = jnp.arange(8, dtype=jnp.int32)[None]
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)

  def loss(q, k, v):
    return jnp.sum(attention(None, q, k, v, jnp.zeros((2,)), pos, seg, pos, seg, mask))
  x = jnp.ones((1, 8, 2, 4))
  step = jax.value_and_grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2))
  jaxpr = str(jax.make_jaxpr(step)(x, x, x))
  assert jaxpr.count(" sin ") == forward_runs, jaxpr
  assert RESIDUAL_NAME == "context"  # MaxText's name for the attention output and its lse
