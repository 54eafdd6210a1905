"""Version shim between our kernels and jax-triton / Triton: jax-triton 0.3.x pairs with triton
3.6 (`out_shape`), 0.4.x with >= 3.7 (`out_type`); `check()` refuses a mixed pair up front.
`TRITON_INTERPRET=1` runs the kernels in Triton's interpreter (CPU tests; no jax-triton).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Sequence

import jax
import numpy as np

_INSTALL_HINT = ("install a matching pair, e.g. `pip install 'kvax-plugin[gpu]'` (triton==3.6.0 "
                 "with jax-triton==0.3.1), or triton>=3.7 with jax-triton>=0.4")


def interpret_mode() -> bool:
  return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _major_minor(version: str) -> tuple[int, int]:
  parts = []
  for piece in version.split(".")[:2]:
    digits = "".join(ch for ch in piece if ch.isdigit())
    parts.append(int(digits or 0))
  return tuple(parts + [0] * (2 - len(parts)))  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def check() -> str:
  """Import Triton (and jax-triton unless interpreting); return the out-shape keyword. Raises
  ImportError naming the versions found and what to install."""
  try:
    import triton
  except Exception as e:  # noqa: BLE001 - any failure means the backend cannot run
    raise ImportError(f"Triton is not importable ({e!r}); {_INSTALL_HINT}") from e
  if interpret_mode():
    return "out_shape"
  try:
    import jax_triton
  except Exception as e:  # noqa: BLE001
    raise ImportError(f"jax-triton is not importable ({e!r}); {_INSTALL_HINT}") from e
  tv = _major_minor(triton.__version__)
  jtv_str = getattr(jax_triton, "__version__", None)
  if jtv_str is None:
    try:
      from jax_triton import version as _v
      jtv_str = _v.__version__
    except Exception:  # noqa: BLE001
      jtv_str = "unknown"
  params = inspect.signature(jax_triton.triton_call).parameters
  if "out_type" in params:
    keyword = "out_type"
    if tv < (3, 7):
      raise ImportError(f"jax-triton {jtv_str} (triton_call(out_type=...), the 0.4 line) needs "
                        f"triton >= 3.7 but triton {triton.__version__} is installed; "
                        f"{_INSTALL_HINT}")
  elif "out_shape" in params:
    keyword = "out_shape"
    if tv >= (3, 7):
      raise ImportError(f"jax-triton {jtv_str} (triton_call(out_shape=...), the 0.3 line) was "
                        f"built for triton 3.6 but triton {triton.__version__} is installed; "
                        f"{_INSTALL_HINT}")
  else:
    raise ImportError(f"jax-triton {jtv_str}: triton_call takes neither out_shape nor out_type; "
                      f"{_INSTALL_HINT}")
  return keyword


def triton_call(*args: jax.Array, kernel: Any, out_shape: Sequence[jax.ShapeDtypeStruct],
                grid: tuple[int, ...], num_warps: int, num_stages: int,
                **constexprs: Any) -> tuple[jax.Array, ...]:
  """Launch `kernel[grid](*args, *outputs, **constexprs)` and return the outputs."""
  keyword = check()
  out_shape = list(out_shape)
  if interpret_mode():
    return _interpret_call(args, kernel, out_shape, grid, constexprs)
  import jax_triton
  kwargs = {keyword: out_shape}
  outs = jax_triton.triton_call(*args, kernel=kernel, grid=grid, num_warps=num_warps,
                                num_stages=num_stages, **kwargs, **constexprs)
  return tuple(outs) if isinstance(outs, (list, tuple)) else (outs,)


class _Storage:
  def __init__(self, tensor):
    self.tensor = tensor

  def data_ptr(self):
    return self.tensor.array.ctypes.data

  def cpu(self):
    return self

  def copy_(self, other):
    del other


class _NumpyTensor:
  """The little of torch.Tensor's interface that Triton's interpreter touches."""

  def __init__(self, array: np.ndarray):
    self.array = array
    self.dtype = array.dtype

  def data_ptr(self):
    return self.array.ctypes.data

  def untyped_storage(self):
    return _Storage(self)

  def new_empty(self, *unused_args, **unused_kwargs):
    return _NumpyTensor(self.array)

  def set_(self, storage, *unused_args):
    self.array = storage.tensor.array
    return self

  def storage_offset(self):
    return 0

  def size(self):
    return self.array.shape

  def stride(self):
    return tuple(s // self.array.itemsize for s in self.array.strides)

  def copy_(self, other):
    del other


@functools.lru_cache(maxsize=None)
def _patch_interpreter_for_numpy2() -> None:
  """Triton 3.6's interpreter calls int(array) on 1-element arrays, which numpy >= 2.5 refuses."""
  from triton.runtime import interpreter

  original = interpreter._patch_lang_tensor

  def patched(tensor, scope):
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).item()))

  interpreter._patch_lang_tensor = patched


def _interpret_call(args, kernel, out_shape, grid, constexprs):
  _patch_interpreter_for_numpy2()
  def host(*arrays):
    ins = [_NumpyTensor(np.ascontiguousarray(a)) for a in arrays]
    outs = []
    for s in out_shape:
      buf = np.empty(s.shape, s.dtype)
      # Poison: an unwritten element shows up as NaN (or a huge int).
      buf.fill(np.nan if np.issubdtype(buf.dtype, np.floating) or buf.dtype.kind == "V" else
               np.iinfo(buf.dtype).max if np.issubdtype(buf.dtype, np.integer) else 0)
      outs.append(buf)
    kernel[tuple(grid)](*ins, *[_NumpyTensor(o) for o in outs], **constexprs)
    return tuple(outs)

  return tuple(jax.pure_callback(host, tuple(out_shape), *args))
