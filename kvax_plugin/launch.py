"""Train an upstream model family in MaxText with attention=kvax on packed real text.

    python -m kvax_plugin.launch --config=configs/llama3.py:tiny
    python -m kvax_plugin.launch --config=configs/gemma2.py:tiny --config.attention=dot_product
    python -m kvax_plugin.launch --config=configs/llama3.py:8b --config.seq_len=8192 \\
        --config.kvax.backend=triton --config.mesh.ici_tensor=2  steps=200 log_period=10

`--config` names a family file and a variant (configs/<family>.py:<variant>), `--config.<field>`
changes a field of it (the config is locked: a misspelt field is an error), and trailing
`key=value` arguments are raw MaxText keys, applied last (they win over the config; the run
prints which config-derived keys they replaced). Raw keys get the same checks as the flags
they override (attention kernel for this platform, kvax backend, positive steps), must be
MaxText config keys, and scalar ones must parse as their type. The banner and summary.json
report the attention kernel and kvax backend read back from MaxText's final config, i.e. what
ran. `--dry_run` prints the banner (stderr) and the MaxText keys (stdout) and exits.

What happens:
  1. The config is checked; a bad value is an error that names its flag (unknown family or
     variant, unknown MaxText model, heads not divisible by the mesh's tensor axis,
     kvax.backend="triton" without a usable GPU -> kvax_plugin.BackendUnavailableError).
  2. The plugin is installed (kvax_plugin.integrations.maxtext.install(): attention=kvax becomes
     a MaxText kernel, the kvax_* keys join MaxText's config class) and the config is translated
     into MaxText's own keys and handed to MaxText's training entry point
     (maxtext.trainers.pre_train.train: initialize, then its train loop, unchanged).
  3. Data: MaxText builds its iterator in input_pipeline_interface.create_data_iterator, which
     has no registry for new sources; for the duration of the run that one function is replaced
     by one returning our packed stream (kvax_plugin.data: shipped corpus, byte tokens,
     first-fit packing, segment ids 1..n / 0 padding, per-document positions), wrapped in
     MaxText's own MultiHostDataLoadIterator so host-to-device placement, context-parallel
     reordering and the rest of MaxText's data loader run as for its own sources.
  4. Progress: MetricLogger.write_metrics is wrapped (again only for the run) to print one line
     per step with loss, tokens/s and the share of attention blocks the batch's kvax mask skips,
     and to add those numbers to MaxText's TensorBoard scalars.
  5. At the end: a summary (printed and summary.json), loss.png and mask.png (the first batch's
     block mask, kvax_plugin.draw_mask) under the output directory, next to MaxText's own
     tensorboard/ folder. MaxText's full log is in maxtext.log there. The summary's
     wall_seconds hold setup+compile (up to the first step) and the first step;
     compile_breakdown splits setup+compile into JAX tracing, lowering, XLA compile, the
     launcher's phases and a remainder (integrations/maxtext/setup_timing.py).

This file is the flags -> checked config -> run path; the pieces it drives live with what they
serve: the corpus stream in kvax_plugin/data/feeding.py, the MaxText key translation, hooks and
run report in kvax_plugin/integrations/maxtext/ (launch_keys.py, training_hooks.py,
run_report.py).

Several processes (one per host), one run over all their devices:
    python -m kvax_plugin.launch --config=configs/llama3.py:8b \\
        --coordinator_address=HOST0:12345 --num_processes=N --process_id=I
on every process (I = 0 .. N-1); see kvax_plugin/integrations/maxtext/distributed.py.

Exit status: 0 after a finished run, 2 for a bad flag or raw key (one line naming it, also when
MaxText's own config loader rejects a combination), 1 otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags
from ml_collections import config_flags

import kvax_plugin
from kvax_plugin.attention.kernels import BACKENDS as KVAX_BACKENDS
from kvax_plugin.errors import FlagError, SetupError
from kvax_plugin.integrations.maxtext import run_report
from kvax_plugin.integrations.maxtext.launch_keys import (KVAX_KEYS, argv_value,
                                                          check_maxtext_config, maxtext_argv,
                                                          maxtext_dir, maxtext_keys, output_dir)
from kvax_plugin.integrations.maxtext.setup_timing import SetupTimer
from kvax_plugin.integrations.maxtext.training_hooks import (Progress, packed_corpus_pipeline,
                                                             progress_hook, quiet_maxtext)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "configs/<family>.py:<variant>, e.g. configs/llama3.py:tiny",
    lock_config=True)
_DRY_RUN = flags.DEFINE_bool("dry_run", False,
                             "check the config, print the MaxText keys it becomes, and exit")
# One run over several processes (integrations/maxtext/distributed.py has the command): MaxText
# starts jax.distributed only from its schedulers' environment variables, so these flags do it.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0, for a run over several processes")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "processes of the run (one per host), "
                                      "joined by jax.distributed")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "this process: 0 .. num_processes-1")

FAMILIES = ("llama3", "mistral", "gemma2", "qwen3", "gpt_oss", "deepseek")
ATTENTIONS = ("kvax", "dot_product", "flash", "cudnn_flash_te", "cudnn_flash_jax", "autoselected")


def _configs_dir() -> str:
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


# ----------------------------------------------------------------------------------------------
# Flags -> checked config -> MaxText keys
# ----------------------------------------------------------------------------------------------


def check_config_path(argv: Sequence[str]) -> None:
  """Name the family when --config points at no file (config_flags would defer a vague error)."""
  if any(a in ("-h", "--help", "--helpshort", "--helpfull", "-?") for a in argv):
    return  # help needs no config
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      value = argv[i + 1]
    elif arg.startswith("--config="):
      value = arg.split("=", 1)[1]
    else:
      continue
    path = value.split(":", 1)[0]
    family = os.path.splitext(os.path.basename(path))[0]
    families = (f"Families: {', '.join(FAMILIES)}, as configs/<family>.py:<variant> (in "
                f"{_configs_dir()})")
    if not os.path.isfile(path):
      raise FlagError(f"--config={value}: no config file {path!r} (unknown family {family!r}?). "
                      + families)
    check_family_file(value, path, families)
    return
  raise FlagError("--config is required, e.g. --config=configs/llama3.py:tiny")


def check_family_file(value: str, path: str, families: str) -> None:
  """A --config file must be a Python file defining get_config (read, not run: a README or a
  helper module would otherwise fail inside config_flags with a syntax or attribute error)."""
  import ast
  try:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
  except (SyntaxError, UnicodeDecodeError, ValueError) as e:
    raise FlagError(f"--config={value}: {path!r} is not a Python config file ({e}). "
                    + families) from e
  if not any(isinstance(n, ast.FunctionDef) and n.name == "get_config" for n in tree.body):
    raise FlagError(f"--config={value}: {path!r} is not a family config (it defines no "
                    "get_config(variant)). " + families)


def detect_platform() -> str:
  """"gpu" or "cpu": the platform of this process's default JAX devices."""
  import jax
  platform = jax.default_backend()
  if platform not in ("gpu", "cpu"):
    raise FlagError(f"--config.hardware=auto: JAX runs on {platform!r}; set --config.hardware "
                    "to MaxText's name for it (e.g. tpu)")
  return platform


