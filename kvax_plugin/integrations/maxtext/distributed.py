"""Several processes, one training run: jax.distributed for MaxText with attention=kvax.

MaxText starts jax.distributed itself only from scheduler environment variables, so the launcher
takes the coordinator, process count and id as flags and initializes before anything touches a
device (on each host I = 0 .. N-1):

    python -m kvax_plugin.launch --config=llama3:8b \\
        --coordinator_address=HOST0:12345 --num_processes=N --process_id=I

The mesh is MaxText's (ici_* axes over all processes' devices, later axes innermost). On CPU
the collectives go through gloo; on GPUs a process uses every GPU it sees. Process 0 writes the
run's files, process I > 0 its own under <output dir>/process_I. docs/context-parallelism.md.
"""

from __future__ import annotations

import contextlib
import os


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               timeout_s: int = 300) -> None:
  """Join the run's other processes; call before anything touches a JAX device.

  coordinator_address: "host:port" that process 0 listens on and the others reach.
  """
  import jax
  host, sep, port = coordinator_address.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise ValueError(f"coordinator_address={coordinator_address!r}: expected host:port "
                     "(the address process 0 listens on)")
  if not (isinstance(num_processes, int) and num_processes >= 1):
    raise ValueError(f"num_processes={num_processes!r}: must be a positive int")
  if not (isinstance(process_id, int) and 0 <= process_id < num_processes):
    raise ValueError(f"process_id={process_id!r}: must be in 0..{num_processes - 1} "
                     f"(num_processes={num_processes})")
  if jax.distributed.is_initialized():
    raise RuntimeError("jax.distributed is already initialized in this process")
  # CPU devices of different processes need a collectives implementation to talk at all (the
  # default of older JAX releases is none); it only concerns the CPU client.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=timeout_s)


def join_processes(n: int, i: int, address: str | None, cfg, raw: dict[str, str]) -> None:
  """The launcher's --num_processes=n / --process_id=i / --coordinator_address=address: join
  the other processes (before anything uses a device), and send this process's files to
  <output dir>/process_<i> when i > 0 (processes sharing a disk would overwrite each other's
  maxtext.log, metrics and summary). Nothing happens for one process."""
  from kvax_plugin.errors import FlagError, SetupError
  from kvax_plugin.integrations.maxtext.launch_checks import one_line
  from kvax_plugin.integrations.maxtext.launch_keys import output_dir
  if n == 1 and i == 0 and address is None:
    return
  if address is None:
    raise FlagError(f"--num_processes={n} --process_id={i}: a run over several processes also "
                    "needs --coordinator_address=host:port (where process 0 listens)")
  if n < 2:
    raise FlagError(f"--num_processes={n}: --coordinator_address / --process_id are for a run "
                    "over several processes (num_processes >= 2)")
  try:
    initialize(address, n, i)
  except ValueError as e:
    raise FlagError(f"--{e}") from e
  except RuntimeError as e:  # e.g. the coordinator unreachable, or process ids that clash
    raise SetupError(f"--coordinator_address={address} --process_id={i}: joining the other "
                     f"{n - 1} process(es) failed: {one_line(e)}") from e
  if i > 0 and "base_output_directory" not in raw and "run_name" not in raw:
    cfg.output_dir = os.path.join(output_dir(cfg), f"process_{i}")

def barrier(name: str, *, timeout_s: int = 900) -> None:
  """Wait until every process of the run reaches `name` (through jax.distributed's coordination
  service, not a device collective). No-op in a single process.

  Gloo, the CPU collectives, gives a process 30 s (a fixed limit, not XLA's
  --xla_cpu_collective_timeout_seconds) to reach its first collective over a given set of
  devices after the others have; processes that compile at different speeds on a busy machine
  can drift further apart than that. Calling this just before the first step lines them up.
  """
  import jax
  from jax._src import distributed as jax_distributed  # the client has no public accessor
  if jax.process_count() == 1:
    return
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("barrier: several processes but no jax.distributed client")
  client.wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)


@contextlib.contextmanager
def barrier_before_first_batch():
  """Within the block, MaxText's data loader waits for every process (barrier) before its first
  batch: MaxText has compiled the train step by then, so the processes reach its first
  collective together. Nothing changes in a single process."""
  import jax
  if jax.process_count() == 1:
    yield
    return
  from maxtext.common import data_loader
  original = data_loader.DataLoader.load_next_batch
  first = [True]

  def load_next_batch(self, *args, **kwargs):
    if first[0]:
      first[0] = False
      barrier("kvax_plugin_first_batch")
    return original(self, *args, **kwargs)

  data_loader.DataLoader.load_next_batch = load_next_batch
  try:
    yield
  finally:
    data_loader.DataLoader.load_next_batch = original
