"""A short Levanter training run with attn_backend=kvax on the shipped packed text.

    python -m kvax_plugin.integrations.levanter.train_packed --model llama --steps 30

Levanter's own Trainer (its jitted step under its mesh and axis mappings, its optimizer config,
its LmExample and next-token loss) on Levanter's registered model config, shrunk, fed with
kvax_plugin.data's public-domain corpus: byte tokens, documents packed first-fit into rows
(segment ids 0, 1, ..., -1 on padding, as Levanter's packers write them). One progress line
per step: loss, tokens/s (all slots and real tokens), and the share of attention blocks the
kvax mask skips for that batch. --attn_backend vanilla runs the same with Levanter's attention.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import sys
import time
from typing import Sequence

import numpy as np

# Levanter's registered config, shrunk to train in seconds per step on CPU (the flags resize it).
TINY = dict(hidden_dim=128, intermediate_dim=256, num_layers=2, num_heads=4, num_kv_heads=2)


@dataclasses.dataclass(frozen=True)
class StepLine:
  step: int
  loss: float
  seconds: float
  tokens: int
  real_tokens: int
  skipped: float  # share of forward attention blocks the kvax mask skips (this batch)

  def format(self, total: int) -> str:
    return (f"step {self.step:4d}/{total}  loss {self.loss:.4f}  "
            f"{self.tokens / self.seconds:9.0f} tok/s ({self.real_tokens / self.seconds:9.0f} real)"
            f"  {self.seconds * 1e3:7.1f} ms  blocks skipped {self.skipped:5.1%}")


def levanter_batches(seq_len: int, batch_size: int, seed: int, fwd_params=None):
  """(LmExample with a batch axis, real tokens, skipped share of kvax blocks with fwd_params
  (None: kvax's defaults)) from the shipped corpus."""
  import haliax as hax
  import jax.numpy as jnp
  import kvax_plugin
  from kvax_plugin.data import batch_iterator
  from kvax_plugin.integrations.levanter import seam
  from levanter.layers.attention import AttentionMask
  from levanter.models.lm_model import LmExample

  batch_axis, pos = hax.Axis("batch", batch_size), hax.Axis("position", seq_len)
  for packed in batch_iterator(seq_len, batch_size, seed=seed):
    # kvax_plugin.data numbers segments 1.. with 0 on padding; Levanter 0.. with -1 on padding.
    seg = packed.segment_ids.astype(np.int32) - 1
    nxt = np.concatenate([seg[:, 1:], np.full((batch_size, 1), -1, np.int32)], axis=1)
    weight = ((seg >= 0) & (nxt == seg)).astype(np.float32)
    named_seg = hax.named(jnp.asarray(seg), (batch_axis, pos))
    example = LmExample(tokens=hax.named(jnp.asarray(packed.tokens), (batch_axis, pos)),
                        loss_weight=hax.named(jnp.asarray(weight), (batch_axis, pos)),
                        attn_mask=AttentionMask.causal().with_segment_ids(named_seg))
    # The tokens as the seam hands them to kvax (padding is a segment of its own there).
    kpos, kseg, _, _ = seam.kvax_tokens(jnp.asarray(seg))
    mask = kvax_plugin.create_attention_mask(kpos, kseg, kpos, kseg, fwd_params=fwd_params)
    yield example, int((seg >= 0).sum()), kvax_plugin.mask_sparsity(mask)["skipped"]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="llama", help="a Levanter LmConfig type (llama, qwen3, "
                 "gemma2, mistral, mixtral, olmo3, ...)")
  p.add_argument("--attn_backend", default="kvax", help="kvax, or a Levanter backend (vanilla)")
  p.add_argument("--kernel", default="auto", help="kvax kernel: auto, jax, triton, reference")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--seq_len", type=int, default=256)
  p.add_argument("--batch_size", type=int, default=4)
  p.add_argument("--block", type=int, default=None, help="kvax block size (default: kvax's)")
  for name, default in TINY.items():
    p.add_argument(f"--{name}", type=int, default=default)
  p.add_argument("--head_dim", type=int, default=None, help="default: hidden_dim / num_heads")
  p.add_argument("--mp", default="f32", help='Levanter mixed precision, e.g. "p=f32,c=bfloat16"')
  p.add_argument("--learning_rate", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="outputs/levanter", help="Levanter's log / checkpoint dir")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[StepLine]:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  from kvax_plugin.integrations import levanter as kvax_levanter
  kvax_levanter.install()
  previous = kvax_levanter.configure(kernel=args.kernel, block_size=args.block)
  try:
    return _train(args, kvax_levanter)
  finally:
    kvax_levanter.configure(previous)


def _train(args, kvax_levanter) -> list[StepLine]:
  from kvax_plugin.integrations.levanter import seam

  import draccus
  import haliax as hax
  import jax
  import jmp

  from levanter.checkpoint import CheckpointerConfig
  from levanter.models.lm_model import LmConfig
  from levanter.optim.config import AdamConfig
  from levanter.tracker import NoopConfig
  from levanter.trainer import Trainer, TrainerConfig
  from kvax_plugin.data import VOCAB_SIZE

  sizes = {k: getattr(args, k) for k in TINY}
  if args.head_dim is not None:
    sizes["head_dim"] = args.head_dim
  model_cfg = draccus.decode(LmConfig, dict(
      type=args.model, max_seq_len=args.seq_len, attn_backend=args.attn_backend, **sizes))
  run_dir = os.path.abspath(args.out)
  trainer_cfg = TrainerConfig(
      mp=jmp.get_policy(args.mp), num_train_steps=args.steps, train_batch_size=args.batch_size, seed=args.seed,
      tracker=NoopConfig(), require_accelerator=False, log_dir=os.path.join(run_dir, "logs"),
      id="kvax-levanter", load_checkpoint=False, log_jaxprs=False, log_xla_hlo=False,
      checkpointer=CheckpointerConfig(base_path=os.path.join(run_dir, "checkpoints"),
                                      save_interval=None, keep=[]))
  trainer_cfg.initialize()  # Levanter: logging, tracker, batch sizes per device
  logging.getLogger("kvax_plugin").setLevel(logging.INFO)
  optimizer = AdamConfig(learning_rate=args.learning_rate, weight_decay=0.0, warmup=0.1,
                         min_lr_ratio=0.1).build(args.steps)

  def loss_function(model, example, *, key=None):
    return model.compute_next_token_loss(example, key=key)

  vocab = hax.Axis("vocab", VOCAB_SIZE)
  lines: list[StepLine] = []
  print(f"levanter train_packed: model={args.model} attn_backend={args.attn_backend} "
        f"kernel={args.kernel} seq_len={args.seq_len} batch={args.batch_size} "
        f"devices={jax.device_count()} ({jax.default_backend()})", flush=True)
  with Trainer(trainer_cfg, optimizer, loss_function, add_default_hooks=False) as trainer:
    model_key, train_key = jax.random.split(jax.random.PRNGKey(args.seed))
    state = trainer.initial_state(
        train_key, model_init=lambda: model_cfg.model_type.init(vocab, model_cfg, key=model_key))
    batches = levanter_batches(args.seq_len, args.batch_size, args.seed,
                               kvax_levanter.current().params()[0])
    pending: collections.deque = collections.deque()  # (real tokens, skipped) of fed batches

    def examples():
      for example, real, skipped in batches:
        pending.append((real, skipped))
        yield example

    for info in trainer.training_steps(state, examples()):
      real, skipped = pending.popleft()
      line = StepLine(info.step + 1, float(info.loss), float(info.step_duration),
                      args.seq_len * args.batch_size, real, skipped)
      lines.append(line)
      print(line.format(args.steps), flush=True)
  first, last = lines[0], lines[-1]
  print(f"loss {first.loss:.4f} -> {last.loss:.4f} over {len(lines)} steps", flush=True)
  if seam.uses_kvax(args.attn_backend):
    c = seam.TRACE_COUNTS
    print(f"kvax while tracing: {c['entry_masks']} block masks built at {c['entries']} decoder "
          f"entries, {c['layer_calls']} attention calls served ({c['sharded_calls']} on a mesh), "
          f"{c['per_call_masks']} masks built per call, {c['routed']} calls routed to Levanter",
          flush=True)
  return lines


if __name__ == "__main__":
  start = time.time()
  main()
  print(f"done in {time.time() - start:.1f} s")