def check_config(cfg) -> None:
  """Checks that need no MaxText config; each error names the flag at fault."""
  if cfg.family not in FAMILIES:
    raise FlagError(f"--config: family {cfg.family!r} is not one of {FAMILIES}")
  if cfg.attention not in ATTENTIONS:
    raise FlagError(f"--config.attention={cfg.attention!r}: choose one of {ATTENTIONS}")
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
  """MaxText is installed in a supported version and ships configs/models/<cfg.model>.yml."""
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
  """The kvax backend the run will use; an explicit one that cannot run here is an error."""
  return resolve_kvax_backend(cfg.kvax.backend, f"--config.kvax.backend={cfg.kvax.backend}")


def resolve_kvax_backend(name: str, flag: str) -> str:
  """`name` resolved ("auto" -> the backend that will run); errors name `flag`."""
  if name not in KVAX_BACKENDS:
    raise FlagError(f"{flag}: choose one of {KVAX_BACKENDS}")
  try:
    return kvax_plugin.resolve_backend(name)
  except kvax_plugin.BackendUnavailableError as e:
    raise kvax_plugin.BackendUnavailableError(f"{flag}: {e}") from e


def check_attention(attention: str, platform: str, flag: str) -> None:
  """An attention kernel the launcher knows, and one MaxText can run on this platform."""
  if attention not in ATTENTIONS:
    raise FlagError(f"{flag}: choose one of {ATTENTIONS}")
  if platform == "cpu" and attention not in ("kvax", "dot_product", "autoselected"):
    # MaxText's fused kernels are Pallas TPU / Triton GPU / cuDNN programs: they fail on CPU
    # deep inside tracing. Say so up front.
    raise FlagError(f"{flag}: MaxText runs this kernel only on GPU/TPU; on CPU use kvax or "
                    "dot_product")


