"""Levanter's own model configs, shrunk, run with attn_backend=vanilla and =kvax on packed docs.

The configs come from Levanter's registry (draccus decodes {"type": "llama", ...} through
LmConfig.register_subclass) with each family's defaults kept where they shape attention (Gemma 2's
soft caps and single kv head, OLMo 3's alternating sliding-window layers, Mixtral's experts) and
only sizes shrunk so that a float32 forward + backward compiles in seconds on 2 CPU cores.

Batches are packed rows as Levanter's packers make them: documents stored contiguously with
segment ids 0, 1, ... and -1 on padding, loss weight 0 on padding and on each document's last
token. Document boundaries fall anywhere (mid-block), rows end in padding of varying length.

The loss is Levanter's training objective (compute_next_token_loss, as its train_lm minimises
it): the weighted cross entropy plus the MoE router losses, which average over every token,
padding included, so padding rows must be Levanter's too.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 96
SEQ_LEN = 64

# Family -> shrunk overrides of Levanter's registered config (the rest are the family's defaults).
# Llama keeps Levanter's default remat of every scanned layer (the mask must survive it); the
# others turn it off, which halves their compile time on CPU without changing the math.
# Head dims of 32 (hidden 128 over 4 heads): the smallest the Triton kernels are tested at.
_SMALL = dict(hidden_dim=128, intermediate_dim=96, num_layers=2, num_heads=4, num_kv_heads=2)
_NO_REMAT = dict(gradient_checkpointing=False)
FAMILIES = {
    "llama": dict(_SMALL),
    # Qwen 3: query / key RMS norm.
    "qwen3": dict(_SMALL, **_NO_REMAT),
    # Gemma 2: attention logits soft cap 50, final logits soft cap 30, one kv head.
    "gemma2": dict(_SMALL, num_kv_heads=1, head_dim=32, **_NO_REMAT),  # Gemma sets head_dim
    # OLMo 3: its layers alternate a sliding window (here 12 tokens) with full attention.
    "olmo3": dict(_SMALL, sliding_window=12, layer_types=["sliding_attention", "full_attention"],
                  **_NO_REMAT),
    # Mixtral: a mixture of experts (4 experts, top 2) in every layer; its router losses
    # (load balancing 0.01, router z-loss) are part of the training loss.
    "mixtral": dict(_SMALL, intermediate_dim=64, n_routed_experts=4, num_experts_per_tok=2,
                    **_NO_REMAT),
    # Qwen 3 MoE: query / key norm, 4 experts top 2, its load-balancing loss (0.001) in the loss.
    "qwen3_moe": dict(_SMALL, head_dim=32, moe_intermediate_dim=64, num_experts=4,
                      num_experts_per_tok=2, **_NO_REMAT),
}


def config(family: str, attn_backend: str, **extra):
  """Levanter's registered config for `family`, shrunk, with the given attn_backend string."""
  import draccus
  from levanter.models.lm_model import LmConfig
  fields = dict(type=family, max_seq_len=SEQ_LEN, attn_backend=attn_backend)
  fields.update(FAMILIES[family])
  fields.update(extra)
  # draccus has no decoder for OLMo 3's Sequence[str] layer_types: set it after decoding.
  layer_types = fields.pop("layer_types", None)
  cfg = draccus.decode(LmConfig, fields)
  return cfg if layer_types is None else dataclasses.replace(cfg, layer_types=layer_types)


def init_model(cfg, seed: int):
  return cfg.model_type.init(hax.Axis("vocab", VOCAB), cfg, key=jax.random.PRNGKey(seed))


def init_like(model, cfg):
  """A model of config `cfg` holding `model`'s weights (same structure, other static config)."""
  shape = eqx.filter_eval_shape(lambda: cfg.model_type.init(hax.Axis("vocab", VOCAB), cfg,
                                                            key=jax.random.PRNGKey(0)))
  leaves = jax.tree_util.tree_leaves(model)
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), leaves)


@dataclasses.dataclass(frozen=True)
class Batch:
  tokens: np.ndarray  # int32 [B, S]
  segment_ids: np.ndarray  # int32 [B, S], -1 = padding
  loss_weight: np.ndarray  # float32 [B, S]

  @property
  def valid(self) -> np.ndarray:
    return self.segment_ids >= 0


