"""Where a profiled MaxText training step's GPU time goes: kernels summed by category.

    python -m benchmarks.tools.profile_e2e outputs/e2e/16k-long_kvax                   # one run
    python -m benchmarks.tools.profile_e2e outputs/e2e/16k-long_kvax outputs/e2e/16k-long_cudnn_flash_jax
    python -m benchmarks.tools.profile_e2e path/to/host.xplane.pb --steps 2 --json out.json

Reads the xplane trace that MaxText's own profiler writes (maxtext_e2e.py --profile: profiler=
xplane; the launcher puts it at <run dir>/tensorboard/plugins/profile/<timestamp>/<host>.xplane.pb)
with jax.profiler.ProfileData (jaxlib's own XSpace parser; no xprof / TensorBoard needed). Per GPU
device plane ("/device:GPU:N") it takes the CUDA kernel (and memcpy / memset) executions and sums
their durations per category: attention (kvax custom calls), attention (cuDNN), attention (other
Pallas kernels, e.g. MaxText's tokamax flash), matmul, collectives, memcpy / memset, other
fusions; plus busy time (union of the kernels' intervals over all streams), the span from the
first kernel's start to the last one's end, idle = span - busy, and the top kernels by time. All
numbers are per profiled step (the trace's StepTraceAnnotation "train" events, or --steps).

A trace without a GPU plane (CPU runs) gives the same structure from the host plane's XLA op
events (self time, so a while loop does not count its body twice; ops run on several threads, so
categories may add up to more than the span), or an "error" entry saying there is none.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import warnings
from pathlib import Path

# jaxlib's stats iterators warn once per type ("builtin type ... has no __module__ attribute").
warnings.filterwarnings("ignore", message="builtin type .* has no __module__",
                        category=DeprecationWarning)

ATTN_KVAX = "attention (kvax custom calls)"
ATTN_CUDNN = "attention (cuDNN)"
ATTN_PALLAS = "attention (other Pallas kernels)"
MATMUL = "matmul"
COLLECTIVES = "collectives"
MEMCPY = "memcpy / memset"
OTHER = "other fusions"
CATEGORIES = (ATTN_KVAX, ATTN_CUDNN, ATTN_PALLAS, MATMUL, COLLECTIVES, MEMCPY, OTHER)

# kvax's kernels as the GPU names them: Mosaic GPU kernels are "<pallas kernel fn>_mosaic_gpu_
# kernel" (entry_mosaic_gpu_kernel, entry_no_dq_mosaic_gpu_kernel); the Triton backend's are its @triton.jit functions
# (kvax_plugin/attention/kernels/triton: attn_fwd_kernel, attn_bwd_{dq,dkv,delta}_kernel).
# The "hopper" backward is CUDA: kvax_sm90::fused_backward_kernel<N> (kernels/cuda_sm90).
# Note: tokamax's Mosaic GPU attention would also match "mosaic_gpu"; MaxText's GPU `flash` is
# tokamax's Pallas-Triton kernel (pallas_flash_attention*), which has its own category.
_KVAX = re.compile(r"mosaic_gpu|kvax_sm90|\battn_(fwd|bwd_dq|bwd_dkv|bwd_delta)_kernel")
_PALLAS = re.compile(r"pallas")
# cuDNN's SDPA: cudnn_generated_fort_native_sdpa_sm90_flash_{fprop,bprop}_..., and its helpers
# cudnn::fusion::{compute_dot_do_o_specialized, convert_dq_to_16bits, fmha_reduce_head}.
_CUDNN = re.compile(r"cudnn|fmha|sdpa|flash")
_COLLECTIVE = re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|allreduce|allgather|reducescatter")
# cuBLAS / cuBLASLt (nvjet_*, sm90_xmma_gemm_*, *gemm*), CUTLASS, XLA's Triton GEMM fusions
# (gemm_fusion_dot...), and on CPU the HLO dots / convolutions (dot.3, dot_fusion).
_MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|(^|[^a-z])dot([^a-z]|$)|"
                     r"convolution")
_MEMCPY = re.compile(r"^(memcpy|memset)")


# First matching rule wins, in this order (cuDNN's "flash" would also match MaxText's Pallas
# "pallas_flash_attention"; memcpy / memset names carry no matmul words, but keep them apart).
_RULES = ((_COLLECTIVE, COLLECTIVES), (_KVAX, ATTN_KVAX), (_PALLAS, ATTN_PALLAS),
          (_CUDNN, ATTN_CUDNN), (_MEMCPY, MEMCPY), (_MATMUL, MATMUL))


def categorize(name: str) -> str:
  """The category of one kernel (or XLA op) name: the first of _RULES that matches, else
  "other fusions"."""
  n = name.lower()
  return next((category for rule, category in _RULES if rule.search(n)), OTHER)


def find_xplanes(path) -> list[Path]:
  """The .xplane.pb files of the newest profile under `path` (a file, a run directory, or
  any directory above plugins/profile/<timestamp>/); several only for several hosts."""
  p = Path(path)
  if p.is_file():
    return [p]
  found = [Path(f) for f in glob.glob(os.path.join(str(p), "**", "*.xplane.pb"), recursive=True)]
  if not found:
    return []
  newest = max(found, key=lambda f: (f.parent.name, f.stat().st_mtime))
  return sorted(f for f in found if f.parent == newest.parent)


def union_length(intervals) -> float:
  """Total length covered by (start, end) intervals, overlaps counted once."""
  total, cur_s, cur_e = 0.0, None, None
  for s, e in sorted(intervals):
    if cur_e is None or s > cur_e:
      if cur_e is not None:
        total += cur_e - cur_s
      cur_s, cur_e = s, e
    else:
      cur_e = max(cur_e, e)
  if cur_e is not None:
    total += cur_e - cur_s
  return total


def _self_times(events) -> list[tuple]:
  """(name, start, end, self_ns, stats) per event of one line: duration less the direct
  children's (host lines nest: a while loop holds its body's ops; GPU streams do not)."""
  evs = sorted(events, key=lambda e: (e[1], -(e[2] - e[1])))
  selfs = [e[2] - e[1] for e in evs]
  stack = []
  for i, (_, s, t, _) in enumerate(evs):
    while stack and evs[stack[-1]][2] <= s:
      stack.pop()
    if stack:
      parent = stack[-1]
      selfs[parent] -= min(t, evs[parent][2]) - s
    stack.append(i)
  return [(n, s, t, max(selfs[i], 0.0), st) for i, (n, s, t, st) in enumerate(evs)]


# Lines of a GPU plane that are not CUDA activity records (xprof's derived timelines, CUPTI's
# own overhead, counters); only used when no "Stream #" line is found.
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Async XLA Ops", "Steps", "Framework Name Scope",
                  "Framework Ops", "Source code", "XLA TraceMe", "Launch Stats", "CUPTI overhead",
                  "_counters_")


def _gpu_kernel_lines(plane) -> list:
  # The CUPTI collector (xla/backends/profiler/gpu/cupti_collector.cc) puts every device-side
  # activity record -- kernel executions with their GPU start / end, memcpys, memsets -- on one
  # line per CUDA stream, named "Stream #<id>(<event types>)", e.g. "Stream #13(Kernel,Memset)".
  # Those are the lines to sum. Other lines on the plane are not executions: "CUPTI overhead",
  # counter lines, and (when the trace was post-processed) xprof's derived "XLA Ops" / "XLA
  # Modules" / "Steps" lines, which repeat the same kernels grouped by HLO op and would count
  # them twice. Kernel launches (cuLaunchKernel, host-side) live on the host plane, not here.
  lines = [ln for ln in plane.lines if ln.name.startswith("Stream #")]
  if lines:
    return lines
  return [ln for ln in plane.lines if ln.name and not ln.name.startswith(_DERIVED_LINES)]


def _summarize_events(events, steps: int) -> dict:
  """events: (name, start_ns, end_ns, self_ns, stats dict). Per-step ms by category, busy,
  span, idle, the top kernels and (when the events say) the XLA modules."""
  per_cat = dict.fromkeys(CATEGORIES, 0.0)
  by_name = collections.defaultdict(float)
  calls = collections.Counter()
  modules = collections.defaultdict(float)
  compute = []  # (start, end) of every kernel that is not a collective
  for name, start, end, self_ns, stats in events:
    category = categorize(name)
    per_cat[category] += self_ns
    if category != COLLECTIVES:
      compute.append((start, end))
    by_name[name] += self_ns
    calls[name] += 1
    if stats.get("hlo_module"):
      modules[str(stats["hlo_module"])] += self_ns
  busy = union_length((s, t) for _, s, t, _, _ in events)
  # Busy time without the collectives: busy minus this is the collectives' exposed time (the
  # part no other kernel overlaps).
  busy_compute = union_length(compute)
  span = (max(e[2] for e in events) - min(e[1] for e in events)) if events else 0.0
  ms = lambda ns: round(ns / 1e6 / steps, 4)  # noqa: E731
  top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
  return {
      "per_step_ms": {c: ms(v) for c, v in per_cat.items()},
      "kernel_sum_ms_per_step": ms(sum(per_cat.values())),
      "busy_ms_per_step": ms(busy), "span_ms_per_step": ms(span),
      "collectives_exposed_ms_per_step": ms(busy - busy_compute),
      "idle_ms_per_step": ms(span - busy), "events": len(events),
      "top_kernels": [{"name": n, "category": categorize(n), "ms_per_step": ms(v),
                       "calls_per_step": round(calls[n] / steps, 2)} for n, v in top],
      "modules_ms_per_step": {m: ms(v) for m, v in
                              sorted(modules.items(), key=lambda kv: -kv[1])[:5]},
  }


def _stats(event) -> dict:
  try:
    return dict(event.stats)
  except Exception:  # noqa: BLE001 - a stat the binding cannot convert: go without
    return {}


def _profiled_steps(space) -> list[int]:
  """step_num of MaxText's StepTraceAnnotation("train", step_num=...) events on the host."""
  steps = set()
  for plane in space.planes:
    if not plane.name.startswith("/host:"):
      continue
    for line in plane.lines:
      for e in line.events:
        if e.name == "train":
          n = _stats(e).get("step_num")
          if n is not None:
            steps.add(int(n))
  return sorted(steps)