# Raw keys with a meaning the launcher checks itself (a positive int), as for their --config twins.
_RAW_POSITIVE_INTS = ("steps", "max_target_length", "log_period")


def _attention_flag(cfg, raw: dict[str, str]) -> str:
  return (f"attention={raw['attention']}" if "attention" in raw
          else f"--config.attention={cfg.attention}")


def _backend_flag(cfg, raw: dict[str, str], value: str) -> str:
  return (f"kvax_backend={raw['kvax_backend']}" if "kvax_backend" in raw
          else f"--config.kvax.backend={value}")


def check_raw_overrides(cfg, raw: dict[str, str], platform: str) -> None:
  """Raw keys get the launcher's checks too (no bypass): the attention kernel, the kvax
  backend, and positive counts; each error names the raw key."""
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
  """(attention kernel, resolved kvax backend or None) read back from MaxText's final config:
  what the run uses whatever the launcher config said (raw keys win). Errors name the flag."""
  attention = str(config.attention)
  check_attention(attention, platform, _attention_flag(cfg, raw))
  if attention != "kvax":
    return attention, None
  chosen = str(config.kvax_backend)
  return attention, resolve_kvax_backend(chosen, _backend_flag(cfg, raw, chosen))


def _scalar_annotation(annotation) -> bool:
  """Whether a config field's type is a plain scalar (bool / int / float / Literal, or a union
  of those and None) whose value pydantic can check alone; other fields MaxText coerces itself."""
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
  """Every raw key is a field of MaxText's config (nested models included, as MaxText reads
  them), and a scalar field's value parses as its type: a mistake is one line naming the key
  instead of a traceback from MaxText's config loader."""
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
    # MaxText reads key=value with OmegaConf's command-line grammar; "none" means None.
    parsed = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.from_cli([f"{key}={value}"]))[key]
    if isinstance(parsed, str) and parsed.lower() == "none":
      parsed = None
    try:
      pydantic.TypeAdapter(annotation).validate_python(parsed)
    except pydantic.ValidationError as e:
      raise FlagError(f"{key}={value}: {e.errors()[0]['msg']}") from e


def _one_line(e: BaseException) -> str:
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  text = " ".join(lines[:3]) if lines else type(e).__name__
  return text if len(text) <= 300 else text[:297] + "..."


