"""Session setup that has to happen before anything imports jax.

tests/test_sharding.py needs 8 devices; on CPU, XLA simulates them only if this flag is set before
the CPU backend starts. Other tests keep using the default (first) device, so they are unaffected.
"""

import os

_CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CPU_DEVICES_FLAG}".strip()
