"""The GPU's SM clock and power draw while each implementation runs, in alternating windows.

    python -m benchmarks.tools.clocks_power [--seq 65536] [--case causal|docs]
        [--impls auto,fa3] [--pass fwd_bwd|fwd|bwd] [--windows 4] [--window-s 4]
        [--gap-s G] [--gpu-index I] [--out F]

Asks whether a same-run speed difference comes from the work per clock cycle or from the clock
the GPU holds under each kernel (a kernel that draws more power is clocked down by the power
cap). Each implementation's forward+backward (jit(grad(sum(out * dO))), the mask prebuilt, as
benchmarks/bench_attention.py times it; --pass fwd: the jitted forward alone; --pass bwd: the
jitted vjp of one forward's residuals) is called back to back for about --window-s seconds (as
many calls as one timed call says fill it), the implementations alternating window by window
with the order reversed every other round, a pause of 0.5 s between windows; nvidia-smi samples
the SM clock, the power draw and the active clock throttle reasons every 50 ms meanwhile, each
sample placed by its own timestamp. Per implementation: the median ms per call over its
windows and, over the samples from 1 s into each of its windows to its end, the median clock,
the median power and the throttle reasons seen (NVML bits: 0x1 idle, 0x4 software power cap,
0x20 / 0x40 thermal). Cycles per call = ms x clock; joules per call = ms x power.

--gap-s G asks the same of a GPU that is not held at its power cap: each window is then one call,
timed alone after G seconds idle, and every sample inside the call is kept. Back-to-back windows
give the speed of sustained training; the idle gaps give the work per cycle with the power cap
(mostly) out of the way, as a profiler's replay of one kernel sees it.

nvidia-smi does not follow CUDA_VISIBLE_DEVICES: it is asked for one GPU by index (--gpu-index;
default the first entry of CUDA_VISIBLE_DEVICES, else 0), so that another job on another GPU of
the host does not enter the samples. The raw samples are saved with the result.

Shapes: B=1, 32 query / 8 kv heads, head dim 128, bf16; the cases of benchmarks/cases.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's, in the machine's local time
SAMPLE_MS = 50
PASSES = ("fwd_bwd", "fwd", "bwd")
SETTLE_S = 1.0  # samples this long into a window are dropped (the clock moving to its level)


def parse_sample(line: str) -> dict | None:
  """One nvidia-smi CSV line (QUERY, no units): t, the sample's own time (seconds since the epoch,
  as time.time()), and the numbers; None where a field does not parse. The sample's time is
  nvidia-smi's, not when the line is read: writing into a pipe, nvidia-smi buffers its output,
  and lines arrive seconds late in bursts."""
  parts = [x.strip() for x in line.split(",")]
  try:
    return dict(t=datetime.datetime.strptime(parts[0], TIMESTAMP).timestamp(),
                sm_clock_mhz=float(parts[1]), power_w=float(parts[2]),
                temperature_c=float(parts[3]), throttle=parts[4])
  except (ValueError, IndexError):
    return None


def gpu_index(visible: str | None) -> int:
  """nvidia-smi's index of the GPU this process runs on: the first entry of CUDA_VISIBLE_DEVICES
  (visible) where it is a number, else 0 (refused where it names a GPU by UUID)."""
  first = (visible or "0").split(",")[0].strip() or "0"
  if not first.isdigit():
    raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r}: name the GPU with --gpu-index")
  return int(first)


def summarize(windows: list[dict], samples: list[dict], settle_s: float = SETTLE_S) -> dict:
  """Per implementation: median ms over its windows ({impl, t0, t1, ms}), and over the samples
  (parse_sample's) from settle_s into each of its windows to the window's end: the median clock
  and power, the mean clock (the cap moves the clock in steps; the mean weighs them), the
  throttle reasons seen, the sample count, the cycles (at the median clock) and the joules per
  call."""
  out = {}
  for impl in dict.fromkeys(w["impl"] for w in windows):
    mine = [w for w in windows if w["impl"] == impl]
    kept = [s for s in samples if any(w["t0"] + settle_s <= s["t"] <= w["t1"] for w in mine)]
    ms = statistics.median(w["ms"] for w in mine)
    clock = statistics.median(s["sm_clock_mhz"] for s in kept) if kept else None
    power = statistics.median(s["power_w"] for s in kept) if kept else None
    out[impl] = dict(
        ms=ms, sm_clock_mhz=clock, power_w=power,
        sm_clock_mhz_mean=statistics.mean(s["sm_clock_mhz"] for s in kept) if kept else None,
        throttle=sorted({s["throttle"] for s in kept}), samples=len(kept),
        mcycles_per_call=ms * clock / 1e3 if clock else None,
        joules_per_call=ms * power / 1e3 if power else None)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq", type=int, default=65536)
  ap.add_argument("--case", choices=("causal", "docs"), default="causal")
  ap.add_argument("--impls", default="auto,fa3", help="benchmarks.impls names, comma-separated")
  ap.add_argument("--pass", dest="pass_", choices=PASSES, default="fwd_bwd",
                  help="what each call runs: forward+backward, the forward, or the backward")
  ap.add_argument("--windows", type=int, default=4, help="windows per implementation")
  ap.add_argument("--window-s", type=float, default=4.0)
  ap.add_argument("--gap-s", type=float, default=None,
                  help="one call per window after this many seconds idle (default: windows of "
                  "back-to-back calls)")
  ap.add_argument("--gpu-index", type=int, default=None,
                  help="nvidia-smi's index of the GPU timed (default: CUDA_VISIBLE_DEVICES's "
                  "first)")
  ap.add_argument("--out", help="results file (JSON)")
  args = ap.parse_args(argv)
  try:
    index = args.gpu_index if args.gpu_index is not None else gpu_index(
        os.environ.get("CUDA_VISIBLE_DEVICES"))
  except ValueError as e:
    ap.error(str(e))
  if args.windows < 1:
    ap.error(f"--windows {args.windows}: expected >= 1")
  if args.gap_s is None and args.window_s <= SETTLE_S:
    ap.error(f"--window-s {args.window_s}: expected > {SETTLE_S} (the settling time)")
  if args.gap_s is not None and args.gap_s <= 0:
    ap.error(f"--gap-s {args.gap_s}: expected > 0 seconds")

  import jax
  import jax.numpy as jnp

  from benchmarks.cases import layout, random_inputs
  from benchmarks.impls import make_impls
  from benchmarks.timing import one_pass

  names = args.impls.split(",")
  pos, seg, _ = layout(args.case, args.seq, seed=args.seq)
  fns, _ = make_impls(args.case, pos, seg, 128 ** -0.5, names)
  q, k, v, cot = random_inputs(args.seq + 128, args.seq, 32, 8, 128, 128, jnp.bfloat16)
  compiled = {}
  for name in names:
    if isinstance(fns.get(name), str) or name not in fns:
      ap.error(f"--impls {name}: {fns.get(name, 'unknown')}")
    compiled[name] = one_pass(fns[name], cot, args.pass_, q, k, v)
    for _ in range(3):
      jax.block_until_ready(compiled[name](q, k, v))
  # Calls are dispatched asynchronously: a window enqueues the number of calls that fills about
  # --window-s (from one timed call), then waits for them; with --gap-s a window is one call.
  calls = dict.fromkeys(names, 1)
  for name in names if args.gap_s is None else ():
    t0 = time.perf_counter()
    jax.block_until_ready(compiled[name](q, k, v))
    calls[name] = max(1, round(args.window_s / (time.perf_counter() - t0)))

  samples: list[dict] = []
  command = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             "-i", str(index), "-lms", str(SAMPLE_MS)]
  if shutil.which("stdbuf"):  # line-buffered, so that terminating it loses no buffered samples
    command = ["stdbuf", "-oL"] + command
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)

  def read():
    for line in proc.stdout:
      sample = parse_sample(line)
      if sample is not None:
        samples.append(sample)
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  windows = []
  pause = 0.5 if args.gap_s is None else args.gap_s
  try:
    time.sleep(pause)
    for r in range(args.windows):
      for name in (names if r % 2 == 0 else names[::-1]):
        t0 = time.time()
        for _ in range(calls[name]):
          out = compiled[name](q, k, v)
        jax.block_until_ready(out)
        t1 = time.time()
        windows.append(dict(impl=name, t0=t0, t1=t1, calls=calls[name],
                            ms=(t1 - t0) * 1e3 / calls[name]))
        print(f"{name}: {windows[-1]['ms']:.3f} ms per call", flush=True)
        time.sleep(pause)
  finally:
    time.sleep(1.0)
    proc.terminate()
    reader.join(timeout=5.0)
  result = dict(
      conditions=dict(
          date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          gpu=jax.devices()[0].device_kind, jax=jax.__version__, seq=args.seq, case=args.case,
          shapes=dict(batch=1, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16"),
          windows=args.windows, window_s=args.window_s, sample_ms=SAMPLE_MS, settle_s=SETTLE_S,
          nvidia_smi_index=index, timed_pass=args.pass_, gap_s=args.gap_s,
          timed={"fwd_bwd": "jit(grad(sum(out * dO))) over q, k, v",
                 "fwd": "jit(forward)", "bwd": "jit(vjp) of one forward's residuals"}[args.pass_]
          + ", the mask prebuilt; " + ("back to back" if args.gap_s is None else
                                       f"one call after {args.gap_s} s idle")),
      result=summarize(windows, samples, SETTLE_S if args.gap_s is None else 0.0),
      windows=windows,
      samples=samples)
  print(json.dumps(result["result"], indent=1))
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
