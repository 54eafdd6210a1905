"""Parity of attention=kvax vs dot_product for one shrunken model on a simulated CPU mesh.

Run as a subprocess (the device count is fixed when JAX starts):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python integration/maxtext_mesh_worker.py \
        MODEL '{"ici_fsdp_parallelism": 2, ...}'
Prints one JSON line: losses, the largest logit / gradient differences, and how the kvax op
was sharded. Tokens are permuted by MaxText's own load-balancing function when context
parallelism is on, as its input pipeline does, and both kernels see the same permuted batch.
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

  for attention in ("dot_product", "kvax"):
    config = H.make_config(model, attention, extra=dict(mesh_overrides))
    m, mesh = H.make_model(config)
    batch = H.packed_batch(config.global_batch_size_to_train_on, config.max_target_length,
                           config.vocab_size, seed=1)
    cp = kvax_maxtext.mesh_rules.permuted_for_load_balance(config, mesh)
    if cp:
      from maxtext.utils import max_utils
      cp_size = max_utils.reordered_cp_size(config, mesh)
      batch = jax.tree.map(lambda x: max_utils.reorder_sequence(x, cp_size), batch)
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
      loss, logits, grads = H.value_and_grads(m, batch)
    results[attention] = (float(loss), np.asarray(logits), H.flat_params(grads))
  ref, got = results["dot_product"], results["kvax"]
  keep = np.asarray(batch.weights) > 0
  logit_diff = H.max_rel_diff(got[1][keep], ref[1][keep])
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
              permuted=opts.permute_tokens_for_load_balance)


if __name__ == "__main__":
  print("KVAX_RESULT " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
