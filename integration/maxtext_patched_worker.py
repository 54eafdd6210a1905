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
  import maxtext
  from maxtext.layers import attention_op
  import maxtext_harness as H
  from kvax_plugin.providers import kvax_provider
  from kvax_plugin.integrations import maxtext as kvax_maxtext

  # kvax_* keys in `extra` are declared by the patch (no install()).
  c = H.compare_with_dot_product(model, extra, seed=5)
  diffs = c["grad_diffs"]
  worst = max(diffs, key=diffs.get)
  return dict(maxtext_file=maxtext.__file__, patched=bool(getattr(attention_op, "KVAX_PATCHED", False)),
              installed=kvax_maxtext.is_installed(), trace_counts=dict(kvax_provider.TRACE_COUNTS),
              loss_dot_product=c["loss_dot_product"], loss_kvax=c["loss_kvax"],
              logit_rel_diff=c["logits_max_rel_diff"], worst_grad=worst,
              worst_grad_rel_diff=diffs[worst],
              grads_over_tolerance={n: d for n, d in diffs.items() if not d <= H.grad_tolerance(n)})


if __name__ == "__main__":
  print("KVAX_RESULT " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
