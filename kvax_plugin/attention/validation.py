"""Checks of the op's arguments, the first step of a call (then plan.py, run.py): each error names
the argument and what was expected. Scalars follow kvax_plugin.attention.arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention.arguments import normalize_logit_options
from kvax_plugin.attention.block_mask import AttentionMask, mask_fingerprint
from kvax_plugin.attention.options import kernel_options as as_kernel_options
from kvax_plugin.attention.params import check_params
from kvax_plugin.attention.sharded_mask import ShardedAttentionMask
from kvax_plugin.attention.specs import AttentionSpecs, mesh_axes

# Multiples of 16 in [16, 256] (qk and v separately).
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 16, 256, 16
# float64: the JAX and reference backends only.
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def _shape(x):
  return getattr(x, "shape", type(x).__name__)


def check_head_dim(name: str, dim: int) -> None:
  if dim < MIN_HEAD_DIM or dim > MAX_HEAD_DIM or dim % HEAD_DIM_MULTIPLE:
    raise ValueError(f"{name} head dim {dim} is unsupported: expected a multiple of "
                     f"{HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")


def check_qkv(query, key, value, *, kernel_head_dims: bool = True) -> None:
  """query [B, Sq, H, Dqk], key [B, Skv, K, Dqk], value [B, Skv, K, Dv], H % K == 0; zero sizes
  are valid. kernel_head_dims: also require head dims the kernels support."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or len(x.shape) != 4:
      raise ValueError(f"{name} must be a [batch, seq_len, heads, head_dim] array, got shape "
                       f"{_shape(x)}")
    if not any(x.dtype == d for d in FLOAT_DTYPES):
      raise TypeError(f"{name} must be float32, bfloat16, float16 (or float64 on the JAX and "
                      f"reference backends), got {x.dtype}")
  if not (query.dtype == key.dtype == value.dtype):
    raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
                    f"{value.dtype}")
  b, _, h, dqk = query.shape
  if key.shape[0] != b or value.shape[0] != b:
    raise ValueError(f"batch mismatch: query {query.shape}, key {key.shape}, value {value.shape}")
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"key {key.shape} and value {value.shape} must agree in batch, length and "
                     "heads")
  if key.shape[3] != dqk:
    raise ValueError(f"key head dim {key.shape[3]} must equal query head dim {dqk}")
  kh = key.shape[2]
  if kh == 0 and h:
    raise ValueError(f"key/value have 0 heads but query has {h}: query heads must be a "
                     "multiple of key/value heads")
  if kh and h % kh:
    raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({kh})")
  if kernel_head_dims:
    check_head_dim("query/key", dqk)
    check_head_dim("value", value.shape[3])
  elif dqk == 0 or value.shape[3] == 0:
    raise ValueError(f"head dims must be >= 1, got query/key {dqk}, value {value.shape[3]}")


def is_empty(query, key) -> bool:
  """True when batch, a length or the query heads is 0 (output all-zero)."""
  b, sq, h, _ = query.shape
  return 0 in (b, sq, h, key.shape[1])