def _window_ns(space) -> float | None:
  """The profiler's on-to-off wall time (the "Task Environment" plane's start / stop stats)."""
  for plane in space.planes:
    if plane.name == "Task Environment":
      st = dict(plane.stats)
      try:
        return float(int(st["profile_stop_time"]) - int(st["profile_start_time"]))
      except (KeyError, ValueError, TypeError):
        return None
  return None


def summarize_xplane(path_or_dir, steps: int | None = None, host_fallback: bool = True) -> dict:
  """Per-step GPU time by kernel category for the newest trace under `path_or_dir`.

  Returns {"xplane", "steps", "steps_source", "source", "per_step_ms" {category: ms},
  "kernel_sum_ms_per_step", "busy_ms_per_step", "span_ms_per_step", "idle_ms_per_step",
  "window_ms_per_step", "events", "top_kernels" [15], "modules_ms_per_step", "devices"
  {plane: the same numbers}}; top-level numbers are the mean over the GPU devices. Without a
  GPU plane the host plane's XLA ops stand in (CPU runs; host_fallback=False: a GPU run whose
  trace lacks its device plane, e.g. without CUPTI, gets an error instead of host launch times).
  Without a trace, or with neither: {"error": ..., ...}; never raises for a missing or
  unreadable trace."""
  files = find_xplanes(path_or_dir)
  if not files:
    return {"error": f"no .xplane.pb under {path_or_dir}"}
  path = files[0]
  try:
    from jax.profiler import ProfileData
    space = ProfileData.from_file(str(path))
  except Exception as e:  # noqa: BLE001
    return {"error": f"cannot read {path}: {e!r}"[:2000], "xplane": str(path)}
  out = {"xplane": str(path)}
  if len(files) > 1:
    out["other_hosts_not_read"] = [str(f) for f in files[1:]]
  marked = _profiled_steps(space)
  if steps:
    out.update(steps=int(steps), steps_source="argument")
  elif marked:
    out.update(steps=len(marked), steps_source=f"trace (StepTraceAnnotation 'train' {marked})")
  else:
    out.update(steps=1, steps_source="assumed 1 (no step annotations; pass steps)")
  if marked:
    out["trace_step_nums"] = marked
  n = out["steps"]
  window = _window_ns(space)
  out["window_ms_per_step"] = round(window / 1e6 / n, 4) if window else None
  planes = list(space.planes)
  gpu = [p for p in planes if re.fullmatch(r"/device:GPU:\d+", p.name)]
  devices = {}
  for plane in gpu:
    lines = _gpu_kernel_lines(plane)
    events = [(e.name, e.start_ns, e.end_ns, e.duration_ns, _stats(e))
              for ln in lines for e in ln.events if e.duration_ns > 0]
    summary = _summarize_events(events, n)
    summary["kernel_lines"] = sorted({ln.name for ln in lines})
    devices[plane.name] = summary
  if gpu:
    out["source"] = "GPU device planes: CUPTI activity lines 'Stream #N(...)'"
  else:
    host = [p for p in planes if p.name == "/host:CPU"] if host_fallback else []
    events = []
    for plane in host:
      for ln in plane.lines:
        ops = [(e.name, e.start_ns, e.end_ns, _stats(e)) for e in ln.events if e.duration_ns > 0]
        events += _self_times([o for o in ops if "hlo_op" in o[3]])
    if not events:
      out["error"] = (f"no GPU device plane in {path} (planes: {[p.name for p in planes]}"
                      + ("; no XLA op events on the host plane either)" if host_fallback else ")"))
      return out
    out["source"] = (f"no GPU device plane in {path}: host XLA op events (self time; ops on "
                     "several CPU threads overlap, so categories may add up to more than the span)")
    devices["/host:CPU"] = _summarize_events(events, n)
  out["devices"] = devices
  out.update(_mean(list(devices.values())))
  return out


