"""Bus bandwidth of the collectives context parallelism uses, alone on an idle host.

    python -m benchmarks.tools.collective_bandwidth --out collectives.json
    python -m benchmarks.tools.collective_bandwidth --lengths 1024 --repeats 2   # a dry run

Times jax.lax.all_gather (bf16, the key / value exchange) and psum_scatter (float32 and bf16,
the dk / dv sum) over all GPUs, at the sizes of one llama3-8b layer's key or value
([1, S, 8, 128]) for a few S. Bus bandwidth as NCCL's tests count it: (n - 1) / n x the
gathered (all-gather) or the input (reduce-scatter) bytes, over the time. A MaxText profile's
collective times (benchmarks/maxtext_scaling.py --profile) read against these tell whether they
ran at the link's speed or were slowed by the compute beside them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _time(fn, x, repeats: int) -> float:
  fn(x).block_until_ready()  # compile and warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="collectives.json")
  ap.add_argument("--lengths", default="131072,262144", help="tokens S of [1, S, 8, 128]")
  ap.add_argument("--repeats", type=int, default=10)
  args = ap.parse_args(argv)
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), ("context",))
  rows = []
  for s in map(int, args.lengths.split(",")):
    shape = (1, s, 8, 128)  # whole (gathered) k or v, or one shard's full-length dk partial
    for op, dtype in (("all_gather", jnp.bfloat16), ("psum_scatter", jnp.float32),
                      ("psum_scatter", jnp.bfloat16)):
      if op == "all_gather":
        # Each device holds S / n tokens and receives the rest.
        fn = jax.jit(jax.shard_map(partial(jax.lax.all_gather, axis_name="context", axis=1,
                                           tiled=True), mesh=mesh, in_specs=P(None, "context"),
                                   out_specs=P(), check_vma=False))
        x = jax.device_put(jnp.ones(shape, dtype), NamedSharding(mesh, P(None, "context")))
        moved = np.prod(shape) * jnp.dtype(dtype).itemsize  # the gathered array's bytes
      else:
        # Each device holds a full-length partial sum and keeps its S / n slice of the total.
        fn = jax.jit(jax.shard_map(partial(jax.lax.psum_scatter, axis_name="context",
                                           scatter_dimension=1, tiled=True), mesh=mesh,
                                   in_specs=P("context"), out_specs=P("context"),
                                   check_vma=False))
        x = jax.device_put(jnp.ones((n,) + shape[1:], dtype), NamedSharding(mesh, P("context")))
        moved = np.prod(shape) * jnp.dtype(dtype).itemsize  # one device's input bytes
      sec = _time(fn, x, args.repeats)
      row = dict(op=op, dtype=jnp.dtype(dtype).name, tokens=s, bytes=int(moved),
                 ms=round(sec * 1e3, 3), bus_gb_s=round((n - 1) / n * moved / sec / 1e9, 1))
      print(json.dumps(row), flush=True)
      rows.append(row)
  result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                device=f"{n} x {devices[0].device_kind}", jax=jax.__version__,
                repeats=args.repeats, rows=rows)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
