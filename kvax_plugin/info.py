"""What this installation of kvax-plugin can run, and what "auto" takes.

    python -m kvax_plugin.info                                  # versions, devices, backends
    python -m kvax_plugin.info --dtype bfloat16 --head-dim 128  # auto's choice for a call
    python -m kvax_plugin.info --head-dim 192 --v-head-dim 128 --features sliding_window --json

Exit status 1 when a shipped backend module does not import (a broken install), else 0.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys
from typing import Any

PACKAGES = {
    "jax": "jax", "jaxlib": "jaxlib", "triton": "triton", "jax_triton": "jax-triton",
    "maxtext": "maxtext", "levanter": "marin-levanter", "flax": "flax",
    "ml_collections": "ml-collections", "tokamax": "tokamax",
}


def versions() -> dict[str, str | None]:
  out: dict[str, str | None] = {"python": platform.python_version()}
  from kvax_plugin._version import __version__
  out["kvax-plugin"] = __version__
  for dist in PACKAGES.values():
    try:
      out[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      out[dist] = None
  out["nvcc"] = nvcc_version()
  return out


def nvcc_version() -> str | None:
  """The version and path of the nvcc "hopper" would build with (None: none found)."""
  import subprocess

  from kvax_plugin.attention.kernels.cuda_sm90 import build
  try:
    nvcc = build.find_nvcc()
  except OSError:
    return None
  try:
    text = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                          timeout=30).stdout
  except (OSError, subprocess.SubprocessError) as e:
    return f"{nvcc} (does not run: {e})"
  release = next((line.split("release", 1)[1].strip() for line in text.splitlines()
                  if "release" in line), "version unknown")
  return f"{release} ({nvcc})"


def devices() -> list[str]:
  import jax
  try:
    return [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]
  except RuntimeError as e:
    return [f"no devices ({e})"]


def backends() -> tuple[dict[str, dict[str, Any]], list[str]]:
  """Per backend: whether its module imports and can run here, and why; and the defects."""
  from kvax_plugin.attention import kernels
  out: dict[str, dict[str, Any]] = {}
  defects: list[str] = []
  for name, record in kernels.KERNEL_BACKENDS.items():
    entry: dict[str, Any] = {"description": record.description}
    try:
      importlib.import_module(record.module)
    except ImportError as e:
      defects.append(f"{record.module}: {type(e).__name__}: {e}")
      entry.update(imports=False, available=False, reason=f"module does not import: {e}")
      out[name] = entry
      continue
    ok, why = kernels.availability(name)
    entry.update(imports=True, available=ok, reason=why)
    out[name] = entry
  return out, defects


def _auto(dtype, qk_head_dim, v_head_dim, features, deterministic_backward) -> dict[str, Any]:
  from kvax_plugin.attention import kernels
  name, passed_over = kernels.auto_choice(dtype, qk_head_dim, v_head_dim, features,
                                          deterministic_backward=deterministic_backward)
  return {"backend": name, "passed_over": passed_over}


def report(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
  table, defects = backends()
  features = tuple(f for f in args.features.split(",") if f)
  call = {"dtype": args.dtype, "qk_head_dim": args.head_dim,
          "v_head_dim": args.v_head_dim or args.head_dim, "features": list(features),
          "deterministic_backward": args.deterministic_backward}
  auto = (_auto(args.dtype, call["qk_head_dim"], call["v_head_dim"], features,
                args.deterministic_backward) if not defects else
          {"backend": None, "passed_over": {"*": "the install is incomplete (defects)"}})
  return {"versions": versions(), "devices": devices(), "backends": table,
          "auto": {"call": call, **auto}, "defects": defects}, defects


def _print(info: dict[str, Any]) -> None:
  print("versions:")
  for k, v in info["versions"].items():
    print(f"  {k:16s} {v if v is not None else '-'}")
  print("devices:")
  for d in info["devices"]:
    print(f"  {d}")
  print("backends:")
  for name, b in info["backends"].items():
    state = "available" if b["available"] else "unavailable"
    print(f"  {name:10s} {state:12s} {b['reason']}")
  call, auto = info["auto"]["call"], info["auto"]
  print(f"auto, for {call['dtype']} head dims ({call['qk_head_dim']}, {call['v_head_dim']})"
        + (f" with {', '.join(call['features'])}" if call["features"] else "")
        + (" and deterministic_backward" if call["deterministic_backward"] else "")
        + f": {auto['backend'] or 'none'}")
  for name, why in auto["passed_over"].items():
    print(f"  passed over {name}: {why}")
  for d in info["defects"]:
    print(f"DEFECT: a module shipped with kvax-plugin does not import: {d}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
  from kvax_plugin.attention.kernels.capabilities import FEATURES
  ap = argparse.ArgumentParser(prog="python -m kvax_plugin.info", description=__doc__.split(
      "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  ap.add_argument("--head-dim", type=int, default=128, help="query / key head dim")
  ap.add_argument("--v-head-dim", type=int, default=None, help="value head dim (default: "
                  "--head-dim)")
  ap.add_argument("--features", default="", help=f"comma-separated, of {', '.join(FEATURES)}")
  ap.add_argument("--deterministic-backward", action="store_true", default=None)
  ap.add_argument("--json", action="store_true", help="print one JSON object")
  args = ap.parse_args(argv)
  unknown = [f for f in args.features.split(",") if f and f not in FEATURES]
  if unknown:
    ap.error(f"--features: {', '.join(unknown)} not among {', '.join(FEATURES)}")
  info, defects = report(args)
  if args.json:
    print(json.dumps(info, indent=1))
  else:
    _print(info)
  return 1 if defects else 0


if __name__ == "__main__":
  sys.exit(main())
