"""MaxText meshes and logical axis rules -> the kvax op's mesh and sharding specs, resolved when
the decoder is traced, under the logical-axis rules MaxText has active there and with the names
its Attention module gives query/key/value, so kvax shards like MaxText's own kernels. Key/value
sequence maps to no axis (all-gather context parallelism). MaxText's input pipeline permutes
tokens (batch_order.py); the op is only told the order.
"""

from __future__ import annotations

from kvax_plugin.integrations.maxtext import batch_order


def token_order(config, mesh) -> str:
  return batch_order.order_for_mesh(config, mesh)


def _entry(axes):
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
  order = token_order(config, mesh)
  if mesh is None or mesh.size <= 1:
    return dict(mesh=None, token_order=order)
  query_specs, kv_specs = resolve_specs(mesh)
  return dict(mesh=mesh, query_specs=query_specs, kv_specs=kv_specs, token_order=order)