def check_tokens(name_pos: str, positions, name_seg: str, segment_ids, batch: int,
                 length: int) -> None:
  for name, x in ((name_pos, positions), (name_seg, segment_ids)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or len(x.shape) != 2:
      raise ValueError(f"{name} must be a [batch, seq_len] array, got shape {_shape(x)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must hold integers (int32), got dtype {x.dtype}")
    if tuple(x.shape) != (batch, length):
      raise ValueError(f"{name} has shape {tuple(x.shape)}, expected ({batch}, {length}) to "
                       "match the attention inputs")


def check_mask(mask, batch: int, q_len: int, kv_len: int, fwd_params, bwd_params) -> None:
  check_params("fwd_params", fwd_params)
  check_params("bwd_params", bwd_params)
  if not isinstance(mask, AttentionMask):
    raise TypeError(f"mask must be an AttentionMask from create_attention_mask, got "
                    f"{type(mask).__name__}")
  spec = mask.spec
  if (spec.batch, spec.q_len, spec.kv_len) != (batch, q_len, kv_len):
    raise ValueError(f"mask was built for batch {spec.batch}, query length {spec.q_len}, kv length "
                     f"{spec.kv_len}; the inputs have {batch}, {q_len}, {kv_len}")
  if fwd_params is not None and fwd_params != spec.fwd_params:
    raise ValueError(f"fwd_params {fwd_params} differ from the mask's {spec.fwd_params}: pass the "
                     "same params to create_attention_mask")
  if bwd_params is not None and spec.bwd_params is not None and bwd_params != spec.bwd_params:
    raise ValueError(f"bwd_params {bwd_params} differ from the mask's {spec.bwd_params}: pass the "
                     "same params to create_attention_mask")


def check_bias(bias) -> None:
  if bias is not None:
    raise NotImplementedError(
        f"bias is not supported (got {type(bias).__name__} of shape {_shape(bias)}); pass "
        "bias=None. Documents, causality and windows come from the segment ids, positions and "
        "the mask (causal=, sliding_window=); a soft cap from logits_soft_cap=")


def check_options(scale, logits_soft_cap, sinks, num_heads: int) -> tuple[float, float | None]:
  scale, cap = normalize_logit_options(scale, logits_soft_cap)
  if sinks is not None:
    if not hasattr(sinks, "shape") or tuple(sinks.shape) != (num_heads,):
      raise ValueError(f"sinks must have shape ({num_heads},) (one logit per query head), got "
                       f"{_shape(sinks)}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise TypeError(f"sinks must be floating point, got {sinks.dtype}")
  return scale, cap


def check_choice(name: str, value, choices: tuple) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_call(query, key, value, query_positions, query_segment_ids, kv_positions,
               kv_segment_ids, mask, *, bias, scale, logits_soft_cap, sinks, backend, backends,
               fwd_params, bwd_params, kernel_options, debug):
  """Every check of flash_attention's arguments that needs no mesh; returns (scale,
  logits_soft_cap, kernel_options) normalised. Shapes as in flash_attention."""
  check_bias(bias)
  check_qkv(query, key, value)
  b, sq, h, _ = query.shape
  skv = key.shape[1]
  check_tokens("query_positions", query_positions, "query_segment_ids", query_segment_ids, b, sq)
  check_tokens("kv_positions", kv_positions, "kv_segment_ids", kv_segment_ids, b, skv)
  scale, logits_soft_cap = check_options(scale, logits_soft_cap, sinks, h)
  check_choice("backend", backend, backends)
  check_mask(mask, b, sq, skv, fwd_params, bwd_params)
  kernel_options = as_kernel_options(kernel_options)
  if debug or mask_input_checks_enabled():
    check_mask_matches_inputs(mask, query_positions, query_segment_ids, kv_positions,
                              kv_segment_ids)
  return scale, logits_soft_cap, kernel_options


def check_mask_layout(mask, specs: AttentionSpecs, mesh, order: str) -> None:
  """A call on `mesh` needs a ShardedAttentionMask built on it, with its specs and order."""
  if not isinstance(mask, ShardedAttentionMask):
    raise TypeError(
        f"mask must come from create_attention_mask(..., mesh=mesh) with the same mesh and specs "
        f"when flash_attention runs on a mesh (mesh=, or the surrounding jax.set_mesh with "
        f"query specs known), got a {type(mask).__name__} built without a mesh")
  lay = mask.layout
  if lay.mesh_axes != mesh_axes(mesh):
    raise ValueError(f"mask was built on a mesh with axes {lay.mesh_axes}, flash_attention got "
                     f"{mesh_axes(mesh)}: build the mask with the same mesh")
  if (isinstance(lay.mesh, jax.sharding.Mesh) and isinstance(mesh, jax.sharding.Mesh)
      and lay.mesh.device_ids.tolist() != mesh.device_ids.tolist()):
    raise ValueError("mesh has the axes of the mask's mesh but other devices (or another device "
                     "order): build the mask with the mesh flash_attention runs on")
  if lay.batch_axes != specs.batch_axes or lay.context_axes != specs.context_axes:
    raise ValueError(
        f"mask was built for batch axes {lay.batch_axes} and context axes {lay.context_axes}, "
        f"flash_attention got query_specs with {specs.batch_axes} and {specs.context_axes}: "
        "build the mask under the same specs")
  if lay.token_order != order:
    raise ValueError(
        f"token_order {order!r} differs from the mask's ({lay.token_order!r}): pass the same "
        "token_order (or permute_tokens_for_load_balance) to create_attention_mask and "
        "flash_attention (it says in which order the inputs arrive)")


# Off by default: a pass over the ids per call (a host callback under jit).
_CHECK_MASK_INPUTS: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "kvax_check_mask_inputs", default=None)


def mask_input_checks_enabled() -> bool:
  enabled = _CHECK_MASK_INPUTS.get()
  if enabled is None:
    return os.environ.get("KVAX_CHECK_MASK_INPUTS", "0").lower() not in ("", "0", "false", "no")
  return enabled


@contextlib.contextmanager
def check_mask_inputs(enabled: bool = True):
  """Within the block, flash_attention checks that every mask was built from the ids it is
  called with, in the same order (a context-parallel mask: the query side in order, the kv side
  order-free). Eager calls raise ValueError; under jit a host callback fails the call. Also on
  with KVAX_CHECK_MASK_INPUTS=1 or flash_attention(debug=True).
  """
  token = _CHECK_MASK_INPUTS.set(bool(enabled))
  try:
    yield
  finally:
    _CHECK_MASK_INPUTS.reset(token)


def _rows_text(rows) -> str:
  return f"batch rows {rows[:8]}{'...' if len(rows) > 8 else ''}"


def _fingerprint_mismatch(built, got, columns=(0, 1, 2, 3)) -> str | None:
  """The error message for a mask whose fingerprint differs from this call's in `columns`."""
  built, got = np.asarray(built), np.asarray(got)
  if built.shape != got.shape:
    return (f"mask.fingerprint has shape {built.shape}, expected {got.shape} (uint32 [batch, 4] "
            "from create_attention_mask): rebuild the mask with create_attention_mask")
  sides = ("query", "kv")
  free = [c for c in columns if c < 2]
  differs = built[:, free] != got[:, free]
  if np.any(differs):
    rows = sorted({int(r) for r in np.argwhere(differs)[:, 0]})
    named = [sides[c] for i, c in enumerate(free) if np.any(differs[:, i])]
    return (f"mask was built from other positions / segment ids than this call's "
            f"({' and '.join(named)} side, {_rows_text(rows)}): build it with "
            "create_attention_mask from the same query_positions, query_segment_ids, "
            "kv_positions and kv_segment_ids (a mask is per batch)")
  ordered = [c for c in columns if c >= 2]
  differs = built[:, ordered] != got[:, ordered]
  if not np.any(differs):
    return None
  rows = sorted({int(r) for r in np.argwhere(differs)[:, 0]})
  named = [sides[c - 2] for i, c in enumerate(ordered) if np.any(differs[:, i])]
  return (f"token order mismatch: mask was built from the same positions / segment ids as this "
          f"call's but in another order ({' and '.join(named)} side, {_rows_text(rows)}), e.g. "
          "built in natural order and called in load-balanced order (to_load_balanced_order, "
          "apply_token_order); its block tables index tokens by their place in the buffer. Build "
          "the mask from query_positions, query_segment_ids, kv_positions and kv_segment_ids in "
          "the order flash_attention receives them (permute them before create_attention_mask), "
          "and under context parallelism pass mesh= and the same token_order= to both calls")


def _raise_on_mismatch(built, got, columns=(0, 1, 2, 3)) -> None:
  message = _fingerprint_mismatch(built, got, columns)
  if message:
    raise ValueError(message)


def check_mask_matches_inputs(mask, query_positions, query_segment_ids, kv_positions,
                              kv_segment_ids) -> None:
  """The mask's fingerprint against this call's ids, in its checked_fingerprint_columns."""
  if mask.fingerprint is None:
    return
  got = mask_fingerprint(query_positions, query_segment_ids, kv_positions, kv_segment_ids)
  built = mask.fingerprint
  check = functools.partial(_raise_on_mismatch, columns=tuple(mask.checked_fingerprint_columns))
  if isinstance(got, jax.core.Tracer) or isinstance(built, jax.core.Tracer):
    jax.debug.callback(check, built, got)
  else:
    check(built, got)
