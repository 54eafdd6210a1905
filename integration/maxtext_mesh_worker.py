"""Parity of attention=kvax vs dot_product for shrunken models on a simulated CPU mesh.

Run as a subprocess (the device count is fixed when JAX starts):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python integration/maxtext_mesh_worker.py \
        '[["MODEL", {"ici_fsdp_parallelism": 2, ...}], ...]'
The cases run one after the other in this process (one MaxText import, ~10 s of CPU, for all
the cases of one device count). Prints one JSON line per case, in order: losses, the largest
logit / gradient differences, and how the kvax op was sharded and which token order it was
told; or the case's error (a traceback), so that a failing case fails only its own test. When MaxText reorders batches (load-balanced
context parallelism), the batch goes through the reorder callable MaxText's setup_train_loop
builds with attention=kvax (kvax_context_parallel_order: the balanced order by default), and
both kernels see that same reordered batch.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(model: str, mesh_overrides: dict) -> dict:
  import jax
  import numpy as np
  from flax import nnx
  from flax.linen import partitioning as nn_partitioning

  import maxtext_harness as H
  from kvax_plugin.providers import kvax_provider
  from kvax_plugin.integrations import maxtext as kvax_maxtext

  import dataclasses
  from kvax_plugin.providers import register_provider

  kvax_maxtext.install()
  results, seen_options = {}, []

  def recording_prepare(*args, **kwargs):
    prepared = kvax_provider.prepare(*args, **kwargs)
    seen_options.append(prepared.options)  # what the decoder entry resolved under the rules
    return prepared

  register_provider(dataclasses.replace(kvax_provider.KVAX_PROVIDER, prepare=recording_prepare),
                   replace=True)

  from kvax_plugin.attention import token_order as orders
  from kvax_plugin.integrations.maxtext import batch_order
  kvax_config = H.make_config(model, "kvax", extra=dict(mesh_overrides))
  natural = None
  for attention in ("dot_product", "kvax"):
    config = H.make_config(model, attention, extra=dict(mesh_overrides))
    m, mesh = H.make_model(config)
    batch = H.packed_batch(config.global_batch_size_to_train_on, config.max_target_length,
                           config.vocab_size, seed=1)
    natural = batch
    from maxtext.utils import max_utils, maxtext_utils
    cp_size = max_utils.reordered_cp_size(config, mesh)
    if cp_size > 1:
      # What setup_train_loop does under install() with attention=kvax (the kvax run's config
      # decides, and the dot_product run sees the same batch).
      from maxtext.common.common_types import ReorderStrategy
      with batch_order.reorder_hook(kvax_config):
        reorder = maxtext_utils.get_reorder_callable(cp_size, config.shard_mode,
                                                     ReorderStrategy.DUAL_CHUNK_SWAP,
                                                     config.hardware)
      batch = H.from_maxtext_batch(reorder(H.to_maxtext_batch(batch)))
    before = dict(kvax_provider.TRACE_COUNTS)
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
      loss, logits, grads = H.value_and_grads(m, batch)
    if attention == "kvax":  # what tracing the kvax step did (nnx.jit traces it once)
      trace_counts = {k: kvax_provider.TRACE_COUNTS[k] - before.get(k, 0)
                      for k in ("prepare", "mask_builds", "apply")}
    results[attention] = (float(loss), np.asarray(logits), H.flat_params(grads))
  # Which permutation the batch carries: compare with the orders computed here.
  seq_len = kvax_config.max_target_length
  kvax_seg = np.where(np.asarray(natural.segment_ids) == 0, -1, np.asarray(natural.segment_ids))
  unit, kv_block = batch_order.unit_blocks(kvax_config)
  carried = []  # the orders whose permutation of the natural batch is the batch both kernels saw
  for name in ("natural", "llama3", "balanced"):
    if cp_size > 1 or name == "natural":
      tok = orders.token_order(np.asarray(natural.positions), kvax_seg, max(cp_size, 1),
                               order=name, block=unit, kv_block=kv_block)
      if np.array_equal(np.asarray(orders.apply_token_order(natural.tokens, tok)),
                        np.asarray(batch.tokens)):
        carried.append(name)
  ref, got = results["dot_product"], results["kvax"]
  # Every token, padding included: kvax must give padding rows as MaxText's attention does.
  logit_diff = H.max_rel_diff(got[1], ref[1])
  grad_diffs = {n: H.max_rel_diff(got[2][n], ref[2][n]) for n in ref[2]}
  worst = max(grad_diffs, key=grad_diffs.get)
  over = {n: d for n, d in grad_diffs.items() if not d <= H.grad_tolerance(n)}
  register_provider(kvax_provider.KVAX_PROVIDER, replace=True)
  if len(seen_options) != 1:
    raise AssertionError(f"expected one prepare per traced step, saw {len(seen_options)}")
  opts = seen_options[0]
  return dict(model=model, mesh=dict(mesh.shape), devices=jax.device_count(),
              loss_dot_product=ref[0], loss_kvax=got[0], logit_rel_diff=logit_diff,
              worst_grad=worst, worst_grad_rel_diff=grad_diffs[worst], num_grads=len(grad_diffs), grads_over_tolerance=over, logit_tol=H.LOGIT_TOL,
              grad_names_match=sorted(ref[2]) == sorted(got[2]),
              kvax_sharded=opts.mesh is not None, query_specs=repr(opts.query_specs), kv_specs=repr(opts.kv_specs),
              token_order=opts.token_order, batch_order=carried, seq_len=seq_len,
              trace_counts=trace_counts)


if __name__ == "__main__":
  import traceback
  for model, mesh_overrides in json.loads(sys.argv[1]):
    try:
      result = main(model, mesh_overrides)
    except Exception:  # noqa: BLE001 - reported to the case's own test
      result = dict(model=model, error=traceback.format_exc())
    print("KVAX_RESULT " + json.dumps(result), flush=True)