def packed_batch(rng: np.random.Generator, batch: int = 4, seq_len: int = SEQ_LEN) -> Batch:
  """Rows of contiguous documents of random lengths (1..30 tokens) and a padded tail (>= 1)."""
  seg = np.full((batch, seq_len), -1, np.int32)
  for r in range(batch):
    fill = int(rng.integers(seq_len // 2, seq_len))  # at least one padding token per row
    start, doc = 0, 0
    while start < fill:
      length = min(int(rng.integers(1, 31)), fill - start)
      seg[r, start:start + length] = doc
      start, doc = start + length, doc + 1
  tokens = rng.integers(0, VOCAB, (batch, seq_len)).astype(np.int32)
  next_seg = np.concatenate([seg[:, 1:], np.full((batch, 1), -1, np.int32)], axis=1)
  weight = ((seg >= 0) & (next_seg == seg)).astype(np.float32)
  return Batch(tokens, seg, weight)


def named_inputs(b: Batch):
  """(tokens, AttentionMask with segment ids, loss weights, targets) as Levanter's named arrays."""
  from levanter.layers.attention import AttentionMask
  batch_axis = hax.Axis("batch", b.tokens.shape[0])
  pos = hax.Axis("position", b.tokens.shape[1])
  tokens = hax.named(jnp.asarray(b.tokens), (batch_axis, pos))
  seg = hax.named(jnp.asarray(b.segment_ids), (batch_axis, pos))
  mask = AttentionMask.causal().with_segment_ids(seg)
  weight = hax.named(jnp.asarray(b.loss_weight), (batch_axis, pos))
  targets = hax.roll(tokens, -1, pos)
  return tokens, mask, weight, targets


def loss_and_logits(model, tokens, mask, weight, targets):
  """Levanter's training loss and the logits, from one forward pass.

  The loss is LmHeadModel.compute_next_token_loss (what Levanter's train_lm minimises): the
  fused, weighted next-token cross entropy plus the model's auxiliary (MoE router) losses. Its
  body is written out here so that the compared logits come from the same activations; a second
  forward for them would add ~15% to each compile.
  """
  from levanter.models.lm_model import LmHeadModel, split_activations
  from levanter.models.loss import maybe_fused_next_token_loss
  del targets  # the loss shifts the tokens itself
  if type(model).compute_next_token_loss is not LmHeadModel.compute_next_token_loss:
    raise NotImplementedError(f"{type(model).__name__} overrides compute_next_token_loss: call it "
                              "instead of the written-out body here")
  x, aux_loss = split_activations(model.activations(tokens, mask))
  head = model.get_lm_head()
  loss = maybe_fused_next_token_loss(model.Pos, model.Embed, model.Vocab, x, head, tokens,
                                     loss_weight=weight) + aux_loss
  logits = hax.dot(x, head, axis=model.Embed)
  return (loss.scalar() if isinstance(loss, hax.NamedArray) else loss), logits


def forward_backward(model, tokens, mask, weight, targets):
  """(loss, logits array, gradient pytree) of one forward + backward (jit it)."""
  (loss, logits), grads = eqx.filter_value_and_grad(loss_and_logits, has_aux=True)(
      model, tokens, mask, weight, targets)
  return loss, logits.array, grads


def levanter_mesh(data: int, model: int, head_axis: str = "kv_head", context: int = 1):
  """A mesh the way Levanter's TrainerConfig builds it (axes data, replica, model, replica_dcn,
  and context when > 1), with its compute and parameter axis mappings, plus `head_axis` -> model
  (Levanter's default mapping shards only "heads" and "mlp" over model; attention's named head
  axes are "kv_head" and "q_heads_per_group") and, with a context axis, position -> context."""
  from levanter.utils.mesh import MeshConfig, create_mesh_from_axis_specs
  devices = jax.devices()[:data * model * context]
  axes = {"data": data, "replica": 1, "model": model}
  compute = {}
  if context > 1:
    axes["context"] = context
    compute["position"] = "context"
  cfg = MeshConfig(axes=axes, shared_mapping={head_axis: "model"}, compute_mapping=compute)
  ici, dcn = cfg.axis_shapes(len(devices), 1)
  mesh = create_mesh_from_axis_specs(ici_axes=ici, dcn_axes=dcn, devices=devices)
  return mesh, cfg.resolved_compute_mapping, cfg.resolved_param_mapping


def run(model, b: Batch, data: int = 1, model_axis: int = 1, head_axis: str = "kv_head",
        context: int = 1):
  """forward_backward the way Levanter's Trainer runs a step: inside jax.set_mesh, params
  sharded by the parameter mapping, the step jitted under the compute mapping."""
  mesh, compute_mapping, param_mapping = levanter_mesh(data, model_axis, head_axis, context)
  with hax.partitioning.set_mesh(mesh), hax.axis_mapping(param_mapping):
    sharded = hax.shard(model, param_mapping)
    inputs = hax.shard(named_inputs(b), compute_mapping)
    step = hax.named_jit(forward_backward, axis_resources=compute_mapping)
    loss, logits, grads = step(sharded, *inputs)
    return jax.device_get((loss, logits, grads))


def rel_diff(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))


def compare(reference, candidate, b: Batch) -> dict:
  """Max relative differences: loss, logits on every token (padding included: Levanter's padding
  attends earlier padding, and the seam must give those rows too), and the worst gradient leaf."""
  del b  # every row is compared
  loss_r, logits_r, grads_r = reference
  loss_c, logits_c, grads_c = candidate
  worst, worst_name = 0.0, ""
  flat_r = jax.tree_util.tree_leaves_with_path(grads_r)
  flat_c = jax.tree_util.tree_leaves(grads_c)
  assert len(flat_r) == len(flat_c), "gradient trees differ"
  for (path, gr), gc in zip(flat_r, flat_c):
    d = rel_diff(gr, gc)
    if d >= worst:
      worst, worst_name = d, jax.tree_util.keystr(path)
  return {
      "loss": rel_diff(loss_r, loss_c),
      "logits": rel_diff(logits_r, logits_c),
      "worst_grad": worst, "worst_grad_leaf": worst_name, "num_grad_leaves": len(flat_r),
  }
