"""One process of the plain op on a mesh spanning several processes (run as a subprocess).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/multiprocess_op_worker.py \
        PROCESS_ID NUM_PROCESSES COORDINATOR

Joins the others through jax.distributed (CPU collectives over gloo), builds a (data, context)
mesh over all processes' devices whose context groups each hold devices of every process (so the
context-parallel all-gathers and kv-gradient sums cross the process boundary), and runs
create_attention_mask(mesh=) + flash_attention forward and backward on global arrays of one
packed batch: in the balanced order under jit, on arrays each process made from its half of the
sequence (jax.make_array_from_process_local_data; key / value too are laid out (data, context),
unlike kv_specs), and in the Llama 3 order eagerly, on arrays laid out as the specs say
(jax.make_array_from_callback). The reference is the single-device op on the same batch,
computed by every process on its own first device. Prints one JSON line with the largest
differences.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B, S, H, K, D = 4, 256, 4, 2, 16


def main(process_id: int, num_processes: int, coordinator: str) -> dict:
  from kvax_plugin.integrations.maxtext import distributed
  distributed.initialize(coordinator, num_processes, process_id)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from kvax_plugin.attention import token_order
  from kvax_plugin.attention.api import create_attention_mask, flash_attention
  from kvax_plugin.attention.params import FlashAttentionParamsConfig

  fwd = FlashAttentionParamsConfig(query_block_size=32, kv_block_size=32)
  bwd = FlashAttentionParamsConfig(query_block_size=16, kv_block_size=32)
  n_local = jax.local_device_count()
  if n_local % 2:
    raise ValueError(f"needs an even number of devices per process, got {n_local}")
  # jax.devices() lists process 0's devices, then process 1's, ... Row j of the data axis takes
  # devices 2j, 2j+1 of every process: each context group spans all processes.
  devices = np.array(jax.devices()).reshape(num_processes, n_local // 2, 2)
  mesh = Mesh(devices.transpose(1, 0, 2).reshape(n_local // 2, 2 * num_processes),
              ("data", "context"))
  cp = mesh.shape["context"]
  crosses = all(len({d.process_index for d in row}) == num_processes for row in mesh.devices)
  qspec, kvspec = ("data", "context", None, None), ("data", None, None, None)

  # The same batch in every process (seeded): packed documents, padding at the row ends.
  rng = np.random.default_rng(7)
  seg = np.full((B, S), -1, np.int32)
  pos = np.zeros((B, S), np.int32)
  for b in range(B):
    end = S - int(rng.integers(0, S // 5))
    cuts = np.sort(rng.choice(np.arange(1, end), size=int(rng.integers(1, 5)), replace=False))
    for d, (a, z) in enumerate(zip([0, *cuts], [*cuts, end])):
      seg[b, a:z], pos[b, a:z] = d, np.arange(z - a)
  q = rng.standard_normal((B, S, H, D)).astype(np.float32)
  k = rng.standard_normal((B, S, K, D)).astype(np.float32)
  v = rng.standard_normal((B, S, K, D)).astype(np.float32)
  w = rng.standard_normal((B, S, H, D)).astype(np.float32)  # output cotangent

  def step(q, k, v, w, pos, seg, **kw):
    mask = create_attention_mask(pos, seg, pos, seg, fwd_params=fwd, bwd_params=bwd,
                                 calc_bwd_mask=True, **kw)

    def loss(q, k, v):
      out = flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=D ** -0.5, backend="jax",
                            **kw)
      return jnp.sum(out * w), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (out, *grads)

  with jax.default_device(jax.local_devices()[0]):
    want = [np.asarray(x) for x in jax.jit(step)(q, k, v, w, pos, seg)]

  distributed.barrier("kvax_sharded_calls")  # together to the first collective (see there)

  def global_array(x, spec):
    # Each process supplies the shards its devices hold, cut from the batch it has whole.
    sharding = NamedSharding(mesh, P(*spec))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  def from_process_local(x):
    # Each process has only its part of the sequence (its devices hold context ranks
    # 2p, 2p+1 of every data row): tokens laid out (data, context), whatever the op's specs.
    sharding = NamedSharding(mesh, P("data", "context"))
    cols = [i[1] for i in sharding.addressable_devices_indices_map(x.shape).values()]
    lo, hi = min(c.start for c in cols), max(c.stop for c in cols)
    if hi - lo != x.shape[1] // num_processes:
      raise AssertionError(f"process {process_id} holds sequence [{lo}, {hi})")
    return jax.make_array_from_process_local_data(sharding, x[:, lo:hi], x.shape)

  result = dict(process_id=jax.process_index(), process_count=jax.process_count(),
                devices=jax.device_count(), mesh=dict(mesh.shape), context_crosses=crosses)
  # Each order once: the balanced one under jit, the Llama 3 one eagerly (the mask and the op
  # then run as their own programs on the global arrays).
  for order, how in (("balanced", "jit"), ("llama3", "eager")):
    tok = token_order.token_order(pos, seg, cp, order=order, block=fwd.query_block_size)
    arrays = [np.asarray(x) for x in token_order.apply_token_order((q, k, v, w, pos, seg), tok)]
    if how == "jit":  # process-local parts, key / value laid out unlike kv_specs
      inputs = [from_process_local(x) for x in arrays]
    else:
      specs = (qspec, kvspec, kvspec, qspec, qspec[:2], qspec[:2])
      inputs = [global_array(x, s) for x, s in zip(arrays, specs)]
    kw = dict(mesh=mesh, query_specs=qspec, kv_specs=kvspec, token_order=order)
    fn = (lambda *a: step(*a, **kw)) if how == "eager" else jax.jit(lambda *a: step(*a, **kw))
    got = fn(*inputs)
    if not all(isinstance(x, jax.Array) and not x.is_fully_addressable for x in got):
      raise AssertionError("the outputs should be global arrays over all processes")
    got = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in got]
    got = [np.asarray(x) for x in token_order.undo_token_order(tuple(got), tok)]
    result[f"{order}_{how}"] = {n: float(np.max(np.abs(g - r)) / (np.max(np.abs(r)) + 1e-30))
                                for n, g, r in zip(("out", "dq", "dk", "dv"), got, want)}
  return result


if __name__ == "__main__":
  print("KVAX_RESULT " + json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])),
        flush=True)
