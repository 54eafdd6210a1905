"""The mask of a sharded call: per-shard block tables and how they are laid out on the mesh
(built by sharded.create_attention_mask_sharded)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvax_plugin.attention.block_mask import AttentionMask, BlockTable, MaskSpec
from kvax_plugin.attention.specs import AttentionSpecs, AxisNames


@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """How a ShardedAttentionMask's tables are distributed (static, hashable)."""

  mesh_axes: tuple[tuple[str, int], ...]  # (name, size) of the mesh the tables were built on
  batch_axes: AxisNames
  context_axes: AxisNames
  context_size: int
  token_order: str  # the order the inputs arrive in ("natural" whenever context_size == 1)
  local_spec: MaskSpec  # per-shard problem (with overlap_kv_gather: the local part)
  # flash_attention(mesh=None) runs on these; an explicit mesh must match.
  mesh: Any = None
  specs: AttentionSpecs | None = None
  # Overlapped kv collective: remote_spec is the other shards' kv, ascending rank.
  overlap_kv_gather: bool = False
  remote_spec: MaskSpec | None = None
  kv_grad_reduce_dtype: str = "auto"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ShardedAttentionMask(AttentionMask):
  """An AttentionMask with per-shard tables: int32 [B, context_size * n_local] sharded
  (layout.batch_axes, layout.context_axes); `spec` is the global problem. kv_arrangement
  ("balanced" only): int32 [B, context_size * Skv], each shard's slice the document-order
  permutation of its gathered kv. With layout.overlap_kv_gather, fwd / dq / dkv are the local
  part's tables and `remote` the remote part's (other shards' kv, ascending rank);
  kv_arrangement is then the remote kv's document order (cp > 2, llama3 / balanced) or None."""

  # Both sides order-free, and the query side in order (tables index the shard's queries as they
  # arrive). Not the kv side in order: the op rearranges the gathered kv, and kvax_plugin.ops
  # builds from natural-order kv ids and calls with llama3-ordered ones.
  checked_fingerprint_columns = (0, 1, 2)

  layout: ShardLayout | None = None
  kv_arrangement: jax.Array | None = None
  remote: tuple[BlockTable, BlockTable | None, BlockTable | None] | None = None

  def tree_flatten(self):
    return ((self.fwd, self.dq, self.dkv, self.fingerprint, self.kvax_views, self.kv_arrangement,
             self.remote), (self.spec, self.layout))

  @classmethod
  def tree_unflatten(cls, aux, children):
    spec, layout = aux
    fwd, dq, dkv, fingerprint, kvax_views, kv_arrangement, remote = children
    return cls(spec, fwd, dq, dkv, fingerprint=fingerprint, kvax_views=kvax_views,
               layout=layout, kv_arrangement=kv_arrangement, remote=remote)

  @property
  def token_order(self) -> str:
    return self.layout.token_order

  def local(self, fwd: BlockTable, dq: BlockTable | None,
            dkv: BlockTable | None) -> AttentionMask:
    return AttentionMask(self.layout.local_spec, fwd, dq, dkv)

  def remote_part(self, fwd: BlockTable, dq: BlockTable | None,
                  dkv: BlockTable | None) -> AttentionMask:
    return AttentionMask(self.layout.remote_spec, fwd, dq, dkv)


__all__ = ["ShardLayout", "ShardedAttentionMask"]
