"""Train an upstream model family in MaxText with attention=kvax on packed real text.

    python -m kvax_plugin.launch --config=llama3:tiny
    python -m kvax_plugin.launch --config=llama3:8b --config.seq_len=8192 \\
        --config.kvax.backend=triton --config.mesh.ici_tensor=2  steps=200 log_period=10

`--config` names <family>:<variant> (kvax_plugin/configs/) or a config file's path:<variant>,
`--config.<field>` changes a field, trailing `key=value` arguments are raw MaxText keys;
`--dry_run` prints the keys and exits. Exit status: 0 after a finished run, 2 for a bad flag or
raw key, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags
from ml_collections import config_flags

import kvax_plugin
from kvax_plugin.errors import FlagError, SetupError
from kvax_plugin.integrations.maxtext import console, distributed, run_report
from kvax_plugin.integrations.maxtext import launch_checks as checks
from kvax_plugin.integrations.maxtext.launch_keys import (argv_value, check_maxtext_config,
                                                          maxtext_argv, maxtext_keys, output_dir,
                                                          te_packing_keys)
from kvax_plugin.integrations.maxtext.setup_timing import SetupTimer
from kvax_plugin.integrations.maxtext.training_hooks import (Progress, packed_corpus_pipeline,
                                                             progress_hook)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "<family>:<variant> (e.g. llama3:tiny) or <config file>:<variant>",
    lock_config=True)
_DRY_RUN = flags.DEFINE_bool("dry_run", False,
                             "check the config, print the MaxText keys it becomes, and exit")
# Several processes (integrations/maxtext/distributed.py): MaxText starts jax.distributed only
# from its schedulers' environment variables, so these flags do it.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0, for a run over several processes")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "processes of the run (one per host), "
                                      "joined by jax.distributed")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "this process: 0 .. num_processes-1")


def run(cfg, raw: dict[str, str], *, dry_run: bool = False) -> dict[str, Any] | None:
  """Check, translate and train; returns the summary (None for a dry run)."""
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
                    "family config (kvax_plugin/configs/<family>.py builds one with "
                    "kvax_plugin.configs.common.family_config)")
  checks.check_config(cfg)

  with console.Console(cfg.quiet) as con:
    platform = checks.detect_platform() if cfg.hardware == "auto" else cfg.hardware
    checks.check_attention(cfg.attention, platform, f"--config.attention={cfg.attention}")
    if raw.get("attention", cfg.attention) == "kvax" and "kvax_backend" not in raw:
      checks.check_backend(cfg)
    checks.check_raw_overrides(cfg, raw, platform)
    checks.check_model(cfg)
    keys = maxtext_keys(cfg, platform)
    replaced = {k: (keys[k], v) for k, v in raw.items()
                if k in keys and argv_value(keys[k]) != v}
    keys.update(raw)
    keys.update(te_packing_keys(cfg, keys, raw))
    argv = maxtext_argv(keys)
    if replaced:
      print("raw MaxText overrides replace config-derived keys: " + ", ".join(
          f"{k}={new} (config: {argv_value(old)})" for k, (old, new) in replaced.items()),
            file=con.out)

    timer.stop("launcher_checks")
    timer.start("imports_and_config")
    from kvax_plugin.integrations import maxtext as kvax_maxtext
    from kvax_plugin.integrations.maxtext import settings as kvax_settings
    kvax_maxtext.install()
    checks.check_raw_keys(raw, kvax_settings.kvax_config_class())
    from maxtext.trainers.pre_train import train as mt_train

    out = (output_dir(cfg) if "base_output_directory" not in raw and "run_name" not in raw
           else os.path.join(keys["base_output_directory"], keys["run_name"]))
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "maxtext.log")
    con.open_log(log_path)
    holder: dict[str, Any] = {}
    try:
      config, recorder = mt_train.initialize(argv)
    except (ValueError, TypeError, KeyError, AssertionError) as e:
      # A rule across keys that MaxText enforces (pydantic's ValidationError is a ValueError).
      given = " ".join(f"{k}={v}" for k, v in raw.items()) or "none"
      raise FlagError(f"MaxText rejected the configuration: {checks.one_line(e)} "
                      f"(raw keys: {given})") from e
    timer.stop("imports_and_config")
    check_maxtext_config(config, cfg, raw)
    attention, backend = checks.what_maxtext_runs(config, cfg, raw, platform)
    banner = (f"kvax_plugin.launch: {cfg.family}:{cfg.variant} ({cfg.model}) attention={attention}"
              + (f" kvax backend={backend}" if backend else "") + f" on {platform}; output {out}")
    if dry_run:
      print(banner, file=con.err, flush=True)
      print("\n".join(argv[1:]), file=con.out, flush=True)
      return None
    print(banner, file=con.out, flush=True)
    can_draw = importlib.util.find_spec("matplotlib") is not None
    if not can_draw:
      # Train anyway, and say now that there will be no pictures.
      print("warning: matplotlib is not installed, so no mask.png / loss.png will be drawn "
            "(pip install matplotlib)", file=con.err, flush=True)
    if importlib.util.find_spec("tensorboardX") is None:
      # Without tensorboardX MaxText silently writes nothing.
      print("warning: tensorboardX is not installed, so MaxText writes no TensorBoard logs "
            "(pip install tensorboardX)", file=con.err, flush=True)
    progress = Progress(cfg, holder, total_steps=config.steps, stream=con.out,
                        block_skipping=attention == "kvax")
    print(f"model: {config.num_query_heads} query / {config.num_kv_heads} kv heads, head dim "
          f"{config.head_dim}, {config.num_decoder_layers} layers, emb {config.emb_dim}"
          + (f", window {config.sliding_window_size}" if config.sliding_window_size else "")
          + (f", soft cap {config.attn_logits_soft_cap}" if config.attn_logits_soft_cap else "")
          + (", sinks" if getattr(config, "attention_sink", False) else "")
          + (", MLA" if str(config.attention_type) in ("mla", "AttentionType.MLA") else "")
          + f"; batch {config.global_batch_size_to_train_on} x {config.max_target_length}; "
          "compiling ...", file=con.out, flush=True)
    # An explicit raw dataset_type chooses MaxText's own pipeline.
    data = (contextlib.nullcontext() if "dataset_type" in raw
            else packed_corpus_pipeline(cfg, holder))
    if "dataset_type" in raw:
      print(f"data: MaxText dataset_type={raw['dataset_type']} (the shipped corpus is not used; "
            "no mask statistics)", file=con.out, flush=True)
    with data, progress_hook(progress), timer.maxtext_hooks(), \
        distributed.barrier_before_first_batch():
      mt_train.record_goodput(recorder, mt_train.RECORD_JOB_START_TIME)
      train_func = mt_train.get_train_func(config, recorder, argv)
      with mt_train.maybe_monitor_goodput(config):
        train_func()
    t_end = time.time()
    if not progress.records:
      raise RuntimeError(f"MaxText ran no training step (steps={config.steps}); see {log_path}")
    # Inside the console: the pictures' libraries print notices of their own.
    summary = run_report.write_report(
        cfg, config, progress, holder.get("corpus"), attention, backend, out=out,
        log_path=log_path, can_draw=can_draw, timer=timer, t0=t0, t_end=t_end, stream=con.out)
  bad = [r.step for r in progress.records if not math.isfinite(r.loss)]
  if bad:
    raise RuntimeError(f"non-finite loss at steps {bad[:5]}")
  return summary


def _main(argv: Sequence[str]) -> None:
  raw = checks.parse_raw_overrides(argv[1:])
  distributed.join_processes(_NUM_PROCESSES.value, _PROCESS_ID.value, _COORDINATOR.value,
                             _CONFIG.value, raw)
  run(_CONFIG.value, raw, dry_run=_DRY_RUN.value)


def _parse_flags(argv: Sequence[str]) -> list[str]:
  # Config errors name the flag instead of ending in an ml_collections traceback.
  argv = checks.resolve_config_argv(argv)
  checks.check_config_path(argv)
  try:
    return flags.FLAGS(list(argv))
  except flags.Error as e:
    text = str(e).strip()
    if "Traceback" in text:
      # The wrapped traceback's last line is what the config file said.
      text = text.splitlines()[-1].split(": ", 1)[-1]
    raise FlagError(text) from e
  except (AttributeError, KeyError) as e:
    field = next((a for a in argv if a.startswith("--config.")), None)
    if field is None:
      raise FlagError(f"--config={_config_arg(argv)}: loading it failed ({type(e).__name__}: "
                      f"{e})") from e
    raise FlagError(f"{field.split('=')[0]}: no such config field ({e}); see the config file's "
                    "fields with --dry_run, or pass a raw MaxText key as key=value") from e
  except Exception as e:  # noqa: BLE001
    raise FlagError(f"--config={_config_arg(argv)}: loading it failed ({type(e).__name__}: "
                    f"{checks.one_line(e)})") from e


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
  except Exception as e:
    log = getattr(e, console.log_path_attr, None)
    if log is None:
      raise
    print(f"kvax_plugin.launch: error: {type(e).__name__}: {checks.one_line(e)} "
          f"(traceback in {log})", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
