"""MaxText meshes and logical axis rules -> the kvax op's mesh and sharding specs.

The specs are resolved when the decoder is traced, from the flax logical-axis-rules context
MaxText has active there (its training rules in train_step, its eval rules in eval_step), with
the logical names MaxText's Attention module gives query/key/value in training, so kvax shards
like MaxText's own kernels. Key/value sequence maps to no axis (all-gather context parallelism).

Context parallelism: MaxText's input pipeline permutes the tokens when
context_parallel_load_balance is on (max_utils.reordered_cp_size > 1), in the order the
kvax_context_parallel_order key chooses (batch_order.py). We never permute again: we only tell
the op which order the tokens arrive in.
"""

from __future__ import annotations

from kvax_plugin.integrations.maxtext import batch_order


def token_order(config, mesh) -> str:
  """The order MaxText's input pipeline delivered the batch in ("natural", "llama3", "balanced")."""
  return batch_order.order_for_mesh(config, mesh)


def _entry(axes):
  # PartitionSpec entries are None, a name, or a tuple of names; keep that form, drop empties.
  if axes is None:
    return None
  if isinstance(axes, str):
    return axes
  axes = tuple(a for a in axes if a is not None)
  return axes or None


def resolve_specs(mesh) -> tuple[tuple, tuple]:
  """(query_spec, kv_spec), BSHD, as mesh axis names under the active logical axis rules."""
  from maxtext.common.common_types import ATTN_LENGTH, KV_BATCH, KV_HEAD, KV_HEAD_DIM
  from maxtext.utils.sharding import get_logical_axis_rules, logical_to_mesh_axes
  spec = logical_to_mesh_axes((KV_BATCH, ATTN_LENGTH, KV_HEAD, KV_HEAD_DIM), mesh=mesh,
                              rules=get_logical_axis_rules())
  batch, length, heads = (_entry(spec[i]) for i in range(3))
  return (batch, length, heads, None), (batch, None, heads, None)


def mesh_and_specs(config, mesh) -> dict:
  """KvaxOptions fields for this mesh: unsharded on one device, else mesh + specs + order."""
  order = token_order(config, mesh)
  if mesh is None or mesh.size <= 1:
    return dict(mesh=None, token_order=order)
  query_specs, kv_specs = resolve_specs(mesh)
  return dict(mesh=mesh, query_specs=query_specs, kv_specs=kv_specs, token_order=order)
