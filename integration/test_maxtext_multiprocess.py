"""MaxText training over two processes (jax.distributed) equals the same run in one process.

The way MaxText runs multi-host: one process per host, joined by jax.distributed into one global
mesh, each feeding its share of every batch. Here two processes of 4 simulated CPU devices each
(a local coordinator on a free port, gloo collectives; kvax_plugin.integrations.maxtext.
distributed.initialize, which `python -m kvax_plugin.launch --num_processes=...` uses) train a
shrunken llama3 with attention=kvax, context 4 x fsdp 2, on MaxText's synthetic packed rows
(several documents per row), context_parallel_load_balance on (the balanced order). MaxText lays
the mesh out in process order with its later axes innermost; mesh_axes here puts context before
fsdp, so every context group holds two devices of each process: the kvax op's all-gathers,
kv-gradient sums and mask construction, and the balanced reorder of each batch, cross the
process boundary (with MaxText's own order, fsdp outermost, the groups lie inside a process and
fsdp crosses instead: the launcher's documented run, distributed.py). A third process with all
8 devices runs the same config; the per-step losses must agree to float32 noise. A fourth trains
the same batches on one device (no mesh, no reorder): context parallelism must not change the
losses either.

The four processes run side by side, at XLA's backend optimisation level 0 (numerics unchanged,
as tests/conftest.py does; at these sizes it spends less CPU than the default level). The
worker lines the two processes up before the first batch (distributed.barrier_before_first_batch,
as the launcher does): gloo gives a late process only 30 s at a first collective, and on a busy
machine two processes compiling side by side drift further apart than that.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from maxtext_results import report

pytestmark = pytest.mark.maxtext

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3
# Relative, per step. Same program and float32 throughout; only where partial sums meet differs
# (gloo between processes vs in-process). Measured: 0 (this config), 1.3e-7 with 32-token blocks.
LOSS_RTOL = 1e-5
# MaxText's mesh_axes with context moved before fsdp (see the docstring).
MESH = dict(ici_fsdp_parallelism=2, ici_context_parallelism=4, mesh_axes=(
    "[diloco,data,stage,context,fsdp,fsdp_transpose,context_usp_ulysses,context_autoregressive,"
    "tensor,tensor_sequence,expert,autoregressive]"))


def _maxtext_argv(out: str, **overrides) -> list[str]:
  import maxtext_harness as H
  keys = dict(model_name="llama3-8b", override_model_config="true", hardware="cpu",
              # The worker (or one process alone) has set jax.distributed up already.
              skip_jax_distributed_system="true", **H.SHRINK["llama3-8b"], vocab_size=512,
              # 8 query / 2 kv heads (llama3's 4:1 GQA, head dim 128) and 64-token kvax blocks
              # (a quarter of the block loop of 32): a step costs ~5x less CPU than with the
              # 32 / 8 heads of the 8b yml, and this test's time is mostly steps and compiling.
              base_num_query_heads=8, base_num_kv_heads=2,
              max_target_length=256, per_device_batch_size=0.25, attention="kvax",
              dtype="float32", weight_dtype="float32", matmul_precision="highest",
              dataset_type="synthetic", packing="true", max_segments_per_seq=6, steps=STEPS,
              enable_checkpointing="false", enable_tensorboard="false",
              base_output_directory=out, run_name="kvax_multiprocess", log_config="false",
              learning_rate=1e-3, kvax_backend=H.COMMON["kvax_backend"],
              kvax_fwd_query_block_size=64, kvax_fwd_kv_block_size=64,
              kvax_bwd_query_block_size=64, kvax_bwd_kv_block_size=64,
              jax_cache_dir=H.COMMON["jax_cache_dir"], **MESH)
  keys.update(overrides)
  return [os.path.join(H.maxtext_dir(), "configs", "base.yml")] + [f"{k}={v}"
                                                                   for k, v in keys.items()]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_all(runs: list[tuple[str, int, int, int, dict]], out: str,
             timeout: float = 900) -> dict:
  """runs: (name, process id, process count, devices, MaxText key overrides) -> {name:
  KVAX_RESULT}, all started at once; the first failure stops the rest (they would wait for it
  until jax.distributed gives up) and is reported."""
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = {}
  for name, pid, count, devices, overrides in runs:
    argv = _maxtext_argv(out, **overrides)
    flags = re.sub(r"--xla_(force_host_platform_device_count|backend_optimization_level)=\S+",
                   "", os.environ.get("XLA_FLAGS", ""))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": (
        f"{flags} --xla_force_host_platform_device_count={devices}"
        " --xla_backend_optimization_level=0").strip()}
    with open(f"{out}/{name}.out", "w") as o, open(f"{out}/{name}.err", "w") as e:
      procs[name] = subprocess.Popen(
          [sys.executable, os.path.join(HERE, "maxtext_multiprocess_worker.py"), str(pid),
           str(count), coordinator, f"{out}/{name}.jsonl", *argv], stdout=o, stderr=e, env=env)
  deadline = time.monotonic() + timeout
  try:
    while (any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline
           and not any(p.poll() not in (None, 0) for p in procs.values())):
      time.sleep(0.5)
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait()
  results = {}
  # The run that failed by itself first (others were killed: negative rc).
  for name, p in sorted(procs.items(), key=lambda kv: kv[1].returncode < 0):
    text = open(f"{out}/{name}.out").read()
    lines = [l for l in text.splitlines() if l.startswith("KVAX_RESULT ")]
    assert p.returncode == 0 and lines, (
        f"{name} failed, rc={p.returncode} (negative: killed after another failed or after "
        f"{timeout:.0f} s):\n{text[-3000:]}\n{open(f'{out}/{name}.err').read()[-6000:]}")
    results[name] = json.loads(lines[-1][len("KVAX_RESULT "):])
  return results


def test_two_processes_train_like_one(tmp_path):
  t0 = time.monotonic()
  r = _run_all([("process0", 0, 2, 4, {}), ("process1", 1, 2, 4, {}),
                ("one_process", 0, 1, 8, {}),
                # The same 2 rows per step on one device: no mesh, natural order.
                ("one_device", 0, 1, 1, dict(ici_fsdp_parallelism=1, ici_context_parallelism=1,
                                             per_device_batch_size=2))],
               str(tmp_path))
  wall = time.monotonic() - t0
  p0, p1, one, single = r["process0"], r["process1"], r["one_process"], r["one_device"]
  diffs = [abs(a - b) / abs(b) for a, b in zip(p0["losses"], one["losses"])]
  single_diffs = [abs(a - b) / abs(b) for a, b in zip(single["losses"], one["losses"])]
  report(f"[maxtext multiprocess] llama3 context 4 x fsdp 2, 2 processes x 4 devices vs 1 x 8: "
         + "  ".join(f"step {i}: {a:.7f} | {b:.7f}" for i, (a, b) in
                     enumerate(zip(p0["losses"], one["losses"])))
         + f" | max rel diff {max(diffs):.1e} | one device, no mesh: max rel diff "
         f"{max(single_diffs):.1e} | processes per context group "
         f"{p0['context_group_processes']} | wall {wall:.0f} s (4 processes side by side)")
  for i, p in enumerate((p0, p1)):
    assert (p["process_id"], p["process_count"], p["devices"], p["local_devices"]) == (i, 2, 8, 4)
  assert (one["process_count"], one["devices"]) == (1, 8)
  for p in (p0, p1, one):
    assert p["trace_counts"].get("apply", 0) >= 1, p["trace_counts"]  # kvax ran
    assert len(p["losses"]) == STEPS, p["losses"]
    # One prepare per traced step: the op sharded over the run's whole mesh, context 4.
    assert len(p["kvax_mesh"]) == 1 and p["kvax_mesh"][0]["context"] == 4, p["kvax_mesh"]
    assert p["kvax_mesh"][0]["fsdp"] == 2 and p["token_order"] == ["balanced"], p
  assert p0["kvax_mesh_processes"] == [[0, 1]], "the kvax op's mesh should span both processes"
  assert one["kvax_mesh_processes"] == [[0]]
  assert p0["context_group_processes"] == [[0, 1]], "context groups should span both processes"
  assert p0["losses"] == p1["losses"], "the two processes reported different losses"
  assert one["losses"][-1] < one["losses"][0], "training should lower the loss"
  assert max(diffs) <= LOSS_RTOL, f"losses differ: {p0['losses']} vs {one['losses']}"
  # Context parallelism changes nothing but rounding: one device (kvax unsharded, tokens in
  # their natural order) trains the same batches to the same losses, within LOSS_RTOL.
  assert single["kvax_mesh"] == [None] and single["token_order"] == ["natural"], single
  assert len(single["losses"]) == STEPS
  assert max(single_diffs) <= LOSS_RTOL, (
      f"one device {single['losses']} vs context 4 x fsdp 2 {one['losses']}")
