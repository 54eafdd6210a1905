"""How MaxText's GPU `flash` attention addresses its dense segment mask, read from the Triton
kernel that jax's Pallas Triton lowering emits for it (no GPU needed):

    python -m benchmarks.tools.flash_mask_offsets --seq 16384 65536
    python -m benchmarks.tools.flash_mask_offsets --seq 32768 --batch 4

MaxText 0.2.5 (layers/attention_op.py) runs `attention=flash` on GPUs as tokamax's
PallasTritonFlashAttention with `Mask(is_causal=True) & Mask(seg[:, :, None] == seg[:, None, :])`,
a dense [B, 1, S, S] boolean mask. This program traces that call for each length, lowers it for
CUDA on this machine (tokamax's cross-compile switch on, Pallas told the GPU is an H100), keeps
the Triton module, and reports the integer type of the element offsets added to the mask's
pointer and whether the mask's row stride S and batch stride S * S are constants of that type
(read from the module), then the largest offset, B * S * S - 1 for B rows per device
(computed). An int32 offset past 2^31 - 1 wraps negative: the rows past it read their mask from
outside the buffer. The kernel's other inputs are not examined.

Why it exists: the MaxText speed runs' losses with `flash` on 64k rows part from every other
attention's (docs/integrations.md, parity section).
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp


def lower_flash(seq: int, batch: int = 1, heads: int = 32, kv_heads: int = 8,
                head_dim: int = 128) -> str:
  """The Triton module (MLIR text) of MaxText's flash call on [batch, seq] rows."""
  from jax._src.pallas.triton import gpu_info, pallas_call_registration as registration
  from tokamax._src import config as tokamax_config
  from tokamax._src.ops.attention import base, pallas_triton

  modules = []
  lower = registration.lowering.lower_jaxpr_to_triton_module

  def keep(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  def attention(q, k, v, seg):  # MaxText's GPU flash branch, as written there
    mask = base.Mask(is_causal=True)
    mask = mask & base.Mask((seg[:, :, None] == seg[:, None, :])[:, None, :, :])
    return pallas_triton.PallasTritonFlashAttention()(q, k, v, logits_scale=1.0, mask=mask)

  q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  saved = registration.gpu_info_lib.get_gpu_info
  registration.gpu_info_lib.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(
      gpu_info.GpuVersion.H100)
  registration.lowering.lower_jaxpr_to_triton_module = keep
  try:
    with tokamax_config.cross_compile(True):
      jax.jit(attention).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",))
  finally:
    registration.gpu_info_lib.get_gpu_info = saved
    registration.lowering.lower_jaxpr_to_triton_module = lower
  if len(modules) != 1:
    raise RuntimeError(f"expected one Triton kernel, lowered {len(modules)}")
  return modules[0]


def mask_offsets(module: str, seq: int) -> dict:
  """The mask pointer's `tt.addptr` offset type, and whether the module holds the mask's row
  stride (seq) and batch stride (seq * seq) as constants of that type."""
  args = re.search(r"tt\.func public @\w+\((.*?)\)\s*(?:attributes|\{)", module, re.S).group(1)
  names = re.findall(r"(%arg\d+): !tt\.ptr<(\w+)>", args)
  mask_arg = next(n for n, t in names if t == "i1")
  splat = re.search(rf"(%\d+) = tt\.splat {mask_arg} : .*", module).group(1)
  addptr = re.search(rf"tt\.addptr {splat}, (%\d+) : [^,]+, tensor<[\dx]+x(i\d+)>", module)
  offsets, offset_type = addptr.group(1), addptr.group(2)
  def constant(value):
    return re.search(rf"= arith\.constant {value} : {offset_type}\b", module) is not None
  return dict(mask_argument=mask_arg, offset_value=offsets, offset_type=offset_type,
              row_stride_seq=constant(seq), batch_stride_seq_squared=constant(seq * seq))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
  ap.add_argument("--batch", type=int, default=1, help="rows per device")
  args = ap.parse_args()
  rows = []
  for seq in args.seq:
    found = mask_offsets(lower_flash(seq, args.batch), seq)
    largest = args.batch * seq * seq - 1  # the last batch row's last query's last column
    bits = int(found["offset_type"][1:])
    wraps = largest > 2 ** (bits - 1) - 1
    first_bad_row = (2 ** (bits - 1)) // seq if wraps else None  # counted over B * S rows
    rows.append(dict(seq=seq, batch=args.batch, offset_type=found["offset_type"],
                     largest_offset=largest,
                     row_stride_seq=found["row_stride_seq"], wraps=wraps,
                     first_row_past_the_limit=first_bad_row))
    print(f"B={args.batch} S={seq}: mask offsets {found['offset_type']}, largest {largest:,}"
          + (f" > 2^{bits - 1} - 1: query rows >= {first_bad_row} (of B * S) wrap" if wraps
             else ": fits"))
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
