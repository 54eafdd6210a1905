"""GQA with fewer query heads per CTA (one, or half the group), timed against the GQA call in one
process.

    python -m benchmarks.tools.gqa_as_mha [--seqs 16384,65536] [--cases causal,docs]
        [--passes fwd_bwd,fwd] [--variants gqa,as_mha,halves] [--backend hopper] [--rounds 7]
        [--deadline S] [--out F]

"gqa" calls flash_attention with the 8 kv heads as they are: the CUDA backward launches one CTA
per (kv head, kv tile), which walks the group's 4 query heads one after another. "as_mha"
repeats K and V over the group (32 kv heads) before the call, so every CTA walks one query head
and the CTAs in flight share that head's Q, dO and dq blocks in L2, as FlashAttention-3's backward
does; jax.grad sums the 4 heads' dK / dV through the repeat's transpose (in the inputs' dtype,
where FA3 sums in float32). The repeat and the sum are timed with it. This asks whether the
per-query-head launch is worth a kernel of its own before one is written. "halves" calls it
twice, each kv head with half of its group (query heads 0, 1 and then 2, 3 of each group): each
CTA walks 2 query heads; with the snake walk (the second head downwards) neighbouring CTAs
reach each block of either head a few steps apart, as one-head CTAs do, without repeating K and
V; jax.grad adds the two calls' dK / dV.

Cases: the gate's (benchmarks/cases.py; causal and 12 documents + 1000 padding tokens), B=1, 32
query / 8 kv heads, head dim 128, bf16, the mask prebuilt; ms per call, median over rounds of
about 20 ms of back-to-back calls each, the variants alternated in balanced orders
(timing.round_orders).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import kvax_plugin
from benchmarks.cases import layout
from benchmarks.timing import alternate

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def variants(backend: str, cot):
  """{name: loss(q, k, v, pos, seg, mask)} for the two ways of calling GQA."""
  group = HEADS // KV_HEADS

  def attend(q, k, v, pos, seg, mask):
    return kvax_plugin.flash_attention(q, k, v, pos, seg, pos, seg, mask,
                                       scale=q.shape[-1] ** -0.5, backend=backend)

  def as_mha(q, k, v, pos, seg, mask):
    return attend(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), pos, seg, mask)

  def halves(q, k, v, pos, seg, mask):
    b, s, h, d = q.shape
    grouped = q.reshape(b, s, h // group, group, d)
    half = group // 2
    outs = [attend(part.reshape(b, s, h // 2, d), k, v, pos, seg, mask)
            for part in (grouped[:, :, :, :half], grouped[:, :, :, half:])]
    return jnp.concatenate([o.reshape(b, s, h // group, half, d) for o in outs],
                           axis=3).reshape(b, s, h, d)

  def loss(fn):
    return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot.astype(jnp.float32))

  return {name: (fn, loss(fn)) for name, fn in
          (("gqa", attend), ("as_mha", as_mha), ("halves", halves))}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seqs", default="16384,65536")
  ap.add_argument("--cases", default="causal,docs")
  ap.add_argument("--passes", default="fwd_bwd,fwd")
  ap.add_argument("--variants", default="gqa,as_mha",
                  help="gqa (the reference: always run), as_mha, halves")
  ap.add_argument("--backend", default="hopper")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--deadline", type=float, default=None,
                  help="seconds: start no new case after this many")
  ap.add_argument("--out", help="results file, rewritten after each case")
  args = ap.parse_args(argv)
  unknown = set(args.passes.split(",")) - {"fwd", "fwd_bwd"}
  if unknown:
    ap.error(f"--passes: {sorted(unknown)} unknown (expected fwd, fwd_bwd)")
  names = ["gqa"] + [n for n in args.variants.split(",") if n != "gqa"]
  unknown = set(names) - {"gqa", "as_mha", "halves"}
  if unknown:
    ap.error(f"--variants: {sorted(unknown)} unknown (expected gqa, as_mha, halves)")
  t0 = time.monotonic()
  conditions = dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      gpu=jax.devices()[0].device_kind, jax=jax.__version__, rounds=args.rounds,
      backend=args.backend, kvax_plugin=kvax_plugin.__version__,
      shapes=dict(batch=1, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16"),
      timed="fwd: jit(flash_attention); fwd_bwd: jit(grad(sum(out * dO))) over q, k, v; "
            "the mask prebuilt")
  rows = []
  for seq, case in itertools.product(map(int, args.seqs.split(",")), args.cases.split(",")):
    if args.deadline is not None and time.monotonic() - t0 > args.deadline:
      print(f"deadline: {seq} {case} not run", flush=True)
      break
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (1, seq, HEADS, HEAD_DIM), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, seq, KV_HEADS, HEAD_DIM), jnp.bfloat16) for x in keys[1:3])
    cot = jax.random.normal(keys[3], (1, seq, HEADS, HEAD_DIM), jnp.bfloat16)
    pos, seg, _ = layout(case, seq, seed=0, counted_padding=True)
    pos, seg = jnp.asarray(pos), jnp.asarray(seg)
    mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
    call = (q, k, v, pos, seg, mask)
    for pass_ in args.passes.split(","):
      fns = {name: (jax.jit(fwd) if pass_ == "fwd" else jax.jit(jax.grad(loss, argnums=(0, 1, 2))))
             for name, (fwd, loss) in variants(args.backend, cot).items() if name in names}
      # The variants compute the same gradients up to the rounding of the summed dK / dV.
      agree = {}
      if pass_ == "fwd_bwd":
        ref = fns["gqa"](*call)
        for other in names[1:]:
          got = fns[other](*call)
          agree[other] = {}
          for name, a, b in zip(("dq", "dk", "dv"), ref, got):
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
            agree[other][name] = float(jnp.max(jnp.abs(a - b)) /
                                       jnp.maximum(jnp.max(jnp.abs(a)), 1e-30))
      times = alternate(fns, call, args.rounds)
      ms = {n: statistics.median(t) for n, t in times.items()}
      rows.append(dict(seq=seq, case=case, pass_=pass_, ms=ms, ms_rounds=times,
                       over_gqa={n: ms[n] / ms["gqa"] for n in names[1:]}, max_rel_diff=agree))
      print(f"{seq} {case} {pass_}: " + "  ".join(f"{n} {ms[n]:.3f}" for n in names) + "  " +
            "  ".join(f"{n}/gqa {ms[n] / ms['gqa']:.3f}" for n in names[1:]) + f"  {agree}",
            flush=True)
      if args.out:
        Path(args.out).write_text(json.dumps(dict(conditions=conditions, rows=rows), indent=1))
  return dict(conditions=conditions, rows=rows)


if __name__ == "__main__":
  main()
