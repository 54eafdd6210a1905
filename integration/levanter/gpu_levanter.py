"""Levanter on one GPU: kvax parity (against vanilla attention) and tokens/s (against jax_flash).

    python integration/levanter/gpu_levanter.py --out $OUT/levanter_gpu.json        # on a GPU
    python integration/levanter/gpu_levanter.py --out /tmp/l.json --cpu_check       # this script

1. Parity (run second): the same shrunken Levanter configs as test_levanter_parity.py (llama, qwen3, gemma2,
   olmo3, mixtral), float32, attn_backend=kvax with --kernel (default auto: Triton in float32)
   against attn_backend=vanilla on packed documents with padding: loss, logits on real tokens and the
   worst gradient leaf, max relative differences.
2. Tokens/s (run first): Levanter's llama (registered config, --layers x hidden 2048, 16 query / 8 kv
   heads of 128, Levanter's default remat) trained with bf16 compute / f32 params (jmp, as
   Levanter's Trainer casts) and an optax AdamW update, one jitted step under Levanter's mesh
   and axis mapping, on the shipped corpus packed into --seq_len rows (16k: many documents and
   padding per row); once with attn_backend=kvax, once with Levanter's jax_flash, same init and
   batches. (Levanter's Trainer itself is left out here: it imports wandb, cloud storage and
   Ray-era helpers the GPU image lacks; train_packed runs it on CPU.) Per run: step times after
   the first (compile) step, median tokens/s, the losses (bf16 agreement of the two runs), the
   share of kvax blocks skipped per batch, and kvax's trace summary.

Writes the JSON after every part, so a time limit keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parity(families, kernel: str, seq_len: int, block: int | None, seed: int) -> list[dict]:
  import numpy as np
  import levanter_harness as harness
  from kvax_plugin.integrations import levanter as kvax_levanter
  from kvax_plugin.integrations.levanter import seam
  previous = kvax_levanter.configure(kernel=kernel, block_size=block)
  rows = []
  try:
    batch = harness.packed_batch(np.random.default_rng(seed), seq_len=seq_len)
    for family in families:
      row = {"family": family, "kernel": kernel, "seq_len": seq_len, "block": block}
      t0 = time.time()
      try:
        vanilla = harness.config(family, "vanilla", max_seq_len=seq_len)
        model = harness.init_model(vanilla, seed=seed)
        ref = harness.run(model, batch)
        for k in seam.TRACE_COUNTS:
          seam.TRACE_COUNTS[k] = 0
        got = harness.run(harness.init_like(model, harness.config(family, "kvax",
                                                                 max_seq_len=seq_len)), batch)
        row.update(harness.compare(ref, got, batch), trace=dict(seam.TRACE_COUNTS))
      except Exception as e:  # recorded, never hidden: the row says what failed
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
      row["seconds"] = round(time.time() - t0, 1)
      print(json.dumps(row), flush=True)
      rows.append(row)
  finally:
    kvax_levanter.configure(previous)
  return rows


def _resolved_backend(args) -> str:
  """The backend `args.kernel` runs for this model's calls (bf16 compute, its head dim, no
  features): "auto" names the kernel it picks on this machine."""
  import jax.numpy as jnp
  from kvax_plugin.attention.kernels import BackendUnavailableError, resolve_backend_for
  head_dim = args.hidden // args.heads
  try:
    return resolve_backend_for(args.kernel, jnp.bfloat16, head_dim, head_dim)
  except (BackendUnavailableError, ValueError) as e:  # recorded: the run itself reports it
    return f"unresolved ({type(e).__name__}: {e})"[:300]


def throughput(attn_backend: str, args) -> dict:
  """Median tokens/s of Levanter's llama training step (forward, backward, Adam update)."""
  import draccus
  import equinox as eqx
  import haliax as hax
  import jax
  import jmp
  import optax
  from levanter.models.lm_model import LmConfig
  from kvax_plugin.data import VOCAB_SIZE
  from kvax_plugin.integrations.levanter import seam, train_packed
  import levanter_harness as harness

  from kvax_plugin.integrations import levanter as kvax_levanter
  for k in seam.TRACE_COUNTS:
    seam.TRACE_COUNTS[k] = 0
  previous = kvax_levanter.configure(kernel=args.kernel, block_size=None)  # kvax's GPU defaults
  cfg = draccus.decode(LmConfig, dict(
      type="llama", max_seq_len=args.seq_len, attn_backend=attn_backend,
      hidden_dim=args.hidden, intermediate_dim=args.hidden * 11 // 4, num_layers=args.layers,
      num_heads=args.heads, num_kv_heads=args.kv_heads))
  row = {"attn_backend": attn_backend,
         "kvax_kernel": args.kernel if seam.uses_kvax(attn_backend) else None,
         "kvax_backend": _resolved_backend(args) if seam.uses_kvax(attn_backend) else None,
         "config": {
      "type": "llama", "seq_len": args.seq_len, "hidden_dim": cfg.hidden_dim,
      "intermediate_dim": cfg.intermediate_dim, "num_layers": cfg.num_layers,
      "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.actual_head_size,
      "mp": "p=f32,c=bfloat16", "remat": str(cfg.gradient_checkpointing)}}
  t0 = time.time()
  try:
    policy = jmp.get_policy("p=f32,c=bfloat16")
    optimizer = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.0)
    batches = train_packed.levanter_batches(args.seq_len, 1, args.seed)
    mesh, compute_mapping, param_mapping = harness.levanter_mesh(1, 1)
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(param_mapping):
      model = cfg.model_type.init(hax.Axis("vocab", VOCAB_SIZE), cfg, key=jax.random.PRNGKey(
          args.seed))
      opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

      def train_step(model, opt_state, example):
        def loss_fn(m):
          return policy.cast_to_compute(m).compute_next_token_loss(example).scalar()
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model,
                                                                           eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

      step = hax.named_jit(train_step, axis_resources=compute_mapping, donate_args=(True, True,
                                                                                     False))
      secs, losses, skipped, real = [], [], [], []
      for _ in range(args.steps):
        example, n_real, skip = next(batches)
        start = time.perf_counter()
        model, opt_state, loss = step(model, opt_state, example)
        losses.append(float(loss))  # blocks until the step is done
        secs.append(time.perf_counter() - start)
        skipped.append(skip)
        real.append(n_real)
    timed = range(1, len(secs))  # the first step compiles
    row.update(
        first_step_s=round(secs[0], 2), step_ms=[round(secs[i] * 1e3, 2) for i in timed],
        median_step_ms=round(statistics.median(secs[i] for i in timed) * 1e3, 2),
        tokens_per_s=round(statistics.median(args.seq_len / secs[i] for i in timed)),
        real_tokens_per_s=round(statistics.median(real[i] / secs[i] for i in timed)),
        losses=[round(x, 5) for x in losses], blocks_skipped=[round(x, 4) for x in skipped])
    if seam.uses_kvax(attn_backend):
      row["trace"] = dict(seam.TRACE_COUNTS)
  except Exception as e:  # recorded, never hidden
    row["error"] = f"{type(e).__name__}: {e}"[:2000]
  finally:
    kvax_levanter.configure(previous)
  row["wall_s"] = round(time.time() - t0, 1)
  print(json.dumps(row), flush=True)
  return row


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="JSON file")
  p.add_argument("--kernel", default="auto", help="kvax kernel (auto, hopper, mosaic, triton, jax)")
  p.add_argument("--families", default="llama,gemma2,olmo3,mixtral,qwen3",
                 help="parity families, most distinct first (qwen3 shares llama's decoder)")
  p.add_argument("--parity_seq_len", type=int, default=256)
  p.add_argument("--parity_block", type=int, default=64)
  p.add_argument("--seq_len", type=int, default=16384)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv_heads", type=int, default=8)
  p.add_argument("--baseline", default="jax_flash", help="Levanter attn_backend to time against")
  p.add_argument("--skip", default="", help="comma list of parts to skip: parity,throughput")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--cpu_check", action="store_true",
                 help="tiny sizes, kernel jax, on CPU: checks this script, not a GPU")
  args = p.parse_args()
  if args.cpu_check:
    args.kernel, args.families, args.seq_len, args.steps = "jax", "llama,gemma2", 512, 3
    args.layers, args.hidden, args.heads, args.kv_heads = 2, 128, 4, 2
    args.parity_seq_len, args.parity_block = 64, 16

  import jax
  from kvax_plugin.integrations import levanter as kvax_levanter
  kvax_levanter.install()
  import importlib.metadata as md
  result = {"conditions": {
      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
      "levanter": md.version("marin-levanter"), "haliax": md.version("marin-haliax"),
      "triton": _version("triton"), "jax_triton": _version("jax-triton"),
      "kernel": args.kernel, "command": " ".join(sys.argv)}}

  def write():
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)

  skip = set(filter(None, args.skip.split(",")))
  # Tokens/s first: the headline number survives a time limit; parity rows are saved one by one.
  if "throughput" not in skip:
    runs = {}
    for backend in ("kvax", args.baseline):
      runs[backend] = throughput(backend, args)
      result["throughput"] = {"runs": runs}
      write()
    k, b = runs["kvax"], runs[args.baseline]
    if "error" not in k and "error" not in b:
      result["throughput"]["kvax_speedup"] = round(k["tokens_per_s"] / b["tokens_per_s"], 3)
      result["throughput"]["first_step_loss_rel_diff"] = (
          abs(k["losses"][0] - b["losses"][0]) / abs(b["losses"][0]))
      write()
  if "parity" not in skip:
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 parity: IEEE dots
    result["parity_float32"] = []
    for family in args.families.split(","):
      result["parity_float32"] += parity([family], args.kernel, args.parity_seq_len,
                                         args.parity_block, args.seed)
      write()
  print(json.dumps({k: v for k, v in result.items() if k != "parity_float32"}, indent=1))


def _version(dist: str) -> str | None:
  import importlib.metadata as md
  try:
    return md.version(dist)
  except md.PackageNotFoundError:
    return None


if __name__ == "__main__":
  main()
