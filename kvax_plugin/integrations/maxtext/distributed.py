"""Several processes, one training run: jax.distributed for MaxText with attention=kvax.

MaxText starts jax.distributed only from scheduler variables, so the launcher takes flags and
initializes before anything touches a device (on each host I = 0 .. N-1):

    python -m kvax_plugin.launch --config=llama3:8b \\
        --coordinator_address=HOST0:12345 --num_processes=N --process_id=I

Process 0 writes the run's files, process I > 0 its own under <output dir>/process_I.
"""

from __future__ import annotations

import contextlib
import os


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               timeout_s: int = 300) -> None:
  """Join the run's other processes (coordinator_address: process 0's "host:port"); call before
  anything touches a JAX device."""
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
  # CPU devices of different processes need a collectives implementation to talk at all.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=timeout_s)


def join_processes(n: int, i: int, address: str | None, cfg, raw: dict[str, str]) -> None:
  """The launcher's --num_processes / --process_id / --coordinator_address: join the others and
  send process i > 0's files to <output dir>/process_<i>. Nothing happens for one process."""
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
  except RuntimeError as e:
    raise SetupError(f"--coordinator_address={address} --process_id={i}: joining the other "
                     f"{n - 1} process(es) failed: {one_line(e)}") from e
  if i > 0 and "base_output_directory" not in raw and "run_name" not in raw:
    cfg.output_dir = os.path.join(output_dir(cfg), f"process_{i}")

def barrier(name: str, *, timeout_s: int = 900) -> None:
  """Wait until every process reaches `name` (jax.distributed's coordination service). Gloo
  gives a process 30 s to reach a first collective after the others, which processes compiling
  at different speeds can exceed; this lines them up. No-op in a single process."""
  import jax
  from jax._src import distributed as jax_distributed
  if jax.process_count() == 1:
    return
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("barrier: several processes but no jax.distributed client")
  client.wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)


@contextlib.contextmanager
def barrier_before_first_batch():
  """MaxText's data loader waits for every process before its first batch, so they reach the
  train step's first collective together."""
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
