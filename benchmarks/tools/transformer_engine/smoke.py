"""TE's fused attention (THD layout, packed segments, GQA) against a float32 reference.

    . /tmp/site/te_env.sh; PYTHONPATH=/tmp/site python3 .te/smoke.py
Shapes: q [2, 1024, 8, 128], k / v [2, 1024, 2, 128] bf16; row 0 holds documents of 300, 1,
500 and 223 tokens, row 1 one of 1024. Checks the output and dq, dk, dv (relative L2).
"""
import jax
import jax.numpy as jnp
import numpy as np
from transformer_engine.jax.attention import SequenceDescriptor
from transformer_engine.jax.flax.transformer import DotProductAttention

B, S, H, G, D = 2, 1024, 8, 2, 128
rng = np.random.default_rng(0)
seg = np.zeros((B, S), np.int32)
pos = np.zeros((B, S), np.int32)
for b, lengths in enumerate([[300, 1, 500, 223], [1024]]):
  start = 0
  for i, n in enumerate(lengths):
    seg[b, start:start + n], pos[b, start:start + n] = i + 1, np.arange(n)
    start += n
q = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((B, S, G, D)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((B, S, G, D)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32)

layer = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G,
                            attn_mask_type="padding_causal", attn_bias_type="no_bias",
                            attention_dropout=0.0, qkv_layout="THD_THD_THD",
                            scale_factor=D ** -0.5, transpose_batch_sequence=False,
                            max_segments_per_seq=8)
desc = SequenceDescriptor.from_segment_ids_and_pos(segment_ids=jnp.asarray(seg),
                                                   segment_pos=jnp.asarray(pos))
params = layer.init(jax.random.PRNGKey(0), q, k, v, sequence_descriptor=desc)


def te(q, k, v):
  return layer.apply(params, q, k, v, sequence_descriptor=desc).astype(jnp.float32)


def reference(q, k, v):
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  k, v = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
  keep = (seg[:, :, None] == seg[:, None, :]) & (pos[:, :, None] >= pos[:, None, :])
  s = jnp.where(keep[:, None], s, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


grads = [jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
         for f in (te, reference)]
errors = [rel(te(q, k, v), reference(q, k, v))] + [rel(a, b) for a, b in zip(*grads)]
print("TE smoke: relative L2 of out, dq, dk, dv:", [f"{e:.2e}" for e in errors])
assert errors[0] < 2e-2 and max(errors[1:]) < 3e-2, errors
print("TE smoke OK")
