"""Helpers for the MaxText integration tests: shrunken upstream configs, packed batches, parity.

Models come from MaxText's own configs/models/<name>.yml; only width, depth, vocabulary and
expert counts are shrunk. Head dims, query/kv head counts (GQA ratio), sliding windows, soft
caps, sinks and MLA dims are kept as upstream has them.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

# Per-model shrink overrides (MaxText config keys). Attention-defining keys are never touched.
SHRINK = {
    "llama3-8b": dict(base_emb_dim=128, base_mlp_dim=256, base_num_decoder_layers=2),
    "mistral-7b": dict(base_emb_dim=128, base_mlp_dim=256, base_num_decoder_layers=2),
    # gemma2 merges a local and a global attention layer into one decoder layer.
    "gemma2-2b": dict(base_emb_dim=128, base_mlp_dim=256, base_num_decoder_layers=1),
    "qwen3-0.6b": dict(base_emb_dim=128, base_mlp_dim=256, base_num_decoder_layers=2),
    # gpt-oss alternates local (window 128) and global layers; MoE shrunk to 4 experts, top-2.
    "gpt-oss-20b": dict(base_emb_dim=128, base_mlp_dim=128, base_moe_mlp_dim=128,
                        base_num_decoder_layers=2, num_experts=4, num_experts_per_tok=2),
    # deepseek3-tiny keeps MLA (qk 128 + 64 rope = 192, v 128); one dense + one MoE layer.
    "deepseek3-tiny": dict(base_num_decoder_layers=2, first_num_dense_layers=1, num_experts=4,
                           num_experts_per_tok=2),
}
MODELS = tuple(SHRINK)
# Attention-defining keys the shrink must keep (checked by the tests against the upstream yml).
ATTENTION_KEYS = ("head_dim", "base_num_query_heads", "base_num_kv_heads", "sliding_window_size",
                  "attn_logits_soft_cap", "attention_sink", "attention_type", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank")

COMMON = dict(
    override_model_config=True, hardware="cpu", skip_jax_distributed_system=True,
    vocab_size=512, dtype="float32", weight_dtype="float32", matmul_precision="highest",
    scan_layers=True, enable_checkpointing=False, enable_dropout=False,
    base_output_directory="/tmp/kvax_maxtext_it", run_name="kvax_it", log_config=False,
    sparse_matmul=False, capacity_factor=-1.0,
    # kvax blocks smaller than the default so short test sequences still hold several blocks
    kvax_fwd_query_block_size=32, kvax_fwd_kv_block_size=32, kvax_bwd_query_block_size=32,
    kvax_bwd_kv_block_size=32,
    # KVAX_IT_BACKEND=triton runs the same parity on a GPU with the Triton kernels.
    kvax_backend=os.environ.get("KVAX_IT_BACKEND", "jax"),
    # The test run's compilation cache (conftest.py), not MaxText's default ~/jax_cache.
    jax_cache_dir=os.environ.get("KVAX_TEST_JAX_CACHE") or "~/jax_cache",
)


def maxtext_dir() -> str:
  import maxtext
  return os.path.dirname(maxtext.__file__)


def upstream_model_yml(name: str) -> dict:
  import yaml
  with open(os.path.join(maxtext_dir(), "configs", "models", f"{name}.yml")) as f:
    return yaml.safe_load(f)


def make_config(model: str, attention: str, *, seq_len: int = 256, batch_per_device: int = 2,
                extra: dict | None = None):
  """A MaxText config (HyperParameters) for a shrunken upstream model."""
  from maxtext.configs import pyconfig
  kwargs = dict(COMMON)
  kwargs.update(SHRINK[model])
  kwargs.update(model_name=model, attention=attention, max_target_length=seq_len,
                per_device_batch_size=batch_per_device)
  kwargs.update(extra or {})
  return pyconfig.initialize([None, os.path.join(maxtext_dir(), "configs", "base.yml")], **kwargs)


def make_model(config, mesh=None, seed: int = 0):
  from flax import nnx
  from maxtext.utils import maxtext_utils, model_creation_utils
  mesh = mesh if mesh is not None else maxtext_utils.get_mesh_from_config(config)
  model = model_creation_utils.from_config(config, mesh=mesh,
                                           rngs=nnx.Rngs(params=seed, dropout=seed + 1, aqt=seed + 2))
  return model, mesh


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedBatch:
  tokens: jax.Array  # [B, S] int32
  targets: jax.Array
  positions: jax.Array  # per-document positions (0 on padding)
  segment_ids: jax.Array  # MaxText convention: 1..n, 0 = padding
  weights: jax.Array  # 1 on real target tokens, 0 on padding


def packed_batch(batch: int, seq_len: int, vocab: int, seed: int = 0, pad_fraction: float = 0.15,
                 min_doc: int = 5) -> PackedBatch:
  """Several documents of random lengths per row, then padding (as MaxText's packing lays out).

  Row 0 starts with a document of 0.6 * seq_len tokens, longer than the windows under test.
  """
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, size=(batch, seq_len + 1)).astype(np.int32)
  seg = np.zeros((batch, seq_len), np.int32)
  pos = np.zeros((batch, seq_len), np.int32)
  for b in range(batch):
    real = seq_len - int(pad_fraction * seq_len) - int(rng.integers(0, 8))
    start, doc = 0, 1
    while start < real:
      length = int(min(real - start, rng.integers(min_doc, max(min_doc + 1, seq_len // 3))))
      if b == 0 and doc == 1:
        # One long document, so sliding windows (gpt-oss: 128) cut inside a document.
        length = int(0.6 * seq_len)
      seg[b, start:start + length] = doc
      pos[b, start:start + length] = np.arange(length)
      start += length
      doc += 1
  tok = np.where(seg > 0, tokens[:, :-1], 0)
  tgt = np.where(seg > 0, tokens[:, 1:], 0)
  return PackedBatch(jnp.asarray(tok), jnp.asarray(tgt), jnp.asarray(pos), jnp.asarray(seg),
                     jnp.asarray((seg > 0).astype(np.float32)))


def to_maxtext_batch(batch: PackedBatch) -> dict:
  """The keys MaxText's input pipeline yields (and its reorder permutes)."""
  return dict(inputs=batch.tokens, targets=batch.targets, inputs_position=batch.positions,
              targets_position=batch.positions, inputs_segmentation=batch.segment_ids,
              targets_segmentation=batch.segment_ids)


def from_maxtext_batch(d: dict) -> PackedBatch:
  """Back from MaxText's keys; through the host, so the arrays are uncommitted again (a reorder
  may have placed them on one device, which a jit over the mesh would reject)."""
  host = {k: np.asarray(v) for k, v in d.items()}
  seg = host["targets_segmentation"]
  return PackedBatch(jnp.asarray(host["inputs"]), jnp.asarray(host["targets"]),
                     jnp.asarray(host["inputs_position"]), jnp.asarray(host["inputs_segmentation"]),
                     jnp.asarray((seg > 0).astype(np.float32)))


def loss_and_logits(model, batch: PackedBatch):
  """MaxText's own training objective (train.loss_fn: cross entropy over targets_segmentation
  != 0 plus its auxiliary losses, e.g. the MoE load-balance loss, which averages over every
  token, padding included) and the logits it was computed from."""
  from maxtext.trainers.pre_train import train
  # loss_fn keeps the logits to itself; record the model's output on the way. The class is
  # patched only while this function traces (nnx calls the module through its class).
  seen = []
  cls = type(model)
  call = cls.__call__

  def recording_call(self, *args, **kwargs):
    out = call(self, *args, **kwargs)
    seen.append(out)
    return out

  cls.__call__ = recording_call
  try:
    loss, aux = train.loss_fn(model, model.config, to_maxtext_batch(batch), None, None,
                              is_train=True)
  finally:
    cls.__call__ = call
  return loss, (seen[0], jnp.asarray(aux["moe_lb_loss"], jnp.float32))


def value_and_grads(model, batch: PackedBatch, with_aux: bool = False):
  """(loss, logits, grads) with grads over every nnx.Param, jitted; with_aux adds the MoE
  load-balance loss (part of loss) as a fourth value."""
  from flax import nnx

  @nnx.jit
  def step(m, b):
    (loss, (logits, lb_loss)), grads = nnx.value_and_grad(loss_and_logits, has_aux=True)(m, b)
    return loss, logits, grads, lb_loss

  out = step(model, batch)
  return out if with_aux else out[:3]


def flat_params(tree) -> dict[str, np.ndarray]:
  from flax import nnx
  if isinstance(tree, nnx.State):
    tree = tree.to_pure_dict() if hasattr(tree, "to_pure_dict") else nnx.to_pure_dict(tree)
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


# Tolerances, float32 everywhere (differences are summation-order noise). Logits: max |diff| /
# max |logit| over non-padding tokens. Gradients: max |diff| / max |grad| per parameter. The
# token embedding of models with tied input/output embeddings (gemma2, qwen3) is the noisiest
# tensor: its gradient sums large, cancelling terms over every position, and two correct kvax
# backends ("jax" and the dense float32 "reference") differ there by 1.2e-3 on gemma2, as much
# as kvax and dot_product do. Every other gradient agrees to ~1e-6.
LOGIT_TOL = 1e-5
GRAD_TOL = 1e-4
EMBEDDING_GRAD_TOL = 5e-3


def grad_tolerance(name: str) -> float:
  return EMBEDDING_GRAD_TOL if "token_embedder" in name else GRAD_TOL


def max_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
  """max |a - b| / (max |b| + tiny): a scale-free difference for whole tensors."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)) if a.size else 0.0


def compare_with_dot_product(model: str, extra: dict, seed: int) -> dict:
  """Run `model` with attention=dot_product and attention=kvax on one packed batch; compare.

  Returns loss_dot_product, loss_kvax, logits_max_rel_diff (non-padding tokens) and grad_diffs
  ({parameter: max_rel_diff}); the two runs share the config overrides `extra` and the batch.
  """
  runs = {}
  for attention in ("dot_product", "kvax"):
    config = make_config(model, attention, extra=extra)
    m, mesh = make_model(config)
    batch = packed_batch(config.global_batch_size_to_train_on, config.max_target_length,
                         config.vocab_size, seed=seed)
    with jax.set_mesh(mesh):
      loss, logits, grads = value_and_grads(m, batch)
    runs[attention] = (float(loss), np.asarray(logits), flat_params(grads))
  (l_ref, lg_ref, g_ref), (l_k, lg_k, g_k) = runs["dot_product"], runs["kvax"]
  keep = np.asarray(batch.weights) > 0
  return dict(loss_dot_product=l_ref, loss_kvax=l_k,
              logits_max_rel_diff=max_rel_diff(lg_k[keep], lg_ref[keep]),
              grad_diffs={n: max_rel_diff(g_k[n], g_ref[n]) for n in g_ref})
