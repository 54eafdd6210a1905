"""One timing process of the speed gate (benchmarks/gate.py starts it; not a command of its own):

    PYTHONPATH=<tree> python -P benchmarks/gate_worker.py <spec.json>

It times the kvax_plugin of <tree> (PYTHONPATH; -P keeps this file's folder off sys.path) through
the public API that every commit under comparison has: kvax_plugin.create_attention_mask(pos,
seg, pos, seg, calc_bwd_mask=True) and kvax_plugin.flash_attention(q, k, v, pos, seg, pos, seg,
mask, scale=, backend=), forward and jax.grad of sum(out * dO) over q, k, v; so it imports no
module of the benchmarks package, which the other tree may not have. The layouts come from the
gate (benchmarks/cases.py) as .npz files named in the spec.

Per case: the mask build (jit of create_attention_mask) timed on its own, then the forward and
forward+backward, each taking the prebuilt mask as a jit argument: `warmup` untimed calls, then
`calls` rounds of back-to-back calls (about 20 ms each). Prints one line `GATE_RESULT {json}`
with the medians (ms per call).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import kvax_plugin

RESULT_PREFIX = "GATE_RESULT "


def round_times(fn, args, warmup: int, rounds: int, min_round_ms: float = 20.0) -> list[float]:
  """ms per call of each of `rounds` rounds after `warmup` untimed calls; a round is as many
  back-to-back calls as last about min_round_ms, waited for at its end (the loop of
  benchmarks/timing.round_ms; repeated here, see the docstring). Back to back, the GPU's time is
  measured, not the host's dispatch latency, which varies between processes by more than a
  millisecond-long call's differences."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  inner = max(1, int(min_round_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3 / inner)
  return times


def time_case(spec: dict, case: dict) -> dict[str, list[float]]:
  """ms of every timed call of one case: mask build, fwd, fwd_bwd."""
  arrays = np.load(case["layout"])
  pos, seg = jnp.asarray(arrays["positions"]), jnp.asarray(arrays["segment_ids"])
  batch, seq = pos.shape
  h, kh, d = spec["heads"], spec["kv_heads"], case.get("head_dim", spec["head_dim"])
  dtype = jnp.dtype(spec["dtype"])
  keys = jax.random.split(jax.random.PRNGKey(spec["seed"]), 4)
  q = jax.random.normal(keys[0], (batch, seq, h, d), dtype)
  k = jax.random.normal(keys[1], (batch, seq, kh, d), dtype)
  v = jax.random.normal(keys[2], (batch, seq, kh, d), dtype)
  d_out = jax.random.normal(keys[3], (batch, seq, h, d), dtype)
  scale = d ** -0.5
  backend = spec["backend"]
  warmup, calls = spec["warmup"], spec["calls"]

  build = jax.jit(lambda p, s: kvax_plugin.create_attention_mask(p, s, p, s, calc_bwd_mask=True))
  out = {"mask": round_times(build, (pos, seg), warmup, calls)}
  mask = build(pos, seg)

  def attend(q, k, v, p, s, mask):
    return kvax_plugin.flash_attention(q, k, v, p, s, p, s, mask, scale=scale, backend=backend)

  def loss(q, k, v, p, s, mask):
    return jnp.sum(attend(q, k, v, p, s, mask).astype(jnp.float32) * d_out.astype(jnp.float32))

  fns = {"fwd": jax.jit(attend), "fwd_bwd": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}
  for name in spec["passes"]:
    out[name] = round_times(fns[name], (q, k, v, pos, seg, mask), warmup, calls)
  return out


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else argv
  with open(argv[0]) as f:
    spec = json.load(f)
  dev = jax.devices()[0]
  result = dict(device_kind=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                jaxlib=getattr(jaxlib, "__version__", "?"),
                kvax_plugin_file=kvax_plugin.__file__, medians_ms={}, times_ms={})
  for case in spec["cases"]:
    for name, times in time_case(spec, case).items():
      key = f"{case['name']}/{name}"
      result["times_ms"][key] = times
      result["medians_ms"][key] = statistics.median(times)
      print(f"  {key:22s} {result['medians_ms'][key]:9.3f} ms", file=sys.stderr, flush=True)
  print(RESULT_PREFIX + json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
