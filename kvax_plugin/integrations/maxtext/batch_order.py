"""The context-parallel token order of MaxText batches with attention=kvax.

MaxText's load-balanced context parallelism permutes each batch in its input pipeline (Llama 3's
dual chunk swap). With attention=kvax, `kvax_context_parallel_order` chooses the order instead:
"auto" ("balanced" when MaxText reorders, else "natural"), "balanced", "llama3" or "natural".
The op is told which order arrives; nothing in the step needs undoing. install() routes
get_reorder_callable through `reorder_callable` (as patches/maxtext/<version>/0004 does).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from kvax_plugin import PADDING_SEGMENT_ID
from kvax_plugin.attention import token_order as orders
from kvax_plugin.integrations.maxtext import settings

ORDER_KEY = "kvax_context_parallel_order"
CHOICES = ("auto",) + orders.ORDERS
REORDER_KEYS = ("inputs", "targets", "inputs_position", "targets_position", "inputs_segmentation",
                "targets_segmentation", "corruption_mask", "targets_loss_mask")
MAXTEXT_PADDING_SEGMENT_ID = 0


def _uses_kvax(config) -> bool:
  return getattr(config, "attention", None) == "kvax"


def configured_order(config) -> str:
  value = settings.config_value(config, ORDER_KEY)
  if value not in CHOICES:
    raise ValueError(f"MaxText config {ORDER_KEY}={value!r}: must be one of {CHOICES}")
  return value


def order_for(config, reorder_cp_size: int, context_size: int = 1) -> str:
  """The order batches arrive in, given the cp MaxText reorders for (1: none) and the context
  axis size. "llama3" / "balanced" without MaxText's reorder on a context-parallel mesh is an
  error naming both keys."""
  value = configured_order(config)
  if reorder_cp_size > 1:
    return "balanced" if value == "auto" else value
  if value in ("llama3", "balanced") and context_size > 1:
    raise ValueError(
        f"MaxText config {ORDER_KEY}={value!r} needs context_parallel_load_balance=true: "
        "MaxText reorders batches (and so applies a token order) only then")
  return "natural"


def order_for_mesh(config, mesh) -> str:
  if mesh is None:
    return "natural"
  from maxtext.utils import max_utils
  context_size = mesh.shape.get(getattr(config, "context_sharding", "context"), 1)
  return order_for(config, max_utils.reordered_cp_size(config, mesh), context_size)


def unit_blocks(config) -> tuple[int, int]:
  """(unit, kv_block) of the balanced order: the larger query block size, the forward kv block."""
  options = settings.options_from_config(config)
  unit = max(options.fwd_params.query_block_size, options.bwd_params.query_block_size)
  return unit, options.fwd_params.kv_block_size


def _kvax_segments(batch) -> tuple[jax.Array, jax.Array]:
  pos = batch["inputs_position"]
  if pos.ndim == 3:
    pos = pos[..., 0]
  seg = batch.get("inputs_segmentation")
  if seg is None:
    seg = jnp.zeros(pos.shape, jnp.int32)
  seg = jnp.where(seg == MAXTEXT_PADDING_SEGMENT_ID, PADDING_SEGMENT_ID, seg.astype(jnp.int32))
  return pos.astype(jnp.int32), seg


def balanced_reorder(config, cp_size: int):
  unit, kv_block = unit_blocks(config)
  seq_len = int(getattr(config, "max_target_length"))
  if seq_len % (cp_size * unit):
    raise ValueError(
        f"{ORDER_KEY}=\"balanced\" moves whole blocks of {unit} tokens (the larger of "
        f"kvax_fwd_query_block_size / kvax_bwd_query_block_size) and gives each of the {cp_size} "
        f"context ranks the same number: max_target_length ({seq_len}) must be a multiple of "
        f"{cp_size * unit}; change max_target_length or the kvax block sizes, or choose "
        f'{ORDER_KEY}="llama3"')

  @jax.jit
  def reorder(batch):
    pos, seg = _kvax_segments(batch)
    tok = orders.balanced_order(pos, seg, cp_size, block=unit, kv_block=kv_block)
    return {k: (orders.apply_token_order(v, tok) if k in REORDER_KEYS and v is not None
                and getattr(v, "ndim", 0) >= 2 else v) for k, v in batch.items()}

  return reorder


def reorder_callable(config, cp_size: int, upstream):
  """What MaxText's setup_train_loop wraps its data iterators with: `upstream` (MaxText's own
  reorder) unless attention=kvax chose another order."""
  if not _uses_kvax(config):
    return upstream
  order = order_for(config, cp_size)
  if order == "llama3":
    return upstream
  if order == "natural":
    return lambda batch: batch
  reorder = balanced_reorder(config, cp_size)
  shard_mode = getattr(config, "shard_mode", None)

  def apply(batch):
    out = reorder(batch)
    for v in batch.values():
      if isinstance(v, jax.Array):
        from maxtext.utils import sharding
        return sharding.maybe_shard_with_name(out, v.sharding, shard_mode)
    return out

  return apply


@contextlib.contextmanager
def reorder_hook(config):
  from maxtext.utils import maxtext_utils
  original = maxtext_utils.get_reorder_callable

  @functools.wraps(original)
  def get_reorder_callable(cp_size, *args, **kwargs):
    return reorder_callable(config, cp_size, original(cp_size, *args, **kwargs))

  maxtext_utils.get_reorder_callable = get_reorder_callable
  try:
    yield
  finally:
    maxtext_utils.get_reorder_callable = original


def setup_train_loop_entry(setup):
  if getattr(setup, "__kvax_original__", None) is not None:
    return setup

  @functools.wraps(setup)
  def wrapper(config, *args, **kwargs):
    if not _uses_kvax(config):
      return setup(config, *args, **kwargs)
    with reorder_hook(config):
      return setup(config, *args, **kwargs)

  wrapper.__kvax_original__ = setup
  return wrapper


def to_natural_order(tree, batch):
  """Arrays [B, S, ...] (batch and sequence axes 0 and 1) of a reordered batch back in natural
  order, recovered from the batch's positions and segmentation (token_order.document_order)."""
  pos, seg = _kvax_segments(batch)
  doc = orders.document_order(pos, seg)
  return orders.apply_token_order(tree, orders.TokenOrder(doc, jnp.argsort(doc, axis=1)))


__all__ = ["ORDER_KEY", "CHOICES", "configured_order", "order_for", "order_for_mesh",
           "unit_blocks", "balanced_reorder", "reorder_callable", "reorder_hook",
           "setup_train_loop_entry", "to_natural_order"]
