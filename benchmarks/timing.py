"""How the benchmarks time a compiled call: rounds of back-to-back calls, medians, and the
round-robin that interleaves implementations so a drift of the GPU's clocks favours none.

Under a power cap a kernel's speed can depend on what ran just before it (one that drew less
power can leave the clocks higher for the next), so the round-robin varies the neighbours too: the
rounds follow a balanced Latin square (round_orders), in which every implementation runs right
after every other equally often. A plain rotation would keep each one's predecessor fixed.

    fwd_bwd(fn, cot)                     jit(grad(sum(fn(q, k, v) * cot))) over q, k, v
    time_fn(f, args, rounds, inner)      median ms per call over rounds of `inner` calls
    call_times(f, args, warmup, calls)   ms of each of `calls` single calls, each waited for
    round_orders(n, rounds)              the order of each round: a balanced Latin square
    interleave(timed, args, rounds, ...) the round-robin of bench_attention --interleave
    alternate(fns, args, rounds)         the same round-robin over {name: compiled call}
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.cases import FLOPS_FWD_BWD


def fwd_bwd(fn, cot):
  """jit(grad(sum(fn(q, k, v) * cot))) over q, k, v: the forward+backward every benchmark times
  (float32 sum, so the cotangent of fn's output is cot)."""
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cot),
                          argnums=(0, 1, 2)))


def one_pass(fn, cot, which: str, q, k, v):
  """A callable of (q, k, v) that runs `which` of fn: "fwd_bwd", fwd_bwd(fn, cot); "fwd",
  jit(fn); "bwd", the jitted vjp of fn's residuals at (q, k, v) applied to cot (the forward runs
  once, here, not in the call)."""
  if which == "fwd_bwd":
    return fwd_bwd(fn, cot)
  if which == "fwd":
    return jax.jit(fn)
  if which != "bwd":
    raise ValueError(f"which: expected 'fwd_bwd', 'fwd' or 'bwd', got {which!r}")
  _, vjp_fn = jax.vjp(jax.jit(fn), q, k, v)
  backward = jax.jit(lambda f, c: f(c))
  return lambda *_: backward(vjp_fn, cot)


def round_ms(fn, args, inner: int) -> float:
  """ms per call of one round: `inner` back-to-back calls, waited for at the end."""
  t0 = time.perf_counter()
  for _ in range(inner):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) * 1e3 / inner


def time_fn(fn, args, rounds: int, inner: int) -> float:
  """Median ms per call over `rounds` rounds of `inner` back-to-back calls (after warm-up)."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  return statistics.median([round_ms(fn, args, inner) for _ in range(rounds)])


def call_times(fn, args, warmup: int, calls: int) -> list[float]:
  """ms of each of `calls` calls after `warmup` untimed ones, each call waited for."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return times


def round_orders(n: int, rounds: int) -> list[list[int]]:
  """The order of n implementations in each of `rounds` rounds: the rows of a balanced (Williams)
  Latin square, repeated. Each implementation runs first equally often, and right after each
  other one equally often (every n rounds for even n, every 2n for odd n)."""
  if n < 1 or rounds < 0:
    raise ValueError(f"round_orders: expected n >= 1 and rounds >= 0, got n={n}, rounds={rounds}")
  # 0, 1, n-1, 2, n-2, ...: the successive differences are 1, -2, 3, -4, ... (mod n), all distinct.
  first = [0]
  for j in range(1, n):
    first.append((j + 1) // 2 if j % 2 else n - j // 2)
  square = [[(x + i) % n for x in first] for i in range(n)]
  if n % 2:
    square += [row[::-1] for row in square]
  return [square[r % len(square)] for r in range(rounds)]


def alternate(fns: dict, args, rounds: int, *, warmup: int = 3,
              min_round_ms: float = 20.0) -> dict:
  """{name: [ms per call of each round]}: after `warmup` calls of each, every round times one
  round of each of `fns` (as many back-to-back calls as fill about `min_round_ms`), in the orders
  of round_orders, so that neither a drift of the clocks nor a neighbour favours one."""
  inner = {}
  for name, fn in fns.items():
    for _ in range(warmup):
      jax.block_until_ready(fn(*args))
    inner[name] = max(1, int(min_round_ms / max(round_ms(fn, args, 1), 1e-3)))
  names, times = list(fns), {name: [] for name in fns}
  for order in round_orders(len(names), rounds):
    for i in order:
      times[names[i]].append(round_ms(fns[names[i]], args, inner[names[i]]))
  return times


def interleave(timed, args, rounds: int, flops_fwd: float) -> None:
  """Times the compiled implementations of each pass round-robin: per round one `inner`-call
  round of each, in the orders of round_orders; rows get ms (median of these rounds),
  ms_sequential (their one-by-one median) and tflops from the new ms."""
  for p, entries in timed.items():
    if len(entries) < 2:
      continue
    times = {name: [] for name, *_ in entries}
    for order in round_orders(len(entries), rounds):
      for name, f, inner, _ in (entries[i] for i in order):
        times[name].append(round_ms(f, args, inner))
    flops = flops_fwd * (1.0 if p == "fwd" else FLOPS_FWD_BWD)
    for name, _, _, row in entries:
      ms = statistics.median(times[name])
      row.update(ms_sequential=row["ms"], ms=ms, tflops=flops / ms / 1e9, interleaved=True,
                 ms_rounds=times[name])
      print(f"  {name:15s} {p:8s} {ms:9.3f} ms  {row['tflops']:7.1f} TF/s  (interleaved; "
            f"alone {row['ms_sequential']:.3f})", flush=True)
