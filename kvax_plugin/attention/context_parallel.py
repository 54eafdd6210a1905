"""Context parallelism's public names: kvax 0.1.0's permutations and the documented helpers.
Defined in specs.py (mesh and specs), token_order.py, kv_exchange.py, sharded_mask.py,
sharded.py and balance.py; the design is in docs/context-parallelism.md.
"""

from __future__ import annotations

from typing import Any

from kvax_plugin.attention.balance import context_parallel_balance
from kvax_plugin.attention.kv_exchange import KV_GRAD_REDUCE_CHOICES, kv_grad_reduce_dtype
from kvax_plugin.attention.sharded import create_attention_mask_sharded
from kvax_plugin.attention.sharded_mask import ShardedAttentionMask, ShardLayout
from kvax_plugin.attention.specs import (AttentionSpecs, ambient_mesh, attention_specs,
                                         context_size, current_attention_specs, resolve_specs)
from kvax_plugin.attention.token_order import ORDERS as TOKEN_ORDERS
from kvax_plugin.attention.token_order import (from_load_balanced_order, resolve_token_order,
                                               to_load_balanced_order)


def _context_size_for(mesh, query_specs, fn: str) -> int:
  mesh = ambient_mesh() if mesh is None else mesh
  if mesh is None:
    raise ValueError(f"{fn} reads the context size from a mesh: pass mesh= or call it inside "
                     "`with jax.set_mesh(mesh):` (or `with mesh:`)")
  return context_size(mesh, query_specs)


def permute_tokens_context_parallelism(inputs, mesh=None, *, query_specs: Any = None):
  """kvax 0.1.0's permutation, natural -> load-balanced order along axis 1, of an array or a
  nested tuple / list of [B, S, ...] arrays; cp is the size of the query's sequence axes on `mesh`
  (None: the surrounding mesh). to_load_balanced_order takes cp explicitly."""
  cp = _context_size_for(mesh, query_specs, "permute_tokens_context_parallelism")
  return to_load_balanced_order(inputs, cp, axis=1)


def unpermute_tokens_context_parallelism(inputs, mesh=None, *, query_specs: Any = None):
  """Inverse of permute_tokens_context_parallelism."""
  cp = _context_size_for(mesh, query_specs, "unpermute_tokens_context_parallelism")
  return from_load_balanced_order(inputs, cp, axis=1)


__all__ = ["attention_specs", "current_attention_specs", "resolve_specs", "AttentionSpecs",
           "ShardedAttentionMask", "ShardLayout", "to_load_balanced_order",
           "from_load_balanced_order", "permute_tokens_context_parallelism",
           "unpermute_tokens_context_parallelism", "ambient_mesh", "context_size",
           "context_parallel_balance", "create_attention_mask_sharded", "kv_grad_reduce_dtype",
           "KV_GRAD_REDUCE_CHOICES", "TOKEN_ORDERS", "resolve_token_order"]
