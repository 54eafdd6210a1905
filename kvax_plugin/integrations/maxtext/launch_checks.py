"""The launcher's checks: each bad value is one error line naming the flag or raw key at fault,
run by kvax_plugin.launch between the flags and MaxText's config.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import kvax_plugin
from kvax_plugin.attention.kv_exchange import KV_GRAD_REDUCE_CHOICES
from kvax_plugin.attention.kernels import BACKENDS as KVAX_BACKENDS
from kvax_plugin.configs import common as configs_common
from kvax_plugin.configs.common import FAMILIES
from kvax_plugin.errors import FlagError, SetupError
from kvax_plugin.integrations.maxtext.launch_keys import KVAX_KEYS, maxtext_dir

ATTENTIONS = ("kvax", "dot_product", "flash", "cudnn_flash_te", "cudnn_flash_jax", "autoselected")


def _configs_dir() -> str:
  return os.path.dirname(os.path.abspath(configs_common.__file__))


def resolve_config_path(path: str) -> str:
  """The config file `path` names: an existing file as is; else a family name or a checkout's
  "configs/<family>.py" as the file shipped in the package. Other paths come back unchanged."""
  if os.path.isfile(path):
    return path
  name = os.path.basename(path)
  family = name[:-3] if name.endswith(".py") else name
  in_checkout_layout = path in (family, f"{family}.py", os.path.join("configs", f"{family}.py"))
  if family in FAMILIES and in_checkout_layout:
    return os.path.join(_configs_dir(), f"{family}.py")
  return path


def resolve_config_argv(argv: Sequence[str]) -> list[str]:
  out = list(argv)
  for i, arg in enumerate(out):
    if arg == "--config" and i + 1 < len(out):
      path, sep, variant = out[i + 1].partition(":")
      out[i + 1] = resolve_config_path(path) + sep + variant
      break
    if arg.startswith("--config="):
      path, sep, variant = arg.split("=", 1)[1].partition(":")
      out[i] = "--config=" + resolve_config_path(path) + sep + variant
      break
  return out


def check_config_path(argv: Sequence[str]) -> None:
  """Name the family when --config points at no file."""
  if any(a in ("-h", "--help", "--helpshort", "--helpfull", "-?") for a in argv):
    return
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      value = argv[i + 1]
    elif arg.startswith("--config="):
      value = arg.split("=", 1)[1]
    else:
      continue
    path = resolve_config_path(value.split(":", 1)[0])
    family = os.path.splitext(os.path.basename(path))[0]
    families = (f"Families: {', '.join(FAMILIES)}, as <family>:<variant> (files in "
                f"{_configs_dir()}) or a config file's path")
    if not os.path.isfile(path):
      raise FlagError(f"--config={value}: no config file {path!r} (unknown family {family!r}?). "
                      + families)
    check_family_file(value, path, families)
    return
  raise FlagError("--config is required, e.g. --config=llama3:tiny")


def check_family_file(value: str, path: str, families: str) -> None:
  """A --config file must be a Python file defining get_config (read, not run)."""
  import ast
  try:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
  except (SyntaxError, UnicodeDecodeError, ValueError) as e:
    raise FlagError(f"--config={value}: {path!r} is not a Python config file ({e}). "
                    + families) from e
  defines = any(isinstance(n, ast.FunctionDef) and n.name == "get_config" for n in tree.body)
  imports = any(isinstance(n, ast.ImportFrom) and any(
      (a.asname or a.name) == "get_config" for a in n.names) for n in tree.body)
  if not (defines or imports):
    raise FlagError(f"--config={value}: {path!r} is not a family config (it defines no "
                    "get_config(variant)). " + families)


def detect_platform() -> str:
  import jax
  platform = jax.default_backend()
  if platform not in ("gpu", "cpu"):
    raise FlagError(f"--config.hardware=auto: JAX runs on {platform!r}; set --config.hardware "
                    "to MaxText's name for it (e.g. tpu)")
  return platform


def check_config(cfg) -> None:
  if cfg.family not in FAMILIES:
    raise FlagError(f"--config: family {cfg.family!r} is not one of {FAMILIES}")
  if cfg.attention not in ATTENTIONS:
    raise FlagError(f"--config.attention={cfg.attention!r}: choose one of {ATTENTIONS}")
  if not isinstance(cfg.remat_policy, str) or not cfg.remat_policy:
    raise FlagError(f"--config.remat_policy={cfg.remat_policy!r}: \"auto\" or a MaxText "
                    "remat_policy name (e.g. minimal_with_context, full)")
  if cfg.kvax.backend not in KVAX_BACKENDS:
    raise FlagError(f"--config.kvax.backend={cfg.kvax.backend!r}: choose one of {KVAX_BACKENDS}")
  for key in KVAX_KEYS[:4]:
    value = cfg.kvax[key]
    if not isinstance(value, int) or value < 16 or value & (value - 1):
      raise FlagError(f"--config.kvax.{key}={value!r}: must be a power of two >= 16")
  for key in ("seq_len", "per_device_batch_size", "steps", "log_every"):
    if not isinstance(cfg[key], int) or cfg[key] < 1:
      raise FlagError(f"--config.{key}={cfg[key]!r}: must be a positive int")
  if not cfg.learning_rate >= 0:
    raise FlagError(f"--config.learning_rate={cfg.learning_rate!r}: must be >= 0")
  if cfg.data.source != "shipped_corpus":
    raise FlagError(f"--config.data.source={cfg.data.source!r}: only 'shipped_corpus' is built in; "
                    "for MaxText's own pipelines pass its keys raw (dataset_type=hf hf_path=...)")
  if not 1 <= cfg.data.min_doc_chars <= cfg.data.max_doc_chars:
    raise FlagError(f"--config.data.min_doc_chars={cfg.data.min_doc_chars} and "
                    f"--config.data.max_doc_chars={cfg.data.max_doc_chars}: need "
                    "1 <= min_doc_chars <= max_doc_chars")
  for key, value in cfg.mesh.items():
    if not isinstance(value, int) or (value < 1 and value != -1):
      raise FlagError(f"--config.mesh.{key}={value!r}: must be a positive int or -1")
  orders = ("auto", "natural", "llama3", "balanced")
  order = cfg.kvax.context_parallel_order
  if order not in orders:
    raise FlagError(f"--config.kvax.context_parallel_order={order!r}: choose one of {orders}")
  reduce_dtype = cfg.kvax.kv_grad_reduce_dtype
  if reduce_dtype not in KV_GRAD_REDUCE_CHOICES:
    raise FlagError(f"--config.kvax.kv_grad_reduce_dtype={reduce_dtype!r}: choose one of "
                    f"{KV_GRAD_REDUCE_CHOICES}")
  context = cfg.mesh.ici_context * cfg.mesh.dcn_context
  if (cfg.attention == "kvax" and cfg.context_parallel_load_balance and context > 1
      and order in ("auto", "balanced")):
    unit = max(cfg.kvax.fwd_query_block_size, cfg.kvax.bwd_query_block_size)
    if cfg.seq_len % (context * unit):
      raise FlagError(
          f"--config.seq_len={cfg.seq_len}: the balanced context-parallel order moves whole "
          f"blocks of {unit} tokens (the larger kvax query block) and gives each of the "
          f"{context} context ranks as many; use a multiple of {context * unit}, or "
          "--config.kvax.context_parallel_order=llama3")
  if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
    raise FlagError(f"--config.dtype={cfg.dtype!r}: choose auto, float32, bfloat16 or float16")


def check_model(cfg) -> None:
  from kvax_plugin.integrations.maxtext import versions
  try:
    versions.check_version()
  except (ImportError, versions.MaxTextVersionError) as e:
    raise SetupError(f"the launcher trains through MaxText: {e}") from e
  yml = os.path.join(maxtext_dir(), "configs", "models", f"{cfg.model}.yml")
  if not os.path.isfile(yml):
    raise FlagError(f"--config.model={cfg.model!r}: MaxText has no configs/models/{cfg.model}.yml "
                    f"(in {maxtext_dir()})")


def check_backend(cfg) -> str:
  return resolve_kvax_backend(cfg.kvax.backend, f"--config.kvax.backend={cfg.kvax.backend}")


def resolve_kvax_backend(name: str, flag: str) -> str:
  if name not in KVAX_BACKENDS:
    raise FlagError(f"{flag}: choose one of {KVAX_BACKENDS}")
  try:
    return kvax_plugin.resolve_backend(name)
  except kvax_plugin.BackendUnavailableError as e:
    raise kvax_plugin.BackendUnavailableError(f"{flag}: {e}") from e


def check_attention(attention: str, platform: str, flag: str) -> None:
  if attention not in ATTENTIONS:
    raise FlagError(f"{flag}: choose one of {ATTENTIONS}")
  if platform == "cpu" and attention not in ("kvax", "dot_product", "autoselected"):
    # MaxText's fused kernels fail deep inside tracing on CPU.
    raise FlagError(f"{flag}: MaxText runs this kernel only on GPU/TPU; on CPU use kvax or "
                    "dot_product")
  if (attention == "cudnn_flash_te" and platform == "gpu"
      and importlib.util.find_spec("transformer_engine") is None):
    raise FlagError(f"{flag}: MaxText runs this kernel through TransformerEngine, which is not "
                    "installed (pip install transformer-engine-jax transformer-engine-cu13; "
                    "benchmarks/tools/transformer_engine/ for the GPU machines here)")


_RAW_POSITIVE_INTS = ("steps", "max_target_length", "log_period")


def _attention_flag(cfg, raw: dict[str, str]) -> str:
  return (f"attention={raw['attention']}" if "attention" in raw
          else f"--config.attention={cfg.attention}")


def _backend_flag(cfg, raw: dict[str, str], value: str) -> str:
  return (f"kvax_backend={raw['kvax_backend']}" if "kvax_backend" in raw
          else f"--config.kvax.backend={value}")


def check_raw_overrides(cfg, raw: dict[str, str], platform: str) -> None:
  """Raw keys get the launcher's checks too; each error names the raw key."""
  if "attention" in raw:
    check_attention(raw["attention"], platform, _attention_flag(cfg, raw))
  attention = raw.get("attention", cfg.attention)
  if attention == "kvax" and "kvax_backend" in raw:
    resolve_kvax_backend(raw["kvax_backend"], _backend_flag(cfg, raw, raw["kvax_backend"]))
  for key in _RAW_POSITIVE_INTS:
    if key in raw:
      try:
        ok = int(raw[key]) >= 1
      except ValueError:
        ok = False
      if not ok:
        raise FlagError(f"{key}={raw[key]}: must be a positive integer")


