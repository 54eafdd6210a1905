"""The op on a mesh spanning two processes (jax.distributed, 2 x 4 simulated CPU devices).

The workers (multiprocess_op_worker.py) join through a local coordinator with gloo collectives,
build a (data 2, context 4) mesh whose every context group holds devices of both processes, and
run create_attention_mask(mesh=) + flash_attention forward and backward on global arrays; the
result must equal the single-device op on the same batch. MaxText trained the same way:
integration/test_maxtext_multiprocess.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PROCESSES, DEVICES_PER_PROCESS = 2, 4
TOL = 1e-5  # max |diff| / max |reference| per tensor; float32 summation order differs


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(script: str, args: list[str], timeout: float = 600) -> list[dict]:
  """Start PROCESSES workers (argv: PROCESS_ID NUM_PROCESSES COORDINATOR *args) on this
  machine, each with DEVICES_PER_PROCESS CPU devices; their KVAX_RESULT lines."""
  # This suite's conftest asks for 8 devices; a worker gets its own count.
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                 os.environ.get("XLA_FLAGS", ""))
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"}
  coordinator = f"127.0.0.1:{_free_port()}"
  with tempfile.TemporaryDirectory() as logs:
    paths = [(os.path.join(logs, f"{i}.out"), os.path.join(logs, f"{i}.err"))
             for i in range(PROCESSES)]
    procs = []
    for i, (out, err) in enumerate(paths):
      with open(out, "w") as o, open(err, "w") as e:
        procs.append(subprocess.Popen([sys.executable, script, str(i), str(PROCESSES),
                                       coordinator, *args], stdout=o, stderr=e, env=env))
    deadline = time.monotonic() + timeout
    try:
      # Poll all: when one fails, the others would wait for it until jax.distributed gives up.
      while (any(p.poll() is None for p in procs) and time.monotonic() < deadline
             and not any(p.poll() not in (None, 0) for p in procs)):
        time.sleep(0.2)
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    outputs = [(p.returncode, open(out).read(), open(err).read())
               for p, (out, err) in zip(procs, paths)]
  # The process that failed by itself first (the others were killed: negative rc).
  for i, (rc, out, err) in sorted(enumerate(outputs), key=lambda x: x[1][0] < 0):
    assert rc == 0 and "KVAX_RESULT " in out, (
        f"process {i} of {PROCESSES} failed, rc={rc} (negative: killed after another failed or "
        f"after {timeout:.0f} s):\n{out[-3000:]}\n{err[-6000:]}")
  return [json.loads([l for l in out.splitlines() if l.startswith("KVAX_RESULT ")][-1][12:])
          for _, out, _ in outputs]


def test_op_on_a_mesh_over_two_processes():
  results = run_processes(os.path.join(HERE, "multiprocess_op_worker.py"), [])
  for i, r in enumerate(results):
    assert (r["process_id"], r["process_count"], r["devices"]) == (i, PROCESSES, 8), r
    assert r["mesh"] == {"data": 2, "context": 4} and r["context_crosses"], r
  assert results[0] == {**results[1], "process_id": 0}, "the processes saw different results"
  for case in ("balanced_jit", "llama3_eager"):
    diffs = results[0][case]
    assert all(d <= TOL for d in diffs.values()), f"{case}: {diffs}"


def test_launcher_process_flags_are_checked():
  """The launcher's --num_processes / --process_id / --coordinator_address fail naming the flag,
  before anything waits for other processes."""
  root = os.path.dirname(HERE)
  cases = [(["--num_processes=2"], "also needs --coordinator_address=host:port"),
           (["--num_processes=2", "--process_id=2", "--coordinator_address=localhost:1"],
            "--process_id=2: must be in 0..1"),
           (["--process_id=1", "--coordinator_address=localhost:1"],
            "--num_processes=1: --coordinator_address / --process_id are for a run")]
  for flags, message in cases:
    r = subprocess.run([sys.executable, "-m", "kvax_plugin.launch",
                        "--config=configs/llama3.py:tiny", *flags], cwd=root, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and message in r.stderr, (flags, r.returncode, r.stderr[-2000:])
