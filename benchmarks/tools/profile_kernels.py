"""Where the GPU time of one attention forward+backward goes, kernel by kernel.

    python -m benchmarks.tools.profile_kernels --seq 65536 --cases causal,docs --impls mosaic,cudnn \
        --out outputs/profile_64k

Runs jax.grad of <out, cotangent> for each implementation of benchmarks/bench_attention.py (same
cases and shapes: B=1, 32 query / 8 kv heads, head dim 128, bf16) under jax.profiler with a
Perfetto trace, and sums the device events of the profiled steps by name: our custom calls
(Mosaic GPU / Triton kernels) next to the XLA fusions around them (delta, casts, layout changes,
padding, the cotangent's reduction), and the GPU's idle time between kernels. Writes
<out>.json with the conditions and prints one table per (case, implementation).

The loss's own work (out * cotangent and its sum, the cotangent broadcast) is included; it is the
same for every implementation.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bench_attention import versions  # noqa: E402
from benchmarks.cases import layout  # noqa: E402
from benchmarks.impls import make_impls  # noqa: E402
from benchmarks.tools import profile_e2e  # noqa: E402


@contextlib.contextmanager
def environment(env: dict):
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def device_events(trace_dir: str) -> list[dict]:
  """Complete ('X') events of the GPU device processes in the Perfetto trace under trace_dir."""
  paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise RuntimeError(f"no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(paths[0]) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  gpu_pids = {e["pid"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"
              and "GPU" in str(e.get("args", {}).get("name", "")).upper()}
  if not gpu_pids:
    names = sorted({str(e.get("args", {}).get("name")) for e in events
                    if e.get("name") == "process_name"})
    raise RuntimeError(f"no GPU process in the trace (processes: {names})")
  return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids
          and e.get("dur") is not None]


def summarize(events: list[dict], steps: int) -> dict:
  """Per-step ms by event name, busy time (union of intervals per stream) and the span."""
  by_name = collections.defaultdict(float)
  count = collections.Counter()
  for e in events:
    by_name[e["name"]] += e["dur"] / 1e3
    count[e["name"]] += 1
  # Busy time: union of the events' intervals across streams (kernels on different streams may
  # overlap; idle = span - busy).
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
  busy = profile_e2e.union_length(spans)
  span = (spans[-1][1] - spans[0][0]) if spans else 0.0
  rows = sorted(((n, ms / steps, count[n] / steps) for n, ms in by_name.items()),
                key=lambda r: -r[1])
  return {"per_step_ms": [{"name": n, "ms": ms, "calls": c} for n, ms, c in rows],
          "busy_ms_per_step": busy / 1e3 / steps, "span_ms_per_step": span / 1e3 / steps,
          "events": len(events)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seq", type=int, default=65536)
  ap.add_argument("--cases", default="causal,docs")
  ap.add_argument("--impls", default="mosaic,cudnn")
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile"))
  args = ap.parse_args()
  h, kh, d = 32, 8, args.head_dim
  scale = d ** -0.5
  results = {"conditions": {"argv": sys.argv, **versions(), "seq": args.seq, "heads": h,
                            "kv_heads": kh, "head_dim": d, "dtype": "bfloat16",
                            "steps": args.steps}, "runs": {}}
  for case in args.cases.split(","):
    pos, seg, _ = layout(case, args.seq, args.seq)  # bench_attention's seed
    impls, _ = make_impls(case, pos, seg, scale, args.impls.split(","), heads=h,
                          head_dims=(d, d))
    key = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(key[0], (1, args.seq, h, d), jnp.bfloat16)
    k = jax.random.normal(key[1], (1, args.seq, kh, d), jnp.bfloat16)
    v = jax.random.normal(key[2], (1, args.seq, kh, d), jnp.bfloat16)
    cot = jax.random.normal(key[3], (1, args.seq, h, d), jnp.bfloat16)
    for name in args.impls.split(","):
      fn = impls.get(name)
      label = f"{case}/{name}"
      if name == "cudnn" and case == "docs" and args.seq > 32768:
        fn = "cuDNN sees documents only through a dense mask (not run above 32k)"
      if fn is None or isinstance(fn, str):
        results["runs"][label] = {"error": fn or "unknown implementation"}
        print(label, "skipped:", fn, flush=True)
        continue
      try:
        loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)
                                              * cot.astype(jnp.float32))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        with environment(getattr(fn, "env", {})):
          compiled = step.lower(q, k, v).compile()
        for _ in range(2):
          jax.block_until_ready(compiled(q, k, v))
        tmp = tempfile.mkdtemp(prefix="kvax_prof_")
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
          for _ in range(args.steps):
            out = compiled(q, k, v)
          jax.block_until_ready(out)
        summary = summarize(device_events(tmp), args.steps)
        shutil.rmtree(tmp, ignore_errors=True)
      except Exception as e:  # noqa: BLE001 - record and go on
        results["runs"][label] = {"error": repr(e)[:2000]}
        print(label, "failed:", repr(e)[:500], flush=True)
        continue
      results["runs"][label] = summary
      print(f"{label}: busy {summary['busy_ms_per_step']:.2f} ms / step, span "
            f"{summary['span_ms_per_step']:.2f} ms", flush=True)
      for r in summary["per_step_ms"][:14]:
        print(f"  {r['ms']:9.3f} ms  x{r['calls']:<4.0f} {r['name'][:90]}", flush=True)
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  with open(f"{args.out}.json", "w") as f:
    json.dump(results, f, indent=1)
  print("wrote", f"{args.out}.json")


if __name__ == "__main__":
  main()
