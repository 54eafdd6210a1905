"""The launcher's config (kvax_plugin/configs/<family>.py) as MaxText keys and argv, and checks
on MaxText's resolved config naming the flag to change.
"""

from __future__ import annotations

import math
import os
from typing import Any

from kvax_plugin.errors import FlagError

MESH_KEYS = {f"{net}_{axis}": f"{net}_{axis}_parallelism"
             for net in ("ici", "dcn") for axis in ("data", "fsdp", "tensor", "context")}
KVAX_KEYS = ("fwd_query_block_size", "fwd_kv_block_size", "bwd_query_block_size",
             "bwd_kv_block_size", "memory_optimized_gqa_backward", "skip_pad_tokens",
             "context_parallel_order", "kv_grad_reduce_dtype", "overlap_kv_gather")


def maxtext_dir() -> str:
  import maxtext
  return os.path.dirname(maxtext.__file__)


def output_dir(cfg) -> str:
  return os.path.abspath(cfg.output_dir or os.path.join(
      "outputs", f"{cfg.family}-{cfg.variant}-{cfg.attention}"))


def maxtext_keys(cfg, platform: str) -> dict[str, Any]:
  out = output_dir(cfg)
  keys: dict[str, Any] = dict(
      model_name=cfg.model,
      override_model_config=True,
      attention=cfg.attention,
      max_target_length=cfg.seq_len,
      per_device_batch_size=cfg.per_device_batch_size,
      steps=cfg.steps,
      learning_rate=cfg.learning_rate,
      warmup_steps_fraction=cfg.warmup_steps_fraction,
      init_weights_seed=cfg.seed,
      context_parallel_load_balance=cfg.context_parallel_load_balance,
      # Our rows are packed; "synthetic" dataset_type only passes MaxText's data-key validation
      # (the run replaces its iterator with the packed corpus).
      packing=True,
      dataset_type="synthetic",
      enable_checkpointing=False,
      base_output_directory=os.path.dirname(out),
      run_name=os.path.basename(out),
      enable_tensorboard=True,
      metrics_file=os.path.join(out, "metrics.jsonl"),
      log_config=False,
      dtype=("bfloat16" if platform == "gpu" else "float32") if cfg.dtype == "auto" else cfg.dtype,
  )
  if cfg.hardware == "auto":
    # One process: jax.distributed would wait for peers.
    keys.update(hardware=platform, skip_jax_distributed_system=True)
  else:
    keys.update(hardware=cfg.hardware)
  keys.update(remat_keys(cfg, platform))
  for field, key in MESH_KEYS.items():
    keys[key] = cfg.mesh[field]
  keys["kvax_backend"] = cfg.kvax.backend
  for field in KVAX_KEYS:
    keys[f"kvax_{field}"] = cfg.kvax[field]
  keys.update(cfg.model_overrides.to_dict())
  return keys


GPU_DEFAULT_REMAT_POLICY = "minimal_with_context"


def gpu_recipe(model: str) -> dict[str, Any]:
  """remat_policy and scan_layers of MaxText's GPU recipe for `model` ({} when none)."""
  import yaml
  folder = os.path.join(maxtext_dir(), "configs", "gpu", "models")
  if not os.path.isdir(folder):
    return {}
  # The recipe named after the model first (other sizes may share its model_name).
  named = model.replace("-", "_") + ".yml"
  names = sorted(n for n in os.listdir(folder) if n.endswith(".yml"))
  for name in sorted(names, key=lambda n: n != named):
    with open(os.path.join(folder, name), encoding="utf-8") as f:
      recipe = yaml.safe_load(f) or {}
    if recipe.get("model_name") == model:
      return {k: recipe[k] for k in ("remat_policy", "scan_layers") if k in recipe}
  return {}


def remat_keys(cfg, platform: str) -> dict[str, Any]:
  """MaxText keys for cfg.remat_policy ("auto": gpu_recipe on GPU, else GPU_DEFAULT_REMAT_POLICY;
  MaxText's default on CPU)."""
  if cfg.remat_policy != "auto":
    return {"remat_policy": cfg.remat_policy}
  if platform != "gpu":
    return {}
  return {"remat_policy": GPU_DEFAULT_REMAT_POLICY, **gpu_recipe(cfg.model)}


