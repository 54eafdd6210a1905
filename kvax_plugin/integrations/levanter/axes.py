"""Haliax named arrays <-> kvax's BSHD arrays, and haliax axis mappings -> kvax sharding specs.

Axes are classified by role (names, not order) and flattened: query [B, S, H, D] with H = kv
heads x group, kv head major; key / value [B, S, K, D]. kvax's specs follow haliax's active axis
mapping: batch <- the batch axes' mesh axes, context <- the query position's, heads <- the heads'.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from haliax import Axis, NamedArray
import haliax as hax
from haliax import partitioning

# Shared axes with these names are kv heads; other shared non-sequence, non-dim axes are batch.
KV_HEAD_AXIS_NAMES = ("kv_head", "heads")


class UnsupportedLayout(ValueError):
  """The named axes do not map onto BSHD (the caller routes the call to Levanter's own path)."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """Roles of the named axes of one attention call (all static)."""

  batch: tuple[Axis, ...]
  q_pos: Axis
  kv_pos: Axis
  kv_heads: tuple[Axis, ...]
  groups: tuple[Axis, ...]  # query-only head axes (GQA), minor to kv_heads
  qk_dim: Axis
  v_dim: Axis

  @property
  def batch_size(self) -> int:
    return math.prod(a.size for a in self.batch)

  @property
  def num_kv_heads(self) -> int:
    return math.prod(a.size for a in self.kv_heads)

  @property
  def num_heads(self) -> int:
    return self.num_kv_heads * math.prod(a.size for a in self.groups)

  def query(self, q: NamedArray) -> jax.Array:
    """[B, Sq, H, Dqk]."""
    arr = q.rearrange((*self.batch, self.q_pos, *self.kv_heads, *self.groups, self.qk_dim)).array
    return arr.reshape(self.batch_size, self.q_pos.size, self.num_heads, self.qk_dim.size)

  def key(self, k: NamedArray) -> jax.Array:
    """[B, Skv, K, Dqk]."""
    arr = k.rearrange((*self.batch, self.kv_pos, *self.kv_heads, self.qk_dim)).array
    return arr.reshape(self.batch_size, self.kv_pos.size, self.num_kv_heads, self.qk_dim.size)

  def value(self, v: NamedArray) -> jax.Array:
    """[B, Skv, K, Dv]."""
    arr = v.rearrange((*self.batch, self.kv_pos, *self.kv_heads, self.v_dim)).array
    return arr.reshape(self.batch_size, self.kv_pos.size, self.num_kv_heads, self.v_dim.size)

  def output(self, out: jax.Array) -> NamedArray:
    """[B, Sq, H, Dv] -> named (*batch, q_pos, *kv_heads, *groups, v_dim)."""
    axes = (*self.batch, self.q_pos, *self.kv_heads, *self.groups, self.v_dim)
    return hax.named(out.reshape(tuple(a.size for a in axes)), axes)

  def sinks(self, sinks: NamedArray) -> jax.Array:
    """Per-query-head sink logits [H] from a named array over (some of) the head axes."""
    heads = (*self.kv_heads, *self.groups)
    extra = [a.name for a in sinks.axes if a.name not in {h.name for h in heads}]
    if extra:
      raise UnsupportedLayout(f"attention sinks with axes {extra} besides the head axes")
    for h in heads:
      if h.name not in {a.name for a in sinks.axes}:
        sinks = sinks.broadcast_axis(h)
    return sinks.rearrange(heads).array.reshape(self.num_heads)


def _names(axes) -> set[str]:
  return {a.name for a in axes}


def classify(query: NamedArray, key: NamedArray, value: NamedArray, q_pos: str, kv_pos: str,
             qk_dim: str, batch_names: tuple[str, ...] | None = None) -> Layout:
  """The Layout of one call (UnsupportedLayout if kvax cannot take it). batch_names: the batch
  axes the decoder entry saw (None: by name)."""
  for what, name in (("query position", q_pos), ("key position", kv_pos), ("key dim", qk_dim)):
    if not isinstance(name, (str, Axis)):
      raise UnsupportedLayout(f"{what} spans several axes ({name!r})")
  q_pos_axis = query.resolve_axis(q_pos)
  kv_pos_axis = key.resolve_axis(kv_pos)
  if value.resolve_axis(kv_pos).size != kv_pos_axis.size:
    raise UnsupportedLayout("key and value sequence lengths differ")
  dim = query.resolve_axis(qk_dim)
  if key.resolve_axis(qk_dim).size != dim.size:
    raise UnsupportedLayout("query and key head dims differ")
  seq_and_dim = {q_pos_axis.name, kv_pos_axis.name, dim.name}
  shared = [a for a in query.axes
            if a.name in _names(key.axes) and a.name in _names(value.axes)
            and a.name not in seq_and_dim]
  for a in shared:
    if key.resolve_axis(a.name).size != a.size or value.resolve_axis(a.name).size != a.size:
      raise UnsupportedLayout(f"axis {a.name!r} has different sizes in query, key and value")
  if batch_names is None:
    batch = tuple(a for a in shared if a.name not in KV_HEAD_AXIS_NAMES)
  else:
    batch = tuple(a for a in shared if a.name in batch_names)
    if _names(batch) != set(batch_names):
      raise UnsupportedLayout(f"query/key/value lack batch axes {sorted(set(batch_names))} of "
                              "the decoder input")
  kv_heads = tuple(a for a in shared if a not in batch)
  groups = tuple(a for a in query.axes if a.name not in _names(shared) | seq_and_dim)
  key_extra = _names(key.axes) - _names(shared) - seq_and_dim
  if key_extra:
    raise UnsupportedLayout(f"key has axes {sorted(key_extra)} that query/value lack")
  v_rest = [a for a in value.axes if a.name not in _names(shared) | {kv_pos_axis.name}]
  if len(v_rest) != 1:
    raise UnsupportedLayout(f"value needs exactly one head-dim axis besides batch, heads and "
                            f"sequence, found {[a.name for a in v_rest]}")
  return Layout(batch=batch, q_pos=q_pos_axis, kv_pos=kv_pos_axis, kv_heads=kv_heads,
                groups=groups, qk_dim=dim, v_dim=v_rest[0])


def tokens(ids: NamedArray, batch: tuple[Axis, ...], pos_name: str) -> jax.Array:
  """A named [*batch?, pos] integer array -> int32 [B, S], broadcast over missing batch axes."""
  pos = ids.resolve_axis(pos_name)
  extra = _names(ids.axes) - _names(batch) - {pos.name}
  if extra:
    raise UnsupportedLayout(f"segment ids have axes {sorted(extra)} the decoder input lacks")
  for a in batch:
    if a.name not in _names(ids.axes):
      ids = ids.broadcast_axis(a)
  arr = ids.rearrange((*batch, pos)).array.astype("int32")
  return arr.reshape(math.prod(a.size for a in batch), pos.size)


# ----------------------------------------------------------------------------- sharding


def current_mesh():
  """The mesh of jax.set_mesh (abstract while jit traces), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty:
    return mesh
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # inside jit: only the abstract mesh exists, and it is empty
    return None
  if mesh is not None and not mesh.empty:
    return mesh
  return None


def _mesh_axes_of(names, mapping, mesh) -> tuple[str, ...]:
  """Mesh axes that the logical axes `names` map to, in order, once each, those on the mesh."""
  out: list[str] = []
  for name in names:
    target = mapping.get(name)
    if target is None:
      continue
    for axis in ((target,) if isinstance(target, str) else tuple(target)):
      if axis in mesh.axis_names and axis not in out:
        out.append(axis)
  return tuple(out)


def _size(mesh, axes: tuple[str, ...]) -> int:
  return int(math.prod(mesh.shape[a] for a in axes))


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


@dataclasses.dataclass(frozen=True)
class TokenSpecs:
  """Mesh axes of the batch and query-sequence dimensions (what the block mask depends on)."""

  batch: tuple[str, ...]
  context: tuple[str, ...]


def token_specs(mesh, batch: tuple[Axis, ...], q_pos: Axis) -> TokenSpecs:
  """Batch / context mesh axes from the active haliax axis mapping; a dimension its mesh axes
  do not divide stays unsharded."""
  mapping = partitioning.current_thread_local_mapping() or {}
  b_axes = _mesh_axes_of([a.name for a in batch], mapping, mesh)
  if math.prod(a.size for a in batch) % _size(mesh, b_axes):
    b_axes = ()
  c_axes = tuple(a for a in _mesh_axes_of([q_pos.name], mapping, mesh) if a not in b_axes)
  if q_pos.size % _size(mesh, c_axes):
    c_axes = ()
  return TokenSpecs(b_axes, c_axes)


def head_axes(mesh, layout: Layout, tokens_: TokenSpecs) -> tuple[str, ...]:
  """Mesh axes of kvax's flattened head dimension H = (*kv_heads, *groups), row-major, or ()
  (unsharded) unless every dim before the last sharded one is split completely and each shard
  holds whole GQA groups (or shares one kv head)."""
  mapping = partitioning.current_thread_local_mapping() or {}
  used = set(tokens_.batch) | set(tokens_.context)
  out: list[str] = []
  split = prefix = 1  # shards so far, and the product of the head dims seen so far
  for dim in (*layout.kv_heads, *layout.groups):
    dim_axes = [a for a in _mesh_axes_of([dim.name], mapping, mesh)
                if a not in used and a not in out]
    if dim_axes:
      size = _size(mesh, tuple(dim_axes))
      if split != prefix or dim.size % size:
        return ()
      out.extend(dim_axes)
      split *= size
    prefix *= dim.size
  axes = tuple(out)
  k, h = layout.num_kv_heads, layout.num_heads
  tp = _size(mesh, axes)
  if h % tp or (k % tp and tp % k):
    return ()
  return axes


def specs(tokens_: TokenSpecs, heads: tuple[str, ...]):
  """(query_specs, kv_specs) in kvax's BSHD form."""
  b, c, h = _entry(tokens_.batch), _entry(tokens_.context), _entry(heads)
  return (b, c, h, None), (b, None, h, None)
