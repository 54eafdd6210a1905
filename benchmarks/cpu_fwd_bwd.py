"""CPU time and peak memory of forward+backward with the JAX backend (12 documents + padding).

Each size runs in its own subprocess so the peak RSS belongs to that size alone.
  python benchmarks/cpu_fwd_bwd.py --sizes 8192 32768 --out benchmarks/results/cpu_fwd_bwd.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time


def one_size(seq_len: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
  import resource

  import jax
  import jax.numpy as jnp
  import numpy as np

  import kvax_plugin as kp

  rng = np.random.default_rng(0)
  pad = 1000 if seq_len > 4000 else seq_len // 8
  body = seq_len - pad
  cuts = np.sort(rng.choice(np.arange(1, body), 11, replace=False))
  seg = np.full((1, seq_len), -1, np.int32)
  seg[0, :body] = np.searchsorted(cuts, np.arange(body), side="right")
  seg = jnp.asarray(seg)
  pos = kp.positions_from_segment_ids(seg)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (1, seq_len, heads, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, seq_len, kv_heads, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, seq_len, kv_heads, head_dim), jnp.bfloat16)

  def loss(q, k, v, pos, seg):
    mask = kp.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
    out = kp.flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=head_dim ** -0.5,
                             backend="jax")
    return jnp.sum(out.astype(jnp.float32) ** 2)

  fwd = jax.jit(lambda *a: kp.flash_attention(
      *a[:3], a[3], a[4], a[3], a[4],
      kp.create_attention_mask(a[3], a[4], a[3], a[4]), scale=head_dim ** -0.5, backend="jax"))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  compiled = grad.lower(q, k, v, pos, seg).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  t0 = time.perf_counter()
  jax.block_until_ready(grad(q, k, v, pos, seg))
  first = time.perf_counter() - t0
  times_fb, times_f = [], []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(grad(q, k, v, pos, seg))
    times_fb.append(time.perf_counter() - t0)
  jax.block_until_ready(fwd(q, k, v, pos, seg))
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fwd(q, k, v, pos, seg))
    times_f.append(time.perf_counter() - t0)
  mask = kp.create_attention_mask(pos, seg, pos, seg)
  segn = np.asarray(seg)[0]
  posn = np.asarray(pos)[0]
  kept = 0
  for d in np.unique(segn[segn >= 0]):
    n = int((segn == d).sum())
    kept += n * (n + 1) // 2
  return {
      "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
      "dtype": "bfloat16", "documents": 12, "padding_tokens": pad,
      "forward_s_median": float(np.median(times_f)),
      "forward_backward_s_median": float(np.median(times_fb)),
      "first_call_s_incl_compile": first,
      "compiled_temp_bytes": int(temp),
      "peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
      "dense_scores_bytes_f32": seq_len * seq_len * heads * 4,
      "kept_pairs": kept, "mask_sparsity": kp.mask_sparsity(mask),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768])
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv_heads", type=int, default=1)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="benchmarks/results/cpu_fwd_bwd.json")
  parser.add_argument("--_one", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._one:
    print(json.dumps(one_size(args._one, args.heads, args.kv_heads, args.head_dim, args.repeats)))
    return
  import jax
  results = []
  for s in args.sizes:
    cmd = [sys.executable, __file__, "--_one", str(s), "--heads", str(args.heads), "--kv_heads",
           str(args.kv_heads), "--head_dim", str(args.head_dim), "--repeats", str(args.repeats)]
    line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
    r = json.loads(line)
    results.append(r)
    print(f"S={s:6d}: forward {r['forward_s_median']:.2f} s, forward+backward "
          f"{r['forward_backward_s_median']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, "
          f"compiled temp {r['compiled_temp_bytes'] / 2**20:.1f} MiB "
          f"(one dense f32 score tensor would be {r['dense_scores_bytes_f32'] / 2**30:.1f} GiB)")
  conditions = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "machine": platform.machine(), "cpus": __import__("os").cpu_count(),
                "python": platform.python_version(), "jax": jax.__version__,
                "command": " ".join(sys.argv)}
  with open(args.out, "w") as f:
    json.dump({"conditions": conditions, "results": results}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