def _mean(summaries: list[dict]) -> dict:
  """Numbers averaged over devices; top kernels and modules are the first device's."""
  first = dict(summaries[0])
  first.pop("kernel_lines", None)
  if len(summaries) == 1:
    return first
  k = len(summaries)
  for key in ("kernel_sum_ms_per_step", "busy_ms_per_step", "span_ms_per_step",
              "idle_ms_per_step", "collectives_exposed_ms_per_step"):
    first[key] = round(sum(s[key] for s in summaries) / k, 4)
  first["per_step_ms"] = {c: round(sum(s["per_step_ms"][c] for s in summaries) / k, 4)
                          for c in CATEGORIES}
  first["events"] = sum(s["events"] for s in summaries)
  return first


ROWS = CATEGORIES + ("kernel_sum", "busy", "idle", "span", "window")


def _row_value(summary: dict, row: str):
  if row in CATEGORIES:
    return summary.get("per_step_ms", {}).get(row)
  return summary.get(f"{row}_ms_per_step")


def format_summary(label: str, s: dict) -> str:
  """One run's table: ms per step by category, busy / idle / span, top kernels."""
  if "error" in s:
    return f"{label}: {s['error']}"
  out = [f"{label}: {s['steps']} profiled step(s) ({s['steps_source']}); {s['source']}",
         f"  {s['xplane']}"]
  busy = s.get("busy_ms_per_step") or 0
  for row in ROWS:
    v = _row_value(s, row)
    share = f"{100 * v / busy:5.1f}% of busy" if row in CATEGORIES and busy and v else ""
    out.append(f"  {row:34s} {_fmt(v)} ms/step  {share}")
  out.append("  top kernels (ms/step, calls/step):")
  for k in s.get("top_kernels", []):
    out.append(f"    {k['ms_per_step']:9.3f}  x{k['calls_per_step']:<6g} [{k['category']}] "
               f"{k['name'][:100]}")
  return "\n".join(out)


