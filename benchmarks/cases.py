"""The benchmarks' cases: row layouts, the (q, kv) pairs a mask keeps, inputs and FLOP counts.

One definition for every program that times attention (benchmarks/bench_attention.py and the
command around it, benchmarks/gate.py, the tools under benchmarks/tools/):

  "causal"  one causal document filling the row (segment id 0, positions 0..S-1);
  "docs"    num_docs (12) causal documents of random lengths over the first S - pad tokens
            (cuts drawn with numpy.random.default_rng(seed)), positions restarting at 0 in each,
            segment ids 0..num_docs-1, then pad (1000) padding tokens (segment id -1;
            positions 0 in the kernel table's rows, 0..pad-1 in the gate's: padding keeps no
            pair either way).

Effective TFLOP/s count only the (q, kv) pairs the mask keeps: forward 2 * H * (Dk + Dv) per
pair (4 * H * D when Dk = Dv), forward+backward FLOPS_FWD_BWD times that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PAD = -1
CASES = ("causal", "docs")
PASSES = ("fwd", "fwd_bwd")
FLOPS_FWD_BWD = 3.5  # forward+backward / forward: the backward does 2.5x the forward's products

# Attention features beyond the mask's causal / documents (--window, --soft-cap, --sinks): only
# our backends run them (the peers' rows say so), so the rows compare our backends.
NO_FEATURES = dict(window=None, soft_cap=None, sinks=False)


def documents_layout(seq: int, num_docs: int, pad: int, seed: int,
                     counted_padding: bool = False):
  """positions, segment ids int32 [1, seq] and the document lengths: num_docs random-length
  documents, then pad padding tokens (segment id PAD; positions 0, or 0..pad-1 when
  counted_padding)."""
  rng = np.random.default_rng(seed)
  body = seq - pad
  cuts = np.sort(rng.choice(np.arange(1, body), size=num_docs - 1, replace=False))
  lengths = np.diff(np.concatenate([[0], cuts, [body]]))
  seg = np.full(seq, PAD, np.int32)
  pos = np.zeros(seq, np.int32)
  start = 0
  for d, ln in enumerate(lengths):
    seg[start:start + ln] = d
    pos[start:start + ln] = np.arange(ln)
    start += ln
  if counted_padding:
    pos[body:] = np.arange(pad)
  return pos[None], seg[None], lengths


def layout(case: str, seq: int, seed: int, num_docs: int = 12, pad: int = 1000,
           counted_padding: bool = False):
  """(positions, segment ids, document lengths) of a case; "docs" = num_docs documents + pad."""
  if case == "causal":
    return np.arange(seq, dtype=np.int32)[None], np.zeros((1, seq), np.int32), np.array([seq])
  if case == "docs":
    return documents_layout(seq, num_docs, pad, seed, counted_padding)
  raise ValueError(f"case must be one of {CASES}, got {case!r}")


def kept_pairs(lengths, window: int | None = None) -> int:
  """Causal (q, kv) pairs kept in documents of these lengths; with a sliding window w, each
  query keeps min(its position + 1, w) of them."""
  lengths = np.asarray(lengths, np.int64)
  if window is None:
    return int(np.sum(lengths * (lengths + 1) // 2))
  w = np.minimum(lengths, window)
  return int(np.sum(w * (w + 1) // 2 + (lengths - w) * window))


def flops(pairs: int, heads: int, dk: int, dv: int, pass_: str) -> float:
  """FLOPs credited to one call: Q K^T (2 dk) and P V (2 dv) per kept pair and head; the
  forward+backward pass FLOPS_FWD_BWD times that."""
  fwd = 2.0 * heads * (dk + dv) * pairs
  return fwd * (1.0 if pass_ == "fwd" else FLOPS_FWD_BWD)


def parse_head_dims(spec: str) -> tuple[int, int]:
  """'128' -> (128, 128); '192:128' -> (192, 128): query / key and value head dims."""
  parts = spec.split(":")
  if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
    raise ValueError(f"--head-dims entry {spec!r}: expected D or DK:DV, e.g. 128 or 192:128")
  return int(parts[0]), int(parts[-1])


def random_inputs(seed: int, seq: int, heads: int, kv_heads: int, dk: int, dv: int, dtype,
                  batch: int = 1):
  """q [B, S, H, Dk], k [B, S, KH, Dk], v [B, S, KH, Dv] and the output's cotangent
  [B, S, H, Dv], standard normal in `dtype` (jax.random, key `seed`)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (batch, seq, heads, dk), dtype)
  k = jax.random.normal(keys[1], (batch, seq, kv_heads, dk), dtype)
  v = jax.random.normal(keys[2], (batch, seq, kv_heads, dv), dtype)
  cot = jax.random.normal(keys[3], (batch, seq, heads, dv), dtype)
  return q, k, v, cot


def dense_mask(pos, seg):
  """[B, S, S] boolean: query i keeps key j of its own document (not padding) at or before it;
  what cuDNN takes for documents, and the tests' reference."""
  pos, seg = jnp.asarray(pos), jnp.asarray(seg)
  s = seg[:, :, None]
  return (s == seg[:, None, :]) & (s != PAD) & (pos[:, None, :] <= pos[:, :, None])
