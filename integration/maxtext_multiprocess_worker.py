"""One process of a MaxText training run spread over several processes (run as a subprocess).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python \
        integration/maxtext_multiprocess_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR \
        METRICS_FILE <MaxText train argv...>

With NUM_PROCESSES > 1 it joins the others through jax.distributed (coordinator host:port,
CPU collectives over gloo) exactly as `python -m kvax_plugin.launch --num_processes=...` does
(kvax_plugin.integrations.maxtext.distributed), then trains through MaxText's own entry point
with attention=kvax available (kvax_plugin.integrations.maxtext.train.main). With
NUM_PROCESSES = 1 it is the single-process reference. Prints one JSON line: the per-step losses
this process's MaxText metric logger wrote, the global / local device counts, the kvax trace
counters, and the mesh (with the processes its devices belong to), query specs and token order
the kvax op was prepared with.
"""

from __future__ import annotations

import json
import sys


def _context_groups(mesh):
  """The device groups along the mesh's context axis."""
  import numpy as np
  axis = mesh.axis_names.index("context")
  return np.moveaxis(mesh.devices, axis, -1).reshape(-1, mesh.devices.shape[axis])


def main() -> None:
  process_id, num_processes, coordinator = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  metrics_file, argv = sys.argv[4], sys.argv[5:]
  from kvax_plugin.integrations.maxtext import distributed
  if num_processes > 1:
    distributed.initialize(coordinator, num_processes, process_id)
  import dataclasses

  import jax
  from kvax_plugin.integrations.maxtext import train
  from kvax_plugin.providers import kvax_provider, register_provider
  seen = []

  def recording_prepare(*args, **kwargs):
    prepared = kvax_provider.prepare(*args, **kwargs)
    seen.append(prepared.options)  # how the decoder entry sharded the kvax op
    return prepared

  register_provider(dataclasses.replace(kvax_provider.KVAX_PROVIDER, prepare=recording_prepare),
                    replace=True)
  # Every process's MaxText metric logger writes metrics_file: one file each.
  with distributed.barrier_before_first_batch():  # as the launcher does
    train.main([sys.argv[0]] + argv + [f"metrics_file={metrics_file}"])
  with open(metrics_file) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  losses = [r["learning/loss"] for r in sorted(rows, key=lambda r: r["step"])]
  print("KVAX_RESULT " + json.dumps(dict(
      process_id=jax.process_index(), process_count=jax.process_count(),
      devices=jax.device_count(), local_devices=jax.local_device_count(), losses=losses,
      trace_counts=dict(kvax_provider.TRACE_COUNTS),
      kvax_mesh=[dict(o.mesh.shape) if o.mesh is not None else None for o in seen],
      kvax_mesh_processes=[sorted({d.process_index for d in o.mesh.devices.flat})
                           if hasattr(o.mesh, "devices") else None for o in seen],
      context_group_processes=sorted({tuple(sorted({d.process_index for d in group}))
                                      for o in seen if hasattr(o.mesh, "devices")
                                      for group in _context_groups(o.mesh)}),
      query_specs=[repr(o.query_specs) for o in seen],
      token_order=[o.token_order for o in seen])), flush=True)


if __name__ == "__main__":
  main()