def parse_raw_overrides(args: Sequence[str]) -> dict[str, str]:
  """Trailing `key=value` arguments (MaxText keys); anything else is an error."""
  raw = {}
  for arg in args:
    key, sep, value = arg.partition("=")
    if not sep or not key or key.startswith("-"):
      raise FlagError(f"unexpected argument {arg!r}: raw MaxText overrides are key=value, flags "
                      "are --config.<field>=value")
    raw[key] = value
  return raw


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def run(cfg, raw: dict[str, str], *, dry_run: bool = False) -> dict[str, Any] | None:
  """Check, translate and train; returns the summary (None for a dry run).

  JAX's compile events are recorded for the whole call (setup_timing.SetupTimer), so the
  summary can say where setup+compile went ("compile_breakdown")."""
  timer = SetupTimer()
  with timer.listening():
    return _run(cfg, raw, dry_run, timer)


def _run(cfg, raw: dict[str, str], dry_run: bool, timer: SetupTimer) -> dict[str, Any] | None:
  t0 = time.time()
  timer.start("launcher_checks")
  missing = [f for f in ("family", "variant", "model", "attention", "kvax", "mesh", "data")
             if f not in cfg]
  if missing:
    raise FlagError(f"--config: the config has no {', '.join(missing)} field(s), so it is not a "
                    "family config (configs/<family>.py builds one with "
                    "configs.common.family_config)")
  check_config(cfg)
  platform = detect_platform() if cfg.hardware == "auto" else cfg.hardware
  check_attention(cfg.attention, platform, f"--config.attention={cfg.attention}")
  if raw.get("attention", cfg.attention) == "kvax" and "kvax_backend" not in raw:
    check_backend(cfg)
  check_raw_overrides(cfg, raw, platform)
  check_model(cfg)
  keys = maxtext_keys(cfg, platform)
  replaced = {k: (keys[k], v) for k, v in raw.items() if k in keys and argv_value(keys[k]) != v}
  keys.update(raw)
  argv = maxtext_argv(keys)
  out = output_dir(cfg) if "base_output_directory" not in raw and "run_name" not in raw else None
  if replaced:
    print("raw MaxText overrides replace config-derived keys: " + ", ".join(
        f"{k}={new} (config: {argv_value(old)})" for k, (old, new) in replaced.items()))

  timer.stop("launcher_checks")
  timer.start("imports_and_config")
  from kvax_plugin.integrations import maxtext as kvax_maxtext
  from kvax_plugin.integrations.maxtext import settings as kvax_settings
  kvax_maxtext.install()
  check_raw_keys(raw, kvax_settings.kvax_config_class())
  from maxtext.trainers.pre_train import train as mt_train

  out = out or os.path.join(keys["base_output_directory"], keys["run_name"])
  os.makedirs(out, exist_ok=True)
  log_path = os.path.join(out, "maxtext.log")
  holder: dict[str, Any] = {}
  with quiet_maxtext(log_path, cfg.quiet):
    # MaxText's own initialisation: its config (our keys + raw overrides), validated by it.
    try:
      config, recorder = mt_train.initialize(argv)
    except (ValueError, TypeError, KeyError, AssertionError) as e:
      # pydantic's ValidationError is a ValueError. The keys were checked above, so this is a
      # rule across keys that MaxText enforces; say it in one line, naming the raw keys given.
      given = " ".join(f"{k}={v}" for k, v in raw.items()) or "none"
      raise FlagError(f"MaxText rejected the configuration: {_one_line(e)} (raw keys: {given})"
                      ) from e
    timer.stop("imports_and_config")
    check_maxtext_config(config, cfg, raw)
    attention, backend = what_maxtext_runs(config, cfg, raw, platform)
    banner = (f"kvax_plugin.launch: {cfg.family}:{cfg.variant} ({cfg.model}) attention={attention}"
              + (f" kvax backend={backend}" if backend else "") + f" on {platform}; output {out}")
    if dry_run:
      print(banner, file=sys.stderr, flush=True)
      print("\n".join(argv[1:]))
      return None
    print(banner, flush=True)
    can_draw = importlib.util.find_spec("matplotlib") is not None
    if not can_draw:
      # A bare GPU image may lack it (kvax-plugin's own install requires it): train anyway,
      # and say now, not after the run, that there will be no pictures.
      print("warning: matplotlib is not installed, so no mask.png / loss.png will be drawn "
            "(pip install matplotlib)", file=sys.stderr, flush=True)
    if importlib.util.find_spec("tensorboardX") is None:
      # MaxText's summary writer is tensorboardX; without it MaxText silently writes nothing.
      print("warning: tensorboardX is not installed, so MaxText writes no TensorBoard logs "
            "(pip install tensorboardX)", file=sys.stderr, flush=True)
    progress = Progress(cfg, holder, total_steps=config.steps, block_skipping=attention == "kvax")
    print(f"model: {config.num_query_heads} query / {config.num_kv_heads} kv heads, head dim "
          f"{config.head_dim}, {config.num_decoder_layers} layers, emb {config.emb_dim}"
          + (f", window {config.sliding_window_size}" if config.sliding_window_size else "")
          + (f", soft cap {config.attn_logits_soft_cap}" if config.attn_logits_soft_cap else "")
          + (", sinks" if getattr(config, "attention_sink", False) else "")
          + (", MLA" if str(config.attention_type) in ("mla", "AttentionType.MLA") else "")
          + f"; batch {config.global_batch_size_to_train_on} x {config.max_target_length}; "
          "compiling ...", flush=True)
    # An explicit raw dataset_type is the user choosing MaxText's own pipeline: honour it (and
    # say so) instead of replacing it with the corpus.
    data = (contextlib.nullcontext() if "dataset_type" in raw
            else packed_corpus_pipeline(cfg, holder))
    if "dataset_type" in raw:
      print(f"data: MaxText dataset_type={raw['dataset_type']} (the shipped corpus is not used; "
            "no mask statistics)", flush=True)
    from kvax_plugin.integrations.maxtext import distributed
    with data, progress_hook(progress), timer.maxtext_hooks(), \
        distributed.barrier_before_first_batch():  # several processes: see there
      mt_train.record_goodput(recorder, mt_train.RECORD_JOB_START_TIME)
      train_func = mt_train.get_train_func(config, recorder, argv)
      with mt_train.maybe_monitor_goodput(config):
        train_func()
  t_end = time.time()
  corpus = holder.get("corpus")
  if not progress.records:
    raise RuntimeError(f"MaxText ran no training step (steps={config.steps}); see {log_path}")
  step_seconds = sum(r.step_seconds for r in progress.records)
  files = {
      "loss_png": run_report.plot_losses(progress.records, os.path.join(out, "loss.png"),
                              f"{cfg.family}:{cfg.variant} ({cfg.model}), attention="
                              f"{attention}, packed corpus") if can_draw else None,
      "mask_png": (run_report.draw_first_mask(corpus, out) if corpus is not None and can_draw
                   else []),
      "tensorboard_dir": config.tensorboard_dir,
      "tensorboard_files": run_report.tensorboard_files(config),
      "maxtext_log": log_path,
      "summary_json": os.path.join(out, "summary.json"),
  }
  t_reported = time.time()
  breakdown = timer.breakdown(t0, t_end)
  # setup_and_compile: run() up to the first step (setup_timing's docstring says what it holds
  # and why it no longer is total minus the step clocks). Outside it: the process before run()
  # (interpreter, jax and kvax_plugin imports; the same for every attention), the steps, and
  # the pictures drawn after training ("reporting").
  first = progress.records[0]
  wall = {"total": t_end - t0, "training": step_seconds,
          "setup_and_compile": breakdown["setup_and_compile"],
          "first_step": first.step_seconds,
          "first_step_result": (first.received - timer.first_step_start
                                if timer.first_step_start else None),
          "run_less_step_clocks": max(0.0, (t_end - t0) - step_seconds),
          "before_run": _process_age(t0), "reporting": t_reported - t_end}
  summary = run_report.summarize(cfg, config, progress, corpus, attention, backend, wall, files,
                                 compile_breakdown=breakdown)
  with open(files["summary_json"], "w") as f:
    json.dump(summary, f, indent=2)
  run_report.print_summary(summary)
  bad = [r.step for r in progress.records if not math.isfinite(r.loss)]
  if bad:
    raise RuntimeError(f"non-finite loss at steps {bad[:5]}")
  return summary