def _fmt(v) -> str:
  return f"{v:10.3f}" if isinstance(v, (int, float)) else f"{'-':>10s}"


def format_comparison(labels, a: dict, b: dict) -> str:
  """Side by side, ms per step: a, b, a - b per category and for busy / idle / span."""
  la, lb = labels
  if "error" in a or "error" in b:
    return "comparison skipped: " + "; ".join(s["error"] for s in (a, b) if "error" in s)
  w = max(12, len(la), len(lb))
  out = [f"  {'ms / step':34s} {la:>{w}s} {lb:>{w}s} {'difference':>12s}"]
  for row in ROWS:
    va, vb = _row_value(a, row), _row_value(b, row)
    diff = (f"{va - vb:+12.3f}" if isinstance(va, (int, float)) and isinstance(vb, (int, float))
            else f"{'-':>12s}")
    out.append(f"  {row:34s} {_fmt(va):>{w}s} {_fmt(vb):>{w}s} {diff}")
  return "\n".join(out)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("paths", nargs="+", help="run directories (or .xplane.pb files)")
  ap.add_argument("--steps", type=int, default=None,
                  help="profiled steps (default: counted from the trace's 'train' annotations)")
  ap.add_argument("--json", default=None, help="also write the summaries here")
  args = ap.parse_args(argv)
  labels = [Path(p).name or str(p) for p in args.paths]
  summaries = [summarize_xplane(p, steps=args.steps) for p in args.paths]
  for label, s in zip(labels, summaries):
    print(format_summary(label, s))
    print()
  if len(summaries) == 2:
    print(f"{labels[0]} - {labels[1]}:")
    print(format_comparison(labels, *summaries))
  if args.json:
    Path(args.json).write_text(json.dumps(dict(zip(labels, summaries)), indent=1))
  return 0 if all("error" not in s for s in summaries) else 1


if __name__ == "__main__":
  sys.exit(main())