# MaxText wants a data path set; the launcher replaces its data iterator anyway.
TE_DATA_PLACEHOLDER = "kvax-plugin-packed-corpus"


def te_packing_keys(cfg, keys: dict[str, Any], raw: dict[str, str]) -> dict[str, Any]:
  """The keys cudnn_flash_te (TransformerEngine) needs to see our rows as packed ({} for other
  attentions or when raw keys pick MaxText's data pipeline; raw keys are never replaced): a
  non-"synthetic" dataset_type (else TE attends across documents), the ring strategy under
  context parallelism, and max_segments_per_seq counted on this run's batches (fewer corrupts)."""
  if keys["attention"] != "cudnn_flash_te" or "dataset_type" in raw:
    return {}
  import jax

  from kvax_plugin.data import batch_iterator
  rows = max(1, math.ceil(float(keys["per_device_batch_size"]) * jax.device_count()))
  d = cfg.data
  stream = batch_iterator(int(keys["max_target_length"]), rows, seed=d.seed,
                          window_batches=d.window_batches, min_chars=d.min_doc_chars,
                          max_chars=d.max_doc_chars)
  steps = int(keys["steps"])
  most = max(max(batch.segments_per_row()) for batch, _ in zip(stream, range(steps)))
  out: dict[str, Any] = dict(dataset_type="grain", grain_train_files=TE_DATA_PLACEHOLDER,
                             max_segments_per_seq=int(most))
  context = [int(keys[k]) for k in ("ici_context_parallelism", "dcn_context_parallelism")]
  if context != [1, 1]:
    out["context_parallel_strategy"] = "ring"
  return {k: v for k, v in out.items() if k not in raw}


def argv_value(value: Any) -> str:
  # OmegaConf's command-line grammar (YAML-like scalars).
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, float):
    return repr(value)
  return str(value)


def maxtext_argv(keys: dict[str, Any]) -> list[str]:
  return ["kvax_plugin.launch", os.path.join(maxtext_dir(), "configs", "base.yml")] + [
      f"{k}={argv_value(v)}" for k, v in keys.items()]


def flag_for(key: str, raw: dict[str, str]) -> str:
  """The flag a user changes for MaxText key `key` (raw override, or --config field)."""
  if key in raw:
    return f"{key}={raw[key]}"
  for field, mkey in MESH_KEYS.items():
    if mkey == key:
      return f"--config.mesh.{field}"
  return f"--config.model_overrides.{key}"


def check_maxtext_config(config, cfg, raw: dict[str, str]) -> None:
  import jax
  tensor = config.ici_tensor_parallelism * max(1, config.dcn_tensor_parallelism)
  heads, kv_heads = config.num_query_heads, config.num_kv_heads
  flag = flag_for("ici_tensor_parallelism", raw)
  if tensor > 1 and heads % tensor:
    raise FlagError(f"{flag}: the tensor axis ({tensor}) must divide the {heads} query heads of "
                    f"{cfg.model} (as configured)")
  if tensor > 1 and kv_heads >= tensor and kv_heads % tensor:
    raise FlagError(f"{flag}: the tensor axis ({tensor}) must divide the {kv_heads} kv heads of "
                    f"{cfg.model} (as configured)")
  ici = [int(a) for a in config.ici_parallelism]
  per_slice = jax.device_count() // max(1, int(config.num_slices))
  fixed = math.prod(a for a in ici if a != -1)
  if (per_slice % fixed) if -1 in ici else (fixed != per_slice):
    mesh = ", ".join(f"{f}={getattr(config, k)}" for f, k in MESH_KEYS.items()
                     if f.startswith("ici"))
    raise FlagError(f"--config.mesh ({mesh}): the fixed ici axes multiply to {fixed}, which does "
                    f"not fit the {per_slice} devices here (set one axis to -1 to take the rest)")
  cp = config.ici_context_parallelism * max(1, config.dcn_context_parallelism)
  if cp > 1 and config.max_target_length % (2 * cp):
    raise FlagError(f"--config.seq_len={config.max_target_length}: context parallelism {cp} "
                    f"needs a multiple of {2 * cp} (two chunks per rank)")