def _process_age(at: float) -> float | None:
  """Seconds from this process's start to time.time() `at` (Linux /proc; None elsewhere)."""
  try:
    with open("/proc/self/stat") as f:
      start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None
  age_now = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
  return max(0.0, age_now - (time.time() - at))


def start_processes(cfg, raw: dict[str, str]) -> None:
  """With --num_processes > 1: join the other processes (before anything uses a device), and
  send this process's files to <output dir>/process_<i> when i > 0 (processes sharing a disk
  would overwrite each other's maxtext.log, metrics and summary)."""
  n, i, address = _NUM_PROCESSES.value, _PROCESS_ID.value, _COORDINATOR.value
  if n == 1 and i == 0 and address is None:
    return
  if address is None:
    raise FlagError(f"--num_processes={n} --process_id={i}: a run over several processes also "
                    "needs --coordinator_address=host:port (where process 0 listens)")
  if n < 2:
    raise FlagError(f"--num_processes={n}: --coordinator_address / --process_id are for a run "
                    "over several processes (num_processes >= 2)")
  from kvax_plugin.integrations.maxtext import distributed
  try:
    distributed.initialize(address, n, i)
  except ValueError as e:
    raise FlagError(f"--{e}") from e
  except RuntimeError as e:  # e.g. the coordinator unreachable, or process ids that clash
    raise SetupError(f"--coordinator_address={address} --process_id={i}: joining the other "
                     f"{n - 1} process(es) failed: {_one_line(e)}") from e
  if i > 0 and "base_output_directory" not in raw and "run_name" not in raw:
    cfg.output_dir = os.path.join(output_dir(cfg), f"process_{i}")


