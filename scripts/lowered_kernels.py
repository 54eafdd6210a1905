"""Fingerprints of the Mosaic GPU kernels as lowered for CUDA (no GPU needed), to show that a
refactor leaves the kernels a GPU run has verified unchanged.

    .venv/bin/python scripts/lowered_kernels.py --out /tmp/after      # one file + digest per case
    diff <(cat /tmp/before/digests.txt) <(cat /tmp/after/digests.txt)

For each case (head dims 64 / 96 / 128 / 192-128 / 256; deterministic and fused backward; soft
cap, sliding window, sinks) it lowers forward + backward of a small packed-documents batch and
writes the StableHLO text, serialized Mosaic kernels included. Source locations are dropped
before tracing (every equation gets an empty source info), and the kernel hash attribute is
removed, so the text depends on the kernels alone, not on file paths or line numbers; run it on
two checkouts (e.g. `git worktree add`; each run imports its own checkout). Kernel symbols are
numbered in lowering order within a process (entry_0, entry_1, ...), so compare runs made with
the same --only. The kernels are lowered with the default KernelOptions (no environment
variable changes them).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's kvax_plugin, tests/layouts.py
import layouts  # noqa: E402  (tests/layouts.py: the packed-documents batches the tests use)

from kvax_plugin.attention.block_mask import create_attention_mask  # noqa: E402
from kvax_plugin.attention.kernels.mosaic import backend as mosaic  # noqa: E402

DIMS = ((128, 128), (64, 64), (192, 128), (256, 256), (96, 96))
# (soft cap, sliding window, sinks)
OPTIONS = ((None, None, False), (None, None, True), (None, 100, False), (30.0, None, False),
           (30.0, 100, False))


def cases():
  for dk, dv in DIMS:
    for det in (True, False):
      for cap, window, sinks in OPTIONS:
        name = f"d{dk}_{dv}_det{int(det)}_cap{cap}_w{window}_s{int(sinks)}"
        yield name, dict(dk=dk, dv=dv, det=det, cap=cap, window=window, sinks=sinks)


def lowered_text(dk, dv, det, cap, window, sinks, s_len=512, h=4, kh=2) -> str:
  """The lowered forward + backward with source locations and the kernel hash removed."""
  pos, seg = layouts.packed_documents(np.random.default_rng(0), 1, s_len, num_docs=3,
                                      pad_tail=9)
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)
  q = jnp.zeros((1, s_len, h, dk), jnp.bfloat16)
  k = jnp.zeros((1, s_len, kh, dk), jnp.bfloat16)
  v = jnp.zeros((1, s_len, kh, dv), jnp.bfloat16)
  sink_logits = jnp.zeros((h,), jnp.float32) if sinks else None
  mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, sliding_window=window)

  def fwd_bwd(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: mosaic.flash_attention_mosaic(
        q, k, v, pos, seg, pos, seg, mask, scale=0.1, logits_soft_cap=cap, sinks=sink_logits,
        deterministic_backward=det), q, k, v)
    return out, vjp(out)

  current = source_info_util.current
  source_info_util.current = source_info_util.new_source_info  # no file / line anywhere
  try:
    text = jax.jit(fwd_bwd).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    source_info_util.current = current
  return re.sub(r'kernel_hash = "[^"]*"', "", text)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True, help="folder for <case>.txt files and digests.txt")
  ap.add_argument("--only", default="", help="only cases whose name contains this")
  args = ap.parse_args()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  lines = []
  for name, kw in cases():
    if args.only not in name:
      continue
    text = lowered_text(**kw)
    (out / f"{name}.txt").write_text(text)
    lines.append(f"{name} {hashlib.md5(text.encode()).hexdigest()}")
    print(lines[-1], flush=True)
  if not lines:
    ap.error(f"--only {args.only!r}: no case matches")
  (out / "digests.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