def what_maxtext_runs(config, cfg, raw: dict[str, str], platform: str) -> tuple[str, str | None]:
  """(attention kernel, resolved kvax backend or None) from MaxText's final config (raw keys
  win)."""
  attention = str(config.attention)
  check_attention(attention, platform, _attention_flag(cfg, raw))
  if attention != "kvax":
    return attention, None
  chosen = str(config.kvax_backend)
  return attention, resolve_kvax_backend(chosen, _backend_flag(cfg, raw, chosen))


def _scalar_annotation(annotation) -> bool:
  """Whether a config field's type is a plain scalar pydantic can check alone."""
  import types
  import typing
  origin = typing.get_origin(annotation)
  if origin is typing.Literal:
    return True
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return bool(args) and all(_scalar_annotation(a) for a in args)
  return annotation in (bool, int, float)


def check_raw_keys(raw: dict[str, str], config_class) -> None:
  """Every raw key is a field of MaxText's config and a scalar's value parses as its type: one
  line naming the key instead of a traceback."""
  import difflib

  import omegaconf
  import pydantic
  fields = dict(config_class.model_fields)
  for info in list(fields.values()):
    sub = getattr(info.annotation, "model_fields", None)
    if sub:
      for name, sub_info in sub.items():
        fields.setdefault(name, sub_info)
  for key, value in raw.items():
    if key not in fields:
      close = difflib.get_close_matches(key, list(fields), n=3)
      raise FlagError(f"{key}={value}: not a MaxText config key"
                      + (f" (did you mean {' / '.join(close)}?)" if close else ""))
    annotation = fields[key].annotation
    if not _scalar_annotation(annotation):
      continue
    # OmegaConf's command-line grammar; "none" means None.
    parsed = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.from_cli([f"{key}={value}"]))[key]
    if isinstance(parsed, str) and parsed.lower() == "none":
      parsed = None
    try:
      pydantic.TypeAdapter(annotation).validate_python(parsed)
    except pydantic.ValidationError as e:
      raise FlagError(f"{key}={value}: {e.errors()[0]['msg']}") from e


def one_line(e: BaseException) -> str:
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  text = " ".join(lines[:3]) if lines else type(e).__name__
  return text if len(text) <= 300 else text[:297] + "..."


def parse_raw_overrides(args: Sequence[str]) -> dict[str, str]:
  raw = {}
  for arg in args:
    key, sep, value = arg.partition("=")
    if not sep or not key or key.startswith("-"):
      raise FlagError(f"unexpected argument {arg!r}: raw MaxText overrides are key=value, flags "
                      "are --config.<field>=value")
    raw[key] = value
  return raw
