"""The demonstration: packed real text -> block mask -> forward + backward -> checks and pictures.

    python -m kvax_plugin.demo            # the defaults below: ~30 s of CPU time on 2 cores
    python -m kvax_plugin.demo --seq_len 4096 --batch 1 --backend jax --out outputs/demo4k

Runs --backend (default "auto") against the float32 dense reference on a packed batch of the
shipped corpus and writes the mask PNGs and summary.json under --out. Exit status: 0 when every
output and gradient agrees within its dtype's tolerance, 1 otherwise, 2 for a bad flag or an
unavailable backend.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kvax_plugin
from kvax_plugin.attention.kernels import AUTO_DESCRIPTION, BACKENDS, resolve_backend_for
from kvax_plugin.data import ByteTokenizer, PackedBatch, batch_iterator, load_documents, to_kvax

# Relative L2 error allowed against the float32 reference, per input dtype.
REL_L2_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
EMBED_DIM = 256


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m kvax_plugin.demo",
      description="Packed real text through kvax_plugin attention: mask sparsity, timing, "
                  "agreement with the float32 reference, and the block mask as a PNG.")
  p.add_argument("--seq_len", type=int, default=2048, help="tokens per packed row")
  p.add_argument("--batch", type=int, default=2, help="packed rows in the batch")
  p.add_argument("--heads", type=int, default=8, help="query heads H")
  p.add_argument("--kv_heads", type=int, default=2, help="key/value heads K (H %% K == 0)")
  p.add_argument("--head_dim", type=int, default=64, help="head dim D (multiple of 16, <= 256)")
  p.add_argument("--backend", default="auto", choices=list(BACKENDS),
                 help=f"attention backend; {AUTO_DESCRIPTION}")
  p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                 help="q/k/v dtype; auto = bfloat16 on a GPU, float32 otherwise")
  p.add_argument("--sliding_window", type=int, default=None, help="optional sliding window")
  p.add_argument("--min_doc_chars", type=int, default=64,
                 help="shortest target document length in characters (see kvax_plugin.data)")
  p.add_argument("--max_doc_chars", type=int, default=1024,
                 help="longest target document length; the demo keeps documents short so a "
                      "row holds several and the mask shows blocks skipped between them")
  p.add_argument("--seed", type=int, default=0, help="seeds packing, embeddings and projections")
  p.add_argument("--repeats", type=int, default=3, help="timed runs after warm-up (median)")
  p.add_argument("--out", default="outputs/demo", help="folder for the PNGs and summary.json")
  return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
  for name in ("seq_len", "batch", "heads", "kv_heads", "head_dim", "repeats"):
    if getattr(a, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
  if a.heads % a.kv_heads:
    p.error(f"--heads ({a.heads}) must be a multiple of --kv_heads ({a.kv_heads})")
  if a.head_dim % 16 or a.head_dim > 256:
    p.error(f"--head_dim must be a multiple of 16 in [16, 256], got {a.head_dim}")
  if not 1 <= a.min_doc_chars <= a.max_doc_chars:
    p.error(f"--min_doc_chars ({a.min_doc_chars}) must be >= 1 and <= --max_doc_chars "
            f"({a.max_doc_chars})")
  if a.sliding_window is not None and a.sliding_window < 1:
    p.error(f"--sliding_window must be >= 1, got {a.sliding_window}")


def project_qkv(tokens: np.ndarray, heads: int, kv_heads: int, head_dim: int, dtype,
                seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Random byte embeddings of `tokens` [B, S], projected (scaled to unit variance) to q
  [B, S, H, D], k and v [B, S, K, D]."""
  ke, kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 4)
  embed = jax.random.normal(ke, (ByteTokenizer.vocab_size, EMBED_DIM), jnp.float32)
  x = embed[jnp.asarray(tokens)]
  b, s = tokens.shape

  def proj(key, n):
    w = jax.random.normal(key, (EMBED_DIM, n * head_dim), jnp.float32) * EMBED_DIM ** -0.5
    return (x @ w).reshape(b, s, n, head_dim).astype(dtype)

  return proj(kq, heads), proj(kk, kv_heads), proj(kv, kv_heads)


def kept_pairs(batch: PackedBatch, sliding_window: int | None) -> int:
  """(query, key) pairs the causal mask keeps, summed over rows (per head): L(L+1)/2 per piece
  (query i sees min(i + 1, w) keys with a window)."""
  total = 0
  for row in batch.pieces:
    for piece in row:
      n = piece.length
      if sliding_window is None or sliding_window >= n:
        total += n * (n + 1) // 2
      else:
        w = sliding_window
        total += w * (w + 1) // 2 + (n - w) * w
  return total


