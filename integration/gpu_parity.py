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
      c = H.compare_with_dot_product(model_name, {**gpu, **extra}, seed=3)
      diffs = c.pop("grad_diffs")
      worst = max(diffs, key=diffs.get)
      row.update(c, worst_grad=worst, worst_grad_max_rel_diff=diffs[worst], num_grads=len(diffs))
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
