"""Defaults shared by every family config (kvax_plugin/configs/<family>.py), and the variant lookup.

A family file lists {name: (MaxText model_name, overrides)} and calls `family_config`.
`tiny` keeps the family's attention and shrinks the rest to train on CPU in minutes; the other
variants (`8b`, `2b`, ...) are MaxText's own configs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections

# Also listed in integrations/maxtext/launch_checks.py FAMILIES.
FAMILIES = ("llama3", "mistral", "gemma2", "qwen3", "gpt_oss", "deepseek")

# Shared tiny shrinks: the byte tokenizer's 259 ids fit a 512-entry vocabulary.
TINY_COMMON = dict(vocab_size=512)


def family_config(family: str, arg: str | None,
                  variants: Mapping[str, tuple[str, dict[str, Any]]]) -> ml_collections.ConfigDict:
  """The config of `family`'s variant `arg` (None or "": "tiny"). variants: name -> (MaxText
  model_name, key overrides). Raises ValueError naming the valid variants for an unknown `arg`."""
  if family not in FAMILIES:
    raise ValueError(f"family {family!r} is not one of {FAMILIES}")
  variant = arg or "tiny"
  if variant not in variants:
    raise ValueError(f"--config={family}:{variant}: unknown variant {variant!r} for "
                     f"{family}; choose one of {', '.join(variants)}")
  model, overrides = variants[variant]
  c = ml_collections.ConfigDict()
  c.family = family
  c.variant = variant

  c.model = model
  # "kvax" or one of MaxText's own kernels (dot_product, flash, cudnn_flash_te, ...).
  c.attention = "kvax"

  c.kvax = ml_collections.ConfigDict()
  # "auto": the fastest that runs here; an explicit name that cannot run is an error.
  c.kvax.backend = "auto"
  # Block sizes (powers of two >= 16).
  c.kvax.fwd_query_block_size = 128
  c.kvax.fwd_kv_block_size = 128
  c.kvax.bwd_query_block_size = 128
  c.kvax.bwd_kv_block_size = 128
  # Triton backward: see flash_attention's memory_optimized_gqa_backward.
  c.kvax.memory_optimized_gqa_backward = False
  c.kvax.skip_pad_tokens = True
  # Context-parallel token order: "auto" (= "balanced"), "llama3" or "natural".
  c.kvax.context_parallel_order = "auto"
  # dtype of the shards' dk / dv sum: "auto", "float32" or "input" (create_attention_mask).
  c.kvax.kv_grad_reduce_dtype = "auto"
  # Overlap the kv exchange with the shard's own part (any backend but "reference").
  c.kvax.overlap_kv_gather = False

  # MaxText's {ici,dcn}_<axis>_parallelism keys; -1 = "whatever is left". `context` shards the
  # sequence; `tensor` shards heads and must divide the head counts.
  c.mesh = ml_collections.ConfigDict(dict(
      ici_data=1, ici_fsdp=-1, ici_tensor=1, ici_context=1,
      dcn_data=-1, dcn_fsdp=1, dcn_tensor=1, dcn_context=1))
  # MaxText reorders tokens for equal causal work per rank (kvax.context_parallel_order).
  c.context_parallel_load_balance = True

  # MaxText's remat_policy. "auto": on GPU, MaxText's GPU recipe's for the model (else
  # "minimal_with_context": attention output saved); on CPU, MaxText's default.
  c.remat_policy = "auto"

  c.seq_len = 2048
  c.per_device_batch_size = 1
  c.steps = 1000
  c.learning_rate = 3e-4  # peak of the warmup + cosine schedule
  c.warmup_steps_fraction = 0.1
  # Activations: "auto" = bfloat16 on GPU, float32 on CPU; weights are float32.
  c.dtype = "auto"
  # MaxText's `hardware`: "auto" = this process's devices, one process, no jax.distributed.
  c.hardware = "auto"
  c.seed = 0

  # The shipped corpus, byte-tokenized, cut into log-uniform documents, packed first-fit.
  c.data = ml_collections.ConfigDict()
  c.data.source = "shipped_corpus"
  c.data.min_doc_chars = 64
  c.data.max_doc_chars = 4096
  c.data.seed = 0
  c.data.window_batches = 8

  # "" = outputs/<family>-<variant>-<attention>.
  c.output_dir = ""
  c.log_every = 1
  # Only the launcher's lines on the console; the rest goes to <output_dir>/maxtext.log.
  c.quiet = True

  c.model_overrides = ml_collections.ConfigDict(dict(overrides))

  if variant == "tiny":
    # 64-token blocks: fine enough to skip between documents.
    c.kvax.fwd_query_block_size = 64
    c.kvax.fwd_kv_block_size = 64
    c.kvax.bwd_query_block_size = 64
    c.kvax.bwd_kv_block_size = 64
    c.seq_len = 1024
    c.per_device_batch_size = 2
    c.steps = 40
    c.learning_rate = 3e-3
    c.data.max_doc_chars = 768
  return c

