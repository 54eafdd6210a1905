"""Draws docs/images/block_mask.png, the README's picture (CPU, a few seconds):

    .venv/bin/python docs/images/block_mask.py

One 4096-token row packed from 7 documents of uneven length and 76 padding tokens, the default
128 x 128 blocks: kvax.draw_mask colours each block skipped, visited with mask math, or full.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np

import kvax_plugin as kvax

LENGTHS = (1500, 300, 900, 120, 640, 260, 300)
SEQ = 4096


def main():
  seg = np.full(SEQ, kvax.PADDING_SEGMENT_ID, np.int32)
  pos = np.zeros(SEQ, np.int32)
  start = 0
  for doc, n in enumerate(LENGTHS):
    seg[start:start + n], pos[start:start + n] = doc, np.arange(n)
    start += n
  pos, seg = jnp.asarray(pos[None]), jnp.asarray(seg[None])
  mask = kvax.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=False)
  print(kvax.mask_sparsity(mask))
  kvax.draw_mask(mask, str(Path(__file__).with_suffix(".png")),
                 title="7 packed documents + padding, 4096 tokens, 128 x 128 blocks")


if __name__ == "__main__":
  main()
