"""Cold-start cost of one attention forward+backward program, stage by stage, per kernel.

    python benchmarks/kernel_compile_time.py --out $OUT/compile_time.json        # GPU: 16k
    python benchmarks/kernel_compile_time.py --seq 1024 --impls kvax_jax,xla     # CPU smoke

The MaxText end-to-end program (benchmarks/maxtext_e2e.py) says how a whole training step's
setup+compile splits into tracing, lowering and XLA compile; this one isolates the attention:
for each implementation a fresh jit of `grad(<attention(q, k, v), cotangent>)` w.r.t. q, k, v
(with kvax, the block mask built inside the program from positions and segment ids, as MaxText's
step does) is traced, lowered, compiled and run twice, and each stage is timed on its own:

    trace     Python -> jaxpr (the kernels' Python: table walking set-up, Pallas kernel bodies)
    lower     jaxpr -> StableHLO (kernel lowering rules: Mosaic GPU / Triton IR built here)
    compile   XLA compile (Pallas-Triton kernels and XLA's own fusions and autotuning)
    first     first run, to the result (work a kernel does once at its first execution)
    second    second run (the steady state, for scale)

Layout: B=1, 32 query / 8 kv heads, head dim 128, bf16 (float32 on CPU), 12 random-length
documents + 1000 padding tokens (bench_attention.py's "docs"; fewer padding tokens below 8k;
cuDNN and XLA see only causality).
The persistent compilation cache is off, so every compile is cold. Implementations: kvax_<backend>
(mosaic, triton, jax), cudnn (jax.nn.dot_product_attention implementation="cudnn"), xla (the same,
"xla": dense, only for short sequences). Writes --out (JSON: conditions and per-impl seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvax_plugin  # noqa: E402
from benchmarks.cases import documents_layout  # noqa: E402


def make_loss(impl: str, pos, seg):
  """(q, k, v, cotangent) -> scalar <attention(q, k, v), cotangent> of implementation `impl`."""
  if impl.startswith("kvax_"):
    backend = impl[len("kvax_"):]

    def attend(q, k, v):
      mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
      return kvax_plugin.flash_attention(q, k, v, pos, seg, pos, seg, mask,
                                         scale=q.shape[-1] ** -0.5, backend=backend)
  elif impl in ("cudnn", "xla"):
    def attend(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  else:
    raise ValueError(f"--impls: unknown implementation {impl!r} (kvax_<backend>, cudnn, xla)")

  def loss(q, k, v, cot):
    return jnp.sum(attend(q, k, v).astype(jnp.float32) * cot)
  return loss


def time_stages(impl: str, args, pos, seg) -> dict:
  grad = jax.grad(make_loss(impl, pos, seg), argnums=(0, 1, 2))
  out = {}
  t = time.perf_counter()
  traced = jax.jit(grad).trace(*args)
  out["trace"], t = time.perf_counter() - t, time.perf_counter()
  lowered = traced.lower()
  out["lower"], t = time.perf_counter() - t, time.perf_counter()
  compiled = lowered.compile()
  out["compile"], t = time.perf_counter() - t, time.perf_counter()
  jax.block_until_ready(compiled(*args))
  out["first"], t = time.perf_counter() - t, time.perf_counter()
  jax.block_until_ready(compiled(*args))
  out["second"] = time.perf_counter() - t
  return {k: round(v, 4) for k, v in out.items()}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seq", type=int, default=16384)
  ap.add_argument("--impls", default="kvax_mosaic,cudnn", help="comma-separated")
  ap.add_argument("--heads", type=int, default=32)
  ap.add_argument("--kv_heads", type=int, default=8)
  ap.add_argument("--head_dim", type=int, default=128)
  ap.add_argument("--out", default="outputs/compile_time.json")
  args = ap.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)  # every compile cold
  gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if gpu else jnp.float32
  pos, seg, _ = documents_layout(args.seq, 12, min(1000, args.seq // 8), seed=0)
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)
  keys = jax.random.split(jax.random.key(0), 4)
  s, h, kh, d = args.seq, args.heads, args.kv_heads, args.head_dim
  qkv = (jax.random.normal(keys[0], (1, s, h, d), dtype),
         jax.random.normal(keys[1], (1, s, kh, d), dtype),
         jax.random.normal(keys[2], (1, s, kh, d), dtype),
         jax.random.normal(keys[3], (1, s, h, d), jnp.float32))
  result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                device=jax.devices()[0].device_kind, jax=jax.__version__, seq=s, heads=h,
                kv_heads=kh, head_dim=d, dtype=jnp.dtype(dtype).name,
                command=" ".join(sys.argv), seconds={})
  for impl in args.impls.split(","):
    try:
      result["seconds"][impl] = time_stages(impl, qkv, pos, seg)
    except Exception as e:  # noqa: BLE001 - record the failure, go on with the others
      result["seconds"][impl] = {"error": f"{type(e).__name__}: {e}"[:500]}
      traceback.print_exc()
    print(impl, json.dumps(result["seconds"][impl]), flush=True)
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=1))
  print(f"{'impl':14s}" + "".join(f"{k:>9s}" for k in ("trace", "lower", "compile", "first",
                                                      "second")))
  for impl, sec in result["seconds"].items():
    print(f"{impl:14s}" + "".join(f"{sec.get(k, float('nan')):9.2f}" for k in (
        "trace", "lower", "compile", "first", "second")))


if __name__ == "__main__":
  main()
