"""Test-run setup that has to happen before anything imports jax.

tests/test_sharding.py needs 8 devices; on CPU, XLA simulates them only if this flag is set before
the CPU backend starts. Other tests keep using the default (first) device, so they are unaffected.

XLA's CPU backend compiles at LLVM optimisation level 0 here: compilation is most of this
suite's time (small shapes, many distinct programs) and level 0 compiles them ~3x faster. Only
LLVM's code generation changes; XLA's own passes (fusion, buffer assignment: what
tests/test_memory.py reads) and the float semantics (no fast math on CPU) do not, so results are
the same. KVAX_TEST_XLA_OPT=default keeps XLA's default level (e.g. to time the kernels).
"""

import os

_CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
_FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def _add_xla_flag(flag: str) -> None:
  name = flag.split("=")[0]
  if name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


_add_xla_flag(_CPU_DEVICES_FLAG)
if os.environ.get("KVAX_TEST_XLA_OPT", "fast") != "default":
  _add_xla_flag(_FAST_COMPILE_FLAG)
