"""attention=kvax in a MaxText patched with patches/maxtext/<version>/, without install().

    PYTHONPATH=<patched root> python integration/maxtext_patched_worker.py MODEL '<extra json>'

Prints one JSON line: where maxtext was imported from, whether install() ran (it must not),
the kvax trace counters, and the parity numbers against dot_product.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(model: str, extra: dict) -> dict:
  import jax
  import numpy as np
  import maxtext
  from maxtext.layers import attention_op
  import maxtext_harness as H
  from kvax_plugin.backends import kvax_backend
  from kvax_plugin.integrations import maxtext as kvax_maxtext

  out = {}
  for attention in ("dot_product", "kvax"):
    config = H.make_config(model, attention, extra=extra)  # kvax_* keys: declared by the patch
    m, mesh = H.make_model(config)
    batch = H.packed_batch(config.global_batch_size_to_train_on, config.max_target_length,
                           config.vocab_size, seed=5)
    with jax.set_mesh(mesh):
      loss, logits, grads = H.value_and_grads(m, batch)
    out[attention] = (float(loss), np.asarray(logits), H.flat_params(grads))
  ref, got = out["dot_product"], out["kvax"]
  keep = np.asarray(batch.weights) > 0
  diffs = {n: H.max_rel_diff(got[2][n], ref[2][n]) for n in ref[2]}
  worst = max(diffs, key=diffs.get)
  return dict(maxtext_file=maxtext.__file__, patched=bool(getattr(attention_op, "KVAX_PATCHED", False)),
              installed=kvax_maxtext.is_installed(), trace_counts=dict(kvax_backend.TRACE_COUNTS),
              loss_dot_product=ref[0], loss_kvax=got[0],
              logit_rel_diff=H.max_rel_diff(got[1][keep], ref[1][keep]), worst_grad=worst,
              worst_grad_rel_diff=diffs[worst],
              grads_over_tolerance={n: d for n, d in diffs.items() if not d <= H.grad_tolerance(n)})


if __name__ == "__main__":
  print("KVAX_RESULT " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
