"""Runs scripts/ffi_probe/libkvax_probe.so's kernel through jax.ffi on a GPU: registers the FFI
target, calls it under jit on 1000 floats and checks x + 1. Prints the device and the result."""

import ctypes
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

lib = ctypes.cdll.LoadLibrary(str(Path(__file__).with_name("libkvax_probe.so")))
jax.ffi.register_ffi_target("kvax_probe_add_one", jax.ffi.pycapsule(lib.KvaxProbeAddOne),
                            platform="CUDA")


@jax.jit
def add_one(x):
  return jax.ffi.ffi_call("kvax_probe_add_one", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


x = jnp.arange(1000, dtype=jnp.float32)
y = np.asarray(add_one(x))
ok = bool(np.array_equal(y, np.arange(1000, dtype=np.float32) + 1))
print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}: "
      f"x + 1 {'ok' if ok else 'WRONG'}")
sys.exit(0 if ok else 1)
