"""The kernel backends of the attention op, registered in one place.

A backend is a single-device function over validated inputs

    fn(query, key, value, query_positions, query_segment_ids, kv_positions, kv_segment_ids,
       mask, *, scale, logits_soft_cap, sinks, **options) -> [B, Sq, H, Dv]

in a leaf module declaring `CAPABILITIES` and importing its optional dependencies lazily. "auto"
takes the first of `AUTO_ORDER` that runs here and supports the call; an explicit name runs or
raises `BackendUnavailableError`. Adding one: a leaf plus an entry in `KERNEL_BACKENDS`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp

from kvax_plugin.attention.kernels.capabilities import FEATURES, Capabilities
from kvax_plugin.attention.options import backend_config


class BackendUnavailableError(RuntimeError):
  """An explicitly requested backend cannot run here (never silently replaced)."""


class IncompleteInstallError(ImportError):
  """A backend module that ships with kvax-plugin cannot be imported: a broken install."""


@dataclasses.dataclass(frozen=True)
class KernelBackend:
  """One registry entry. module / function: the implementation (imported on first use).
  platforms: JAX platforms it needs (() = anywhere). device_check, mask_check, auto_check: names
  of functions in `module` returning (ok, reason) for a jax.Device, an AttentionMask, and
  (dtype, qk_head_dim, v_head_dim) ("auto" only: cases measured slower than the next backend);
  None: no check. auto_config: name of a function in `module` mapping the backend's config to
  the one "auto" runs it with. options: the keyword options it accepts ("kernel_options"
  arrives as the backend's own typed config). install_hint: what to install.
  reproducible_backward: False makes "auto" skip it under deterministic_backward=True."""

  name: str
  module: str
  function: str
  description: str
  platforms: tuple[str, ...] = ()
  device_check: str | None = None
  mask_check: str | None = None
  auto_check: str | None = None
  auto_config: str | None = None
  options: tuple[str, ...] = ()
  install_hint: str = ""
  reproducible_backward: bool = True


_PACKAGE = __name__

KERNEL_BACKENDS: dict[str, KernelBackend] = {
    "triton": KernelBackend(
        name="triton", module=f"{_PACKAGE}.triton.backend", function="flash_attention_triton",
        description="FlashAttention-2 Triton kernels through jax-triton (CUDA GPUs, sm80+)",
        platforms=("gpu",), device_check="device_supported",
        options=("kernel_options",), install_hint="install kvax-plugin[gpu]"),
    "mosaic": KernelBackend(
        name="mosaic", module=f"{_PACKAGE}.mosaic.backend", function="flash_attention_mosaic",
        description="FlashAttention-3-style Pallas Mosaic GPU kernels (Hopper: wgmma, TMA, "
                    "warp-specialised producer / consumers)",
        platforms=("gpu",), device_check="device_supported", mask_check="supports_mask",
        auto_check="auto_prefers", options=("deterministic_backward", "kernel_options")),
    "hopper": KernelBackend(
        name="hopper", module=f"{_PACKAGE}.hopper", function="flash_attention_hopper",
        description="the Mosaic GPU forward with a 5-product fused backward in CUDA C++ (Hopper; "
                    "head dims 64, 128, 256 and MLA's 192 / 128; built with nvcc on first use; "
                    "its dq summation order varies between runs)",
        platforms=("gpu",), device_check="device_supported", mask_check="supports_mask",
        auto_check="auto_prefers", auto_config="auto_config",
        options=("deterministic_backward", "kernel_options"), reproducible_backward=False,
        install_hint="install kvax-plugin[gpu] (nvcc >= 13 builds its CUDA backward)"),
    "jax": KernelBackend(
        name="jax", module=f"{_PACKAGE}.jax_blockwise", function="flash_attention_jax",
        description="blockwise online-softmax attention in plain JAX (any device)"),
    "reference": KernelBackend(
        name="reference", module=f"{_PACKAGE}.reference", function="reference_with_mask",
        description="dense float32 reference, O(S^2) memory (tests and checks)"),
}

# "hopper" where faster (hopper.auto_prefers) and deterministic_backward is not True.
AUTO_ORDER: tuple[str, ...] = ("hopper", "mosaic", "triton", "jax")

BACKENDS: tuple[str, ...] = ("auto",) + tuple(KERNEL_BACKENDS)

AUTO_DESCRIPTION = ('"auto" takes the fastest backend that runs the call here: "hopper" or '
                    '"mosaic" on a Hopper GPU (whichever is measured faster for the call), '
                    '"triton" on other CUDA GPUs, "jax" elsewhere')


def _record(name: str) -> KernelBackend:
  if name not in KERNEL_BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
  return KERNEL_BACKENDS[name]


def _module(record: KernelBackend):
  """The backend's module; an import failure here is a broken install (IncompleteInstallError)."""
  try:
    return importlib.import_module(record.module)
  except ImportError as e:
    if (e.name or "").split(".")[0] == "kvax_plugin" or not e.name:
      raise IncompleteInstallError(
          f"kvax-plugin is installed incompletely: the {record.name} backend's module "
          f"{record.module} does not import ({type(e).__name__}: {e}). Reinstall the package "
          "(pip install --force-reinstall kvax-plugin) or report it.") from e
    raise


def capabilities(name: str) -> Capabilities:
  """The CAPABILITIES backend `name` declares (without its optional deps)."""
  return _module(_record(name)).CAPABILITIES


def availability(name: str) -> tuple[bool, str]:
  """(available, reason): whether backend `name` can run in this process."""
  record = _record(name)
  # Imported first: a missing module raises IncompleteInstallError, not "unavailable".
  try:
    module = _module(record)
  except IncompleteInstallError:
    raise
  except ImportError as e:
    return False, (f"the {name} backend could not be imported ({e})"
                   + (f"; {record.install_hint}" if record.install_hint else ""))
  if not record.platforms:
    return True, f"{name} runs on every JAX platform"
  try:
    devices = [d for d in jax.devices() if d.platform in record.platforms]
  except RuntimeError:
    devices = []
  if not devices:
    return False, (f"no {'/'.join(p.upper() for p in record.platforms)} visible to JAX (default "
                   f"backend: {jax.default_backend()})")
  if record.device_check is None:
    return True, f"{devices[0]}"
  return getattr(module, record.device_check)(devices[0])


def resolve_backend(backend: str) -> str:
  """Map "auto" to the first backend of AUTO_ORDER that runs here; check an explicit request
  can run (BackendUnavailableError naming why, never a substitute)."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    for name in AUTO_ORDER:
      if availability(name)[0]:
        return name
    raise BackendUnavailableError(f"no backend of {AUTO_ORDER} can run here")
  ok, reason = availability(backend)
  if not ok:
    others = [n for n in AUTO_ORDER if n != backend and not KERNEL_BACKENDS[n].platforms]
    raise BackendUnavailableError(
        f'backend="{backend}" was requested but cannot run: {reason}. Use backend='
        f'"{others[0] if others else "auto"}" (or "auto") to run without it.')
  return backend


def supports_inputs(name: str, dtype: Any, qk_head_dim: int, v_head_dim: int,
                    features: Iterable[str] = (), mask: Any = None) -> tuple[bool, str]:
  ok, why = capabilities(name).supports(dtype, qk_head_dim, v_head_dim, features)
  if not ok:
    return False, f"{why} by the {name} backend"
  record = _record(name)
  if mask is not None and record.mask_check is not None:
    ok, why = getattr(_module(record), record.mask_check)(mask)
  return ok, why


def auto_prefers(name: str, dtype: Any, qk_head_dim: int, v_head_dim: int,
                 features: Iterable[str] = ()) -> tuple[bool, str]:
  """(preferred, reason) from backend `name`'s auto_check (preferred without one)."""
  record = _record(name)
  if record.auto_check is None:
    return True, ""
  return getattr(_module(record), record.auto_check)(dtype, qk_head_dim, v_head_dim,
                                                      tuple(features))


def auto_choice(dtype: Any, qk_head_dim: int, v_head_dim: int, features: Iterable[str] = (),
                mask: Any = None, deterministic_backward: bool | None = None
                ) -> tuple[str | None, dict[str, str]]:
  """(the backend "auto" takes, or None; {backend passed over before it: why})."""
  features = tuple(features)
  passed_over: dict[str, str] = {}
  for name in AUTO_ORDER:
    if deterministic_backward and not KERNEL_BACKENDS[name].reproducible_backward:
      passed_over[name] = "its backward is not bitwise reproducible (deterministic_backward)"
      continue
    ok, why = availability(name)
    if ok:
      ok, why = supports_inputs(name, dtype, qk_head_dim, v_head_dim, features, mask)
    if ok:
      ok, why = auto_prefers(name, dtype, qk_head_dim, v_head_dim, features)
      why = why or "measured slower here than the next backend"
    if ok:
      return name, passed_over
    passed_over[name] = why
  return None, passed_over


def resolve_backend_for(backend: str, dtype: Any, qk_head_dim: int, v_head_dim: int,
                        features: Iterable[str] = (), mask: Any = None,
                        deterministic_backward: bool | None = None) -> str:
  """The backend for one call. "auto": the first of AUTO_ORDER that runs here, supports the
  inputs and `mask`, passes auto_check and, under deterministic_backward=True, has a reproducible
  backward. An explicit name that cannot run them raises BackendUnavailableError."""
  features = tuple(features)
  if backend == "auto":
    name, _ = auto_choice(dtype, qk_head_dim, v_head_dim, features, mask, deterministic_backward)
    if name is not None:
      return name
    raise BackendUnavailableError(
        f"no backend of {AUTO_ORDER} can run {jnp.dtype(dtype).name} inputs with head dims "
        f"({qk_head_dim}, {v_head_dim}) and features {features} here")
  name = resolve_backend(backend)
  ok, why = supports_inputs(name, dtype, qk_head_dim, v_head_dim, features, mask)
  if not ok:
    raise BackendUnavailableError(
        f'backend="{name}" was requested but cannot run: {why} (change the inputs, or use '
        'backend="auto" / "jax")')
  why = refuses_options(name, deterministic_backward)
  if why:
    raise BackendUnavailableError(
        f'backend="{name}" was requested but cannot run: {why} (use backend="auto", which '
        'takes a reproducible backward for deterministic_backward=True, or leave it None)')
  return name


def refuses_options(name: str, deterministic_backward: bool | None = None) -> str:
  """Why backend `name` refuses these options ("" when it does not)."""
  if deterministic_backward and not _record(name).reproducible_backward:
    return ("deterministic_backward=True, but its backward is not bitwise reproducible (dq is "
            "summed in no fixed order)")
  return ""


def auto_kernel_options(name: str, kernel_options: Any = None) -> Any:
  """kernel_options as "auto" runs backend `name` (its auto_config applied to its config)."""
  record = _record(name)
  if record.auto_config is None:
    return kernel_options
  return getattr(_module(record), record.auto_config)(backend_config(kernel_options, name))


def backend_function(name: str) -> Callable[..., jax.Array]:
  record = _record(name)
  return getattr(_module(record), record.function)


def backend_options(name: str, *, kernel_options: Any = None,
                    memory_optimized_gqa_backward: bool = False, **options: Any) -> dict[str, Any]:
  """The subset of `options` backend `name` accepts, kernel_options turned into its own config
  (memory_optimized_gqa_backward is a Triton field)."""
  accepted = _record(name).options
  out = {k: v for k, v in options.items() if k in accepted}
  if "kernel_options" in accepted:
    out["kernel_options"] = backend_config(
        kernel_options, name, memory_optimized_gqa_backward=memory_optimized_gqa_backward)
  return out


__all__ = ["BackendUnavailableError", "IncompleteInstallError", "Capabilities", "KernelBackend", "KERNEL_BACKENDS",
           "AUTO_ORDER", "AUTO_DESCRIPTION", "BACKENDS", "FEATURES", "capabilities", "availability", "resolve_backend",
           "auto_prefers", "auto_choice",
           "supports_inputs", "resolve_backend_for", "backend_function", "backend_options",
           "auto_kernel_options"]
