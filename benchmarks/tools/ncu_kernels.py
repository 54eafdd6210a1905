"""One attention forward+backward per process, for Nsight Compute (ncu) to read the kernels' counters.

    ncu --clock-control none --set full --kernel-name regex:"mosaic_gpu_kernel|sdpa_sm90" \
        --csv --page raw python3 -m benchmarks.tools.ncu_kernels --impl mosaic --case causal --seq 16384

Same cases, shapes and implementations as benchmarks/bench_attention.py (B=1, 32 query / 8 kv
heads, head dim 128, bf16): jax.grad of <out, cotangent> is compiled, then run --steps times and
waited for. Nothing is timed here; ncu replays each selected kernel launch once per counter pass
and reports its duration and counters (benchmarks/tools/ncu_summary.py turns the raw CSV into the
tables of docs/history/performance-2026-11.md). XLA's command buffers are turned off (set below,
before jax is imported) so every kernel is a launch of its own, as in the timed benchmarks'
steady state.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.cases import NO_FEATURES, layout  # noqa: E402
from benchmarks.impls import make_impls  # noqa: E402
from benchmarks.tools.profile_kernels import environment  # noqa: E402


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--impl", required=True, help="an implementation name of benchmarks/impls.py")
  ap.add_argument("--case", default="causal", choices=("causal", "docs"))
  ap.add_argument("--seq", type=int, default=16384)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--steps", type=int, default=1)
  ap.add_argument("--window", type=int, default=None, help="sliding window (our backends only)")
  ap.add_argument("--backward-order", default=None,
                  help="the CUDA backward's launch order, a name of benchmarks/tools/"
                       "launch_orders.py's BACKWARD_ORDERS (default: the kernel's own)")
  args = ap.parse_args(argv)
  order_patch = contextlib.nullcontext()
  if args.backward_order is not None:
    from benchmarks.tools import launch_orders
    from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward
    if args.backward_order not in launch_orders.BACKWARD_ORDERS:
      ap.error(f"--backward-order {args.backward_order!r}: expected one of "
               f"{sorted(launch_orders.BACKWARD_ORDERS)}")
    order_patch = launch_orders.launch_order(
        fused_backward, "launch_order", launch_orders.BACKWARD_ORDERS[args.backward_order])
  h, kh, d = 32, 8, args.head_dim
  pos, seg, _ = layout(args.case, args.seq, args.seq)
  features = dict(NO_FEATURES, window=args.window)
  impls, _ = make_impls(args.case, pos, seg, d ** -0.5, (args.impl,), features=features,
                        heads=h, head_dims=(d, d))
  fn = impls.get(args.impl)
  if fn is None or isinstance(fn, str):
    raise SystemExit(f"--impl {args.impl!r}: "
                     f"{fn or 'not an implementation of benchmarks/impls.py'}")
  key = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(key[0], (1, args.seq, h, d), jnp.bfloat16)
  k = jax.random.normal(key[1], (1, args.seq, kh, d), jnp.bfloat16)
  v = jax.random.normal(key[2], (1, args.seq, kh, d), jnp.bfloat16)
  cot = jax.random.normal(key[3], (1, args.seq, h, d), jnp.bfloat16)

  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * cot.astype(jnp.float32))

  with environment(getattr(fn, "env", {})), order_patch:
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
  for _ in range(args.steps):
    jax.block_until_ready(step(q, k, v))
  print(f"ran {args.impl} {args.case} {args.seq} x{args.steps}", flush=True)


if __name__ == "__main__":
  main()
