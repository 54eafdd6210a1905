"""attention=kvax (Triton backend) against MaxText's dot_product on one GPU, recorded as JSON.

The same shrunken upstream models as integration/test_maxtext_parity.py (float32, highest matmul
precision; Triton dots run in IEEE float32 for float32 inputs), on a packed batch with padding.
  python integration/gpu_parity.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True)
  parser.add_argument("--models", nargs="*", default=None)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="activations dtype; bfloat16 is how models with head dims above 128 "
                           "run the Triton kernels (float32 at those head dims is refused)")
  parser.add_argument("--kvax_backend", default="triton", choices=("triton", "jax"),
                      help="jax: the same comparison with kvax's pure-JAX path on the GPU (a noise "
                           "floor for bfloat16 runs)")
  parser.add_argument("--cpu_check", action="store_true",
                      help="run on CPU with the JAX backend (to check this script, not the GPU)")
  args = parser.parse_args()

  import jax
  import numpy as np
  from flax import nnx

  import maxtext_harness as H
  from kvax_plugin.integrations import maxtext as kvax_maxtext

  kvax_maxtext.install()
  gpu = dict(hardware="gpu", kvax_backend="triton", kvax_fwd_query_block_size=64,
             kvax_fwd_kv_block_size=64, kvax_bwd_query_block_size=64, kvax_bwd_kv_block_size=64)
  cases = [("llama3-8b", {}), ("mistral-7b", {}), ("gemma2-2b", {}),
           ("gemma2-2b", {"sliding_window_size": 48}), ("qwen3-0.6b", {}), ("gpt-oss-20b", {}),
           ("deepseek3-tiny", {})]
  gpu.update(kvax_backend=args.kvax_backend)
  if args.dtype == "bfloat16":
    gpu.update(dtype="bfloat16", matmul_precision="default")
  if args.cpu_check:
    gpu.update(hardware="cpu", kvax_backend="jax")
  if args.models:
    cases = [c for c in cases if c[0] in args.models]
  results = []
  for model_name, extra in cases:
    row = {"model": model_name, "extra": extra}
    try:
      runs = {}
      for attention in ("dot_product", "kvax"):
        config = H.make_config(model_name, attention, extra={**gpu, **extra})
        model, mesh = H.make_model(config)
        batch = H.packed_batch(config.global_batch_size_to_train_on, config.max_target_length,
                               config.vocab_size, seed=3)
        with jax.set_mesh(mesh):
          loss, logits, grads = H.value_and_grads(model, batch)
        runs[attention] = (float(loss), np.asarray(logits), H.flat_params(grads))
      keep = np.asarray(batch.weights) > 0
      (l_ref, lg_ref, g_ref), (l_k, lg_k, g_k) = runs["dot_product"], runs["kvax"]
      diffs = {n: H.max_rel_diff(g_k[n], g_ref[n]) for n in g_ref}
      worst = max(diffs, key=diffs.get)
      row.update(loss_dot_product=l_ref, loss_kvax=l_k,
                 logits_max_rel_diff=H.max_rel_diff(lg_k[keep], lg_ref[keep]),
                 worst_grad=worst, worst_grad_max_rel_diff=diffs[worst], num_grads=len(diffs))
    except Exception as e:  # recorded, never hidden: the row says what failed
      row["error"] = f"{type(e).__name__}: {e}"[:2000]
    print(json.dumps(row), flush=True)
    results.append(row)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "command": " ".join(sys.argv), "dtype": args.dtype, "kvax_backend": args.kvax_backend}
    with open(args.out, "w") as f:  # after every model, so a time limit keeps what finished
      json.dump({"conditions": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