def _median_seconds(fn, args, repeats: int) -> tuple[float, float]:
  """(first call incl. compilation, median of `repeats` later calls), in seconds."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return first, statistics.median(times)


def describe_rows(batch: PackedBatch, documents: Sequence[str]) -> list[dict[str, Any]]:
  """Per row: its pieces (document, start byte, length, first words) and its padding."""
  tok = ByteTokenizer()
  rows = []
  for r, row in enumerate(batch.pieces):
    pieces = []
    for piece in row:
      # Token 0 of a document is BOS; token t >= 1 is byte t-1.
      text = documents[piece.document].encode("utf-8")
      first = max(0, piece.start - 1)
      snippet = " ".join(text[first:first + 120].decode("utf-8", "replace").split())[:48]
      pieces.append({"document": piece.document, "start_token": piece.start,
                     "tokens": piece.length, "snippet": snippet})
    rows.append({"row": r, "documents": len(row), "pieces": pieces,
                 "padding": int(np.sum(batch.segment_ids[r] == 0))})
  return rows


def _print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
  cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                             enumerate(zip(r, widths)))
  print("  " + line(cells[0]))
  print("  " + "  ".join("-" * w for w in widths))
  for r in cells[1:]:
    print("  " + line(r))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Run the demonstration; returns the summary also written to <out>/summary.json."""
  parser = build_parser()
  args = parser.parse_args(argv)
  _check_args(parser, args)
  dtype_name = args.dtype if args.dtype != "auto" else (
      "bfloat16" if jax.default_backend() == "gpu" else "float32")
  dtype = DTYPES[dtype_name]
  features = ("causal", "gqa") + (("sliding_window",) if args.sliding_window else ())
  backend = resolve_backend_for(args.backend, dtype, args.head_dim, args.head_dim, features)
  os.makedirs(args.out, exist_ok=True)
  dev = jax.devices()[0]
  print(f"kvax_plugin {kvax_plugin.__version__} demo | jax {jax.__version__} | device "
        f"{dev.platform}:{getattr(dev, 'device_kind', '?')} | backend {backend} | {dtype_name}")

  documents = load_documents(seed=args.seed, min_chars=args.min_doc_chars,
                             max_chars=args.max_doc_chars)
  batch = next(batch_iterator(args.seq_len, args.batch, seed=args.seed, documents=documents))
  rows = describe_rows(batch, documents)
  print(f"\npacked batch [{args.batch}, {args.seq_len}] of The Devil's Dictionary (byte tokens), "
        f"{batch.fill:.1%} real tokens:")
  for row in rows:
    print(f"  row {row['row']}: {row['documents']} document(s), {row['padding']} padding")
    for p in row["pieces"]:
      cont = f" (from token {p['start_token']})" if p["start_token"] else ""
      print(f"    doc {p['document']:4d} {p['tokens']:6d} tokens{cont}: {p['snippet']!r}")

  positions, segment_ids = (jnp.asarray(x) for x in to_kvax(batch))
  # Jitted as in a training step; the first call is mostly compilation.
  build_mask = jax.jit(functools.partial(kvax_plugin.create_attention_mask, calc_bwd_mask=True,
                                         sliding_window=args.sliding_window))
  mask_first_s, mask_s = _median_seconds(build_mask, (positions, segment_ids, positions,
                                                      segment_ids), args.repeats)
  mask = build_mask(positions, segment_ids, positions, segment_ids)
  sparsity = kvax_plugin.mask_sparsity(mask)
  pairs = kept_pairs(batch, args.sliding_window)
  dense_causal = args.batch * args.seq_len * (args.seq_len + 1) // 2
  print(f"\nblock mask (built in {mask_s * 1e3:.1f} ms; first call {mask_first_s:.2f} s incl. "
        f"compilation), forward blocks {mask.spec.fwd_params.query_block_size}x"
        f"{mask.spec.fwd_params.kv_block_size}:\n  {sparsity['visited']:.1%} of blocks visited "
        f"({sparsity['full']:.1%} full, {sparsity['partial']:.1%} masked), "
        f"{sparsity['skipped']:.1%} skipped;\n  the mask keeps {pairs / dense_causal:.1%} of the "
        "pairs of a plain causal mask")

  scale = args.head_dim ** -0.5
  q, k, v = project_qkv(batch.tokens, args.heads, args.kv_heads, args.head_dim, dtype,
                        args.seed)
  ids = (positions, segment_ids, positions, segment_ids)

  def forward(q, k, v):
    return kvax_plugin.flash_attention(q, k, v, *ids, mask, scale=scale, backend=backend)

  cot = jax.random.normal(jax.random.PRNGKey(args.seed + 1), q.shape, jnp.float32)
  fwd = jax.jit(forward)
  fwd_bwd = jax.jit(jax.value_and_grad(
      lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32) * cot), argnums=(0, 1, 2)))
  fwd_first, fwd_s = _median_seconds(fwd, (q, k, v), args.repeats)
  bwd_first, fwd_bwd_s = _median_seconds(fwd_bwd, (q, k, v), args.repeats)
  flops_fwd = 4 * args.heads * args.head_dim * pairs
  flops_fwd_bwd = flops_fwd * 3.5
  print(f"\ntiming (median of {args.repeats}, after a first call incl. compilation):")
  _print_table(["pass", "first call s", "median ms", "effective GFLOP/s"], [
      ["forward", f"{fwd_first:.2f}", f"{fwd_s * 1e3:.1f}", f"{flops_fwd / fwd_s / 1e9:.1f}"],
      ["forward+backward", f"{bwd_first:.2f}", f"{fwd_bwd_s * 1e3:.1f}",
       f"{flops_fwd_bwd / fwd_bwd_s / 1e9:.1f}"]])

  t0 = time.perf_counter()
  diff = kvax_plugin.compare_with_reference(q, k, v, *ids, mask, scale=scale, backend=backend,
                                            seed=args.seed + 1)
  compare_s = time.perf_counter() - t0
  tol = REL_L2_TOLERANCE[dtype_name]
  agreement = {}
  table = []
  for name in ("out", "dq", "dk", "dv"):
    ok = diff[f"{name}_finite"] == 1.0 and diff[f"{name}_rel_l2"] <= tol
    agreement[name] = {"max_abs": diff[f"{name}_max_abs"], "rel_l2": diff[f"{name}_rel_l2"],
                       "finite": diff[f"{name}_finite"] == 1.0, "ok": ok}
    table.append([name, f"{diff[f'{name}_max_abs']:.2e}", f"{diff[f'{name}_rel_l2']:.2e}",
                  f"{tol:.0e}", "ok" if ok else "FAIL"])
  all_ok = all(a["ok"] for a in agreement.values())
  print(f"\nagreement with the float32 dense reference ({compare_s:.1f} s):")
  _print_table(["tensor", "max |diff|", "rel L2", "tolerance", ""], table)

  pngs = [kvax_plugin.draw_mask(mask, os.path.join(args.out, f"mask_fwd_row{r}.png"),
                                batch_index=r,
                                title=f"forward block mask, row {r}: {rows[r]['documents']} "
                                      f"document(s), {rows[r]['padding']} padding tokens")
          for r in range(args.batch)]
  pngs.append(kvax_plugin.draw_mask(mask, os.path.join(args.out, "mask_dkv_row0.png"),
                                    batch_index=0, view="dkv"))
  summary = {
      "config": vars(args) | {"backend_resolved": backend, "dtype_resolved": dtype_name},
      "environment": {"jax": jax.__version__, "device": f"{dev.platform}:"
                      f"{getattr(dev, 'device_kind', '?')}", "python": platform.python_version(),
                      "kvax_plugin": kvax_plugin.__version__},
      "data": {"corpus": "The Devil's Dictionary (public domain, kvax_plugin/data)",
               "tokenizer": "bytes (vocab 259: pad 0, bos 1, eos 2)", "fill": batch.fill,
               "rows": rows},
      "mask": {"build_first_s": mask_first_s, "build_s": mask_s, "sparsity": sparsity,
               "kept_pairs": pairs, "kept_share_of_causal": pairs / dense_causal},
      "timing": {"repeats": args.repeats, "forward_first_s": fwd_first, "forward_s": fwd_s,
                 "forward_backward_first_s": bwd_first, "forward_backward_s": fwd_bwd_s,
                 "effective_gflops_forward": flops_fwd / fwd_s / 1e9,
                 "effective_gflops_forward_backward": flops_fwd_bwd / fwd_bwd_s / 1e9},
      "agreement": {"tolerance_rel_l2": tol, "compare_s": compare_s, "ok": all_ok,
                    "tensors": agreement},
      "pngs": pngs,
  }
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"\nwrote {', '.join(pngs)} and {os.path.join(args.out, 'summary.json')}")
  print("result: " + ("all outputs and gradients agree with the reference" if all_ok else
                      "DISAGREEMENT with the reference (see the table above)"))
  return summary


def _cli() -> int:
  try:
    summary = main()
  except kvax_plugin.BackendUnavailableError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0 if summary["agreement"]["ok"] else 1


if __name__ == "__main__":
  sys.exit(_cli())
