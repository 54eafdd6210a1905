"""Defaults shared by every family config (kvax_plugin/configs/<family>.py), and the variant lookup.

A family file lists its variants as {name: (MaxText model_name, overrides)} and calls
`family_config`. Every field below is documented where it is set; `python -m kvax_plugin.launch`
translates them into MaxText keys (`maxtext_keys` in
kvax_plugin/integrations/maxtext/launch_keys.py).

Why two kinds of variants. `tiny` keeps the family's attention exactly (head dim, query/kv head
ratio, sliding window, soft cap, sinks, MLA dims) and shrinks only width, depth, vocabulary and
experts, so the kvax kernel sees the shapes and masks the real model would give it, while two CPU
cores train it in a couple of minutes. The upstream variants (`8b`, `2b`, ...) are MaxText's own
configs/models/<model_name>.yml with nothing shrunk: they are for GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections

# The launcher keeps the same list (kvax_plugin/integrations/maxtext/launch_checks.py FAMILIES)
# to name families in errors.
FAMILIES = ("llama3", "mistral", "gemma2", "qwen3", "gpt_oss", "deepseek")

# Shrinks that every tiny variant shares (MaxText keys). The byte tokenizer has 259 ids, so a
# 512-entry vocabulary holds them with room to spare (upstream vocabularies would spend most of
# a tiny model's parameters and time on an embedding the bytes never use).
TINY_COMMON = dict(vocab_size=512)


def family_config(family: str, arg: str | None,
                  variants: Mapping[str, tuple[str, dict[str, Any]]]) -> ml_collections.ConfigDict:
  """The config of `family`'s variant `arg` (None or "" selects "tiny").

  variants: name -> (MaxText model_name, MaxText key overrides for width/depth/experts).
  Raises ValueError naming the flag and the valid variants for an unknown `arg`.
  """
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
  # MaxText's model_name: configs/models/<model>.yml inside the installed maxtext package.
  c.model = model
  # The attention kernel MaxText runs: "kvax" (this plugin) or one of MaxText's own
  # (dot_product, flash, cudnn_flash_te, ...), to compare against on the same data.
  c.attention = "kvax"

  # kvax settings; they reach MaxText as its kvax_* keys (kvax_plugin.integrations.maxtext).
  c.kvax = ml_collections.ConfigDict()
  # "auto": the fastest backend that can run the call here (`python -m kvax_plugin.info` says
  # which, and why). "hopper" / "mosaic" / "triton" / "jax" / "reference" are explicit: a
  # request that cannot run is an error, never a fallback.
  c.kvax.backend = "auto"
  # Block sizes (powers of two >= 16). Smaller blocks skip more of a packed-document mask but
  # give the kernel less work per block; 128/128 (the library defaults) suit H100/H200.
  c.kvax.fwd_query_block_size = 128
  c.kvax.fwd_kv_block_size = 128
  c.kvax.bwd_query_block_size = 128
  c.kvax.bwd_kv_block_size = 128
  # Triton backward: True always accumulates dk/dv of a GQA group in place (least memory);
  # False does so whenever the grid is large enough to stay fast, else uses per-head buffers.
  c.kvax.memory_optimized_gqa_backward = False
  # Skip blocks made only of padding (False visits them, masked: slower, same result).
  c.kvax.skip_pad_tokens = True
  # Token order under load-balanced context parallelism (MaxText reorders each batch):
  # "auto" = "balanced" (per batch, from segment ids and positions: equal attention work per
  # rank on packed documents; seq_len must then be a multiple of context size x the larger
  # query block), "llama3" (MaxText's chunk swap: balances one long document only), "natural".
  c.kvax.context_parallel_order = "auto"
  # Context parallelism's sum of the shards' key / value gradients (a reduce-scatter): "auto"
  # (the input dtype at 2 context shards, where it is exact; float32 with more), "float32", or
  # "input" (bf16: half the bytes, rounded at each of the shards' additions).
  c.kvax.kv_grad_reduce_dtype = "auto"
  # Context parallelism: split each shard's attention into its own keys / values and the other
  # shards', so the exchange runs behind the first part (measured on 4 x H200, 2026-11-27:
  # +2.5% tokens/s at context 2, nothing at context 4; any backend but "reference").
  c.kvax.overlap_kv_gather = False

  # Device mesh, as MaxText's {ici,dcn}_<axis>_parallelism keys; -1 = "whatever is left".
  # ici = within a host (NVLink), dcn = across hosts. `context` shards the sequence
  # (all-gather context parallelism); `tensor` shards heads, so it must divide the head counts.
  c.mesh = ml_collections.ConfigDict(dict(
      ici_data=1, ici_fsdp=-1, ici_tensor=1, ici_context=1,
      dcn_data=-1, dcn_fsdp=1, dcn_tensor=1, dcn_context=1))
  # With context parallelism, MaxText reorders tokens so every rank gets equal causal work (in
  # the order kvax.context_parallel_order picks); the plugin reads positions, so it is exact in
  # any order and never reorders again.
  c.context_parallel_load_balance = True

  # MaxText's remat_policy. "auto": on GPU, what MaxText's GPU recipe for this model sets
  # (its configs/gpu/models/<model>.yml; "minimal_with_context" where it has none), so the
  # default run is the fast one: that policy saves the attention output, and the backward does
  # not run the attention forward again. On CPU, MaxText's own default. Any MaxText policy name
  # is passed through as is.
  c.remat_policy = "auto"

  c.seq_len = 2048  # tokens per packed row (MaxText max_target_length)
  c.per_device_batch_size = 1  # packed rows per device per step
  c.steps = 1000
  c.learning_rate = 3e-4  # peak of MaxText's warmup + cosine schedule
  c.warmup_steps_fraction = 0.1
  # Activation dtype: "auto" = bfloat16 on GPU, float32 on CPU (CPU bfloat16 matmuls are slow
  # and inexact). Weights are float32 either way (MaxText's weight_dtype default).
  c.dtype = "auto"
  # MaxText's `hardware`: "auto" = this process's devices ("gpu" or "cpu"), one process, no
  # jax.distributed; set "gpu_multiprocess" (etc.) yourself for a multi-host job.
  c.hardware = "auto"
  c.seed = 0  # model initialisation (MaxText init_weights_seed)

  # Training data: the public-domain corpus shipped in kvax_plugin/data, byte-tokenized, cut into
  # documents of log-uniform length in [min_doc_chars, max_doc_chars], packed first-fit into rows
  # with per-document positions and segment ids (1..n, 0 = padding). Nothing is downloaded.
  c.data = ml_collections.ConfigDict()
  c.data.source = "shipped_corpus"
  c.data.min_doc_chars = 64
  c.data.max_doc_chars = 4096
  c.data.seed = 0  # document grouping, epoch order and row shuffles
  c.data.window_batches = 8  # batches packed together (larger packs tighter)

  # Where the run writes: MaxText's tensorboard/ and metrics, plus mask.png, loss.png and
  # summary.json. "" = outputs/<family>-<variant>-<attention>.
  c.output_dir = ""
  c.log_every = 1  # print a progress line every this many steps
  # The console shows only the launcher's lines (banner, model, steps, summary, errors); all else
  # MaxText, JAX and XLA print goes to <output_dir>/maxtext.log.
  c.quiet = True

  # MaxText keys this variant sets (width/depth/experts for tiny; empty for upstream sizes).
  c.model_overrides = ml_collections.ConfigDict(dict(overrides))

  if variant == "tiny":
    # CPU-sized run. 64-token blocks give a 1024-token row a 16 x 16 block grid, fine enough
    # for the mask to skip whole blocks between documents, not only above the diagonal.
    c.kvax.fwd_query_block_size = 64
    c.kvax.fwd_kv_block_size = 64
    c.kvax.bwd_query_block_size = 64
    c.kvax.bwd_kv_block_size = 64
    # The corpus's documents are long (median ~450 bytes, some of several thousand), so rows
    # of 1024 tokens are the shortest that usually hold more than one document.
    c.seq_len = 1024
    c.per_device_batch_size = 2
    c.steps = 40
    c.learning_rate = 3e-3
    c.data.max_doc_chars = 768
  return c

