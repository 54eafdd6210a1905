"""The kernel backends' residuals under rematerialization (kvax_plugin/attention/kernels/
custom_vjp.py): the forward's output and lse carry the name "context", so a jax.checkpoint policy
that saves that name (MaxText's remat_policy minimal_with_context) keeps them and the backward
does not rerun the forward; any other policy reruns it. Backend-agnostic (a stand-in forward);
tests/test_mosaic_interpret.py checks the same on the Mosaic kernels' lowered step. Also: the
optimization barrier the residuals pass before they are named (against XLA's GPU clone of the
forward), and the same saving for the JAX backend and the context-parallel overlap
path (split_kv_attention)."""

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


def test_residuals_pass_an_optimization_barrier_before_they_are_named():
  """custom_vjp.saved_residuals: out and lse go through one optimization barrier, then get the
  name. Without the barrier XLA's GPU dynamic-slice fusion can clone the forward kernel into the
  scan's stacking of the saved values (tests/gpu/test_remat_gpu.py checks the compiled GPU
  step)."""
  attention = kernel_attention(_forward, _backward)
  seg = jnp.zeros((1, 8), jnp.int32)
  pos = jnp.arange(8, dtype=jnp.int32)[None]
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  x = jnp.ones((1, 8, 2, 4))

  def layer(q):
    return attention(None, q, x, x, jnp.zeros((2,)), pos, seg, pos, seg, mask)
  # The forward rule's trace: jax.vjp runs it (a plain call would not).
  text = str(jax.make_jaxpr(lambda q: jax.vjp(layer, q)[0])(x))
  assert text.count("optimization_barrier") == 1, text
  barrier_at = text.index("optimization_barrier")
  assert text.index("name=context", barrier_at) > barrier_at  # named after the barrier


def test_jax_backend_residuals_are_saved_by_a_context_policy(capsys):
  """The JAX (CPU / TPU) backend names its residuals like the kernel backends, so MaxText's
  minimal_with_context keeps them there too (print_saved_residuals lists out and lse)."""
  import kvax_plugin
  from jax.ad_checkpoint import print_saved_residuals
  seg = jnp.zeros((1, 64), jnp.int32)
  pos = jnp.arange(64, dtype=jnp.int32)[None]
  mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
  q = jnp.ones((1, 64, 4, 32))
  k = jnp.ones((1, 64, 2, 32))

  def layer(q, k, v):
    return jnp.sum(kvax_plugin.flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=0.1,
                                               backend="jax") ** 2)
  policy = jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME)
  print_saved_residuals(jax.checkpoint(layer, policy=policy), q, k, k)
  saved = capsys.readouterr().out
  assert saved.count(f"named '{RESIDUAL_NAME}'") == 2, saved


def test_split_kv_attention_residuals_are_saved_by_a_context_policy(capsys):
  """The context-parallel overlap path (split_kv_attention: two kv parts merged) names its
  merged out and lse the same way, so a policy saving "context" keeps them instead of rerunning
  both parts' forwards (and, on a mesh, the k / v collective before them)."""
  import sys
  from pathlib import Path
  from jax.ad_checkpoint import print_saved_residuals
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  import kernel_parts_case
  from kvax_plugin.attention.kernels import backend_function
  pos, seg = kernel_parts_case.layout(128)
  q = jnp.ones((1, 128, 4, 32))
  k = jnp.ones((1, 128, 2, 32))
  fn = backend_function("jax")

  def layer(q, k, v):
    out = kernel_parts_case.split_attention(fn, q, k, v, pos, seg, None, scale=0.1,
                                            logits_soft_cap=None)
    return jnp.sum(out ** 2)
  policy = jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME)
  print_saved_residuals(jax.checkpoint(layer, policy=policy), q, k, k)
  saved = capsys.readouterr().out
  assert saved.count(f"named '{RESIDUAL_NAME}'") == 2, saved
  assert "split_kv_attention" in saved, saved