def _main(argv: Sequence[str]) -> None:
  raw = parse_raw_overrides(argv[1:])
  start_processes(_CONFIG.value, raw)
  run(_CONFIG.value, raw, dry_run=_DRY_RUN.value)


def _parse_flags(argv: Sequence[str]) -> list[str]:
  # Errors while loading the config file or applying --config.<field> overrides name the flag
  # instead of ending in a traceback from ml_collections.
  check_config_path(argv)
  try:
    return flags.FLAGS(list(argv))
  except flags.Error as e:
    text = str(e).strip()
    if "Traceback" in text:
      # config_flags wraps the config file's exception with its traceback; its last line is
      # what the config file said (e.g. the unknown variant and the valid ones).
      text = text.splitlines()[-1].split(": ", 1)[-1]
    raise FlagError(text) from e
  except (AttributeError, KeyError) as e:
    field = next((a for a in argv if a.startswith("--config.")), None)
    if field is None:  # no field override: the config file itself is at fault
      raise FlagError(f"--config={_config_arg(argv)}: loading it failed ({type(e).__name__}: "
                      f"{e})") from e
    raise FlagError(f"{field.split('=')[0]}: no such config field ({e}); see the config file's "
                    "fields with --dry_run, or pass a raw MaxText key as key=value") from e
  except Exception as e:  # noqa: BLE001 - an error raised by the config file's own code
    raise FlagError(f"--config={_config_arg(argv)}: loading it failed ({type(e).__name__}: "
                    f"{_one_line(e)})") from e


def _config_arg(argv: Sequence[str]) -> str:
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
  return "?"


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv if argv is None else argv)
  try:
    app.run(_main, argv=argv, flags_parser=_parse_flags)
  except SystemExit as e:
    return int(e.code or 0)
  except (FlagError, kvax_plugin.BackendUnavailableError) as e:
    print(f"kvax_plugin.launch: error: {e}", file=sys.stderr)
    return 2
  except SetupError as e:
    print(f"kvax_plugin.launch: error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
