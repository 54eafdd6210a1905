"""Mesh and specs of a sharded call. Specs are 4-entry (batch, sequence, heads, head_dim) tuples
of mesh axis names (or tuples, or None) per BSHD array, from query_specs= / kv_specs= or the
innermost `attention_specs(...)`; the query's sequence entry is the context axis.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterator, Sequence

import jax

AxisNames = tuple[str, ...]
_DIM_NAMES = ("batch", "sequence", "heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class AttentionSpecs:
  """Normalised specs: each of the 4 entries is a tuple of mesh axis names (() = unsharded)."""

  query: tuple[AxisNames, AxisNames, AxisNames, AxisNames]
  kv: tuple[AxisNames, AxisNames, AxisNames, AxisNames]

  @property
  def batch_axes(self) -> AxisNames:
    return self.query[0]

  @property
  def context_axes(self) -> AxisNames:
    return self.query[1]

  @property
  def head_axes(self) -> AxisNames:
    return self.query[2]


_ATTENTION_SPECS: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar(
    "kvax_plugin_attention_specs", default=None)


def _normalise_entry(entry: Any, name: str, dim: int) -> AxisNames:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
    return tuple(entry)
  raise TypeError(f"{name}[{dim}] ({_DIM_NAMES[dim]}) must be a mesh axis name, a tuple of names "
                  f"or None, got {entry!r}")


def normalise_spec(spec: Any, name: str) -> tuple[AxisNames, AxisNames, AxisNames, AxisNames]:
  if isinstance(spec, str) or not isinstance(spec, Sequence) or len(spec) != 4:
    raise ValueError(f"{name} must be a 4-entry spec (batch, sequence, heads, head_dim) for a BSHD "
                     f"array, got {spec!r}")
  out = tuple(_normalise_entry(e, name, i) for i, e in enumerate(spec))
  seen: set[str] = set()
  for axes in out:
    for a in axes:
      if a in seen:
        raise ValueError(f"{name} uses mesh axis {a!r} more than once: {spec!r}")
      seen.add(a)
  return out  # type: ignore[return-value]


@contextlib.contextmanager
def attention_specs(query_specs: Any, kv_specs: Any = None) -> Iterator[None]:
  """Set the specs of attention calls with a mesh and no explicit specs, in this context (a
  contextvar: per thread / task, restored on exit). kv_specs None means (query batch, None,
  query heads, None)."""
  q = normalise_spec(query_specs, "query_specs")
  kv = None if kv_specs is None else normalise_spec(kv_specs, "kv_specs")
  token = _ATTENTION_SPECS.set((q, kv))
  try:
    yield
  finally:
    _ATTENTION_SPECS.reset(token)


def current_attention_specs() -> tuple[Any, Any] | None:
  """(query_specs, kv_specs) of the innermost attention_specs context, or None outside one."""
  return _ATTENTION_SPECS.get()


def resolve_specs(query_specs: Any = None, kv_specs: Any = None) -> AttentionSpecs:
  """Explicit arguments first, then the attention_specs context; kv derived from query last."""
  ctx = _ATTENTION_SPECS.get()
  q = (normalise_spec(query_specs, "query_specs") if query_specs is not None
       else (ctx[0] if ctx is not None else None))
  if q is None:
    raise ValueError("a mesh was given but no query_specs: pass query_specs= (and kv_specs=) or "
                     "call inside `with attention_specs(query_specs, kv_specs):`")
  if kv_specs is not None:
    kv = normalise_spec(kv_specs, "kv_specs")
  elif ctx is not None and ctx[1] is not None and query_specs is None:
    kv = ctx[1]
  else:
    kv = (q[0], (), q[2], ())
  return AttentionSpecs(q, kv)


def spec_entry(axes: AxisNames):
  """A PartitionSpec entry: None, one name or a tuple of names."""
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def axis_name(axes: AxisNames):
  """The axis_name of a collective over `axes` (non-empty)."""
  return axes if len(axes) > 1 else axes[0]


def axes_size(mesh, axes: AxisNames) -> int:
  return int(math.prod(mesh.shape[a] for a in axes))


def mesh_axes(mesh) -> tuple[tuple[str, int], ...]:
  return tuple((str(a), int(mesh.shape[a])) for a in mesh.axis_names)


def check_specs(specs: AttentionSpecs, mesh) -> None:
  """Rules that do not depend on shapes; every error names the offending argument."""
  names = set(mesh.axis_names)
  for label, spec in (("query_specs", specs.query), ("kv_specs", specs.kv)):
    for dim, axes in enumerate(spec):
      for a in axes:
        if a not in names:
          raise ValueError(f"{label}[{dim}] ({_DIM_NAMES[dim]}) names mesh axis {a!r}, but the "
                           f"mesh has axes {tuple(mesh.axis_names)}")
    if spec[3]:
      raise ValueError(f"{label}[3] (head_dim) must be None: the head dimension cannot be sharded, "
                       f"got {spec_entry(spec[3])!r}")
  if specs.kv[1]:
    raise ValueError(
        f"kv_specs[1] (key/value sequence) must be None, got {spec_entry(specs.kv[1])!r}: "
        "key/value are all-gathered over the query's context axis (query_specs[1]) inside the "
        "op; pass them context-sharded or replicated, the spec describes the gathered view")
  if specs.query[0] != specs.kv[0]:
    raise ValueError(f"query_specs[0] and kv_specs[0] (batch) must be equal, got "
                     f"{spec_entry(specs.query[0])!r} and {spec_entry(specs.kv[0])!r}")
  if specs.kv[2] and specs.query[2] != specs.kv[2]:
    # Sharded kv heads must follow the query heads' axes, or a shard would miss kv heads its
    # query heads read.
    if not specs.query[2]:
      raise ValueError(
          f"kv_specs[2] (heads) shards the key/value heads over {spec_entry(specs.kv[2])!r} but "
          "query_specs[2] leaves the query heads unsharded: expected kv_specs[2] None (key/value "
          "heads replicated) or query_specs[2] naming the same mesh axes")
    raise ValueError(
        f"query_specs[2] and kv_specs[2] (heads) name different mesh axes, "
        f"{spec_entry(specs.query[2])!r} and {spec_entry(specs.kv[2])!r}: expected kv_specs[2] "
        "equal to query_specs[2] (kv heads sharded like the query heads) or None (kv heads "
        "replicated; each shard then uses the kv heads its own query heads read)")


def _check_divisible(what: str, length: int, arg: str, size: int, axes: AxisNames) -> None:
  if length % size:
    raise ValueError(f"{what} ({length}) must be divisible by the size of its mesh axes "
                     f"{axes} ({size}) given in {arg}")


def check_shapes(specs: AttentionSpecs, mesh, *, batch: int, q_len: int, kv_len: int,
                 heads: int | None = None, kv_heads: int | None = None,
                 token_order: str = "natural") -> None:
  """Divisibility of every sharded dimension by its axes' sizes."""
  dp = axes_size(mesh, specs.batch_axes)
  cp = axes_size(mesh, specs.context_axes)
  tp = axes_size(mesh, specs.head_axes)
  _check_divisible("batch", batch, "query_specs[0]", dp, specs.batch_axes)
  _check_divisible("query sequence length", q_len, "query_specs[1]", cp, specs.context_axes)
  _check_divisible("key/value sequence length", kv_len, "query_specs[1] (the all-gather of key/"
                   "value)", cp, specs.context_axes)
  if token_order == "llama3" and cp > 1:
    for what, n in (("query sequence length", q_len), ("key/value sequence length", kv_len)):
      if n % (2 * cp):
        raise ValueError(f"{what} ({n}) must be divisible by 2 * cp = {2 * cp} when "
                         'token_order="llama3" (permute_tokens_for_load_balance=True: 2*cp '
                         "load-balancing chunks)")
  if heads is not None:
    _check_divisible("query heads", heads, "query_specs[2]", tp, specs.head_axes)
  if specs.kv[2] and kv_heads is not None and kv_heads % tp and tp % kv_heads:
    raise ValueError(
        f"key/value heads ({kv_heads}) and the size of the head axes {specs.head_axes} ({tp}) "
        "given in kv_specs[2] must divide one another: either every shard holds whole kv heads "
        "or each kv head is shared by a whole number of shards; or pass kv_specs[2]=None "
        "(key/value heads replicated, each shard taking the kv heads its query heads read)")


def checked_layout(mesh, query_specs: Any, kv_specs: Any, token_order: str, *, batch: int,
                   q_len: int, kv_len: int, heads: int | None = None,
                   kv_heads: int | None = None) -> tuple[AttentionSpecs, int, str]:
  """(specs, context size, token order) of a sharded call, checked against the mesh and the
  shapes; the order is "natural" without context parallelism."""
  specs = resolve_specs(query_specs, kv_specs)
  check_specs(specs, mesh)
  cp = axes_size(mesh, specs.context_axes)
  order = token_order if cp > 1 else "natural"
  check_shapes(specs, mesh, batch=batch, q_len=q_len, kv_len=kv_len, heads=heads,
               kv_heads=kv_heads, token_order=order)
  return specs, cp, order


def ambient_mesh():
  """The surrounding mesh (`with jax.set_mesh(mesh)`, abstract inside jit, else the older
  `with mesh:`), or None."""
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # inside jit: only the abstract mesh is known there
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty:
    return mesh
  # kvax's `with mesh:` context has no public reader (pxla's alias is deprecated).
  from jax._src import mesh as mesh_lib
  resources = getattr(mesh_lib, "thread_resources", None)
  legacy = None if resources is None else resources.env.physical_mesh
  return None if legacy is None or legacy.empty else legacy


def mesh_for_mask(mesh, query_specs=None) -> Any:
  """The mesh a mask is built on: the explicit one, else the surrounding mesh when specs are
  known (query_specs= or attention_specs), else None (one device)."""
  if mesh is not None or (query_specs is None and current_attention_specs() is None):
    return mesh
  return ambient_mesh()


def context_size(mesh, query_specs: Any = None) -> int:
  """The size of the query's sequence axes (query_specs, else the context's) on `mesh`."""
  specs = resolve_specs(query_specs)
  check_specs(specs, mesh)
  return axes_size(mesh, specs.context_axes)


__all__ = ["AxisNames", "AttentionSpecs", "attention_specs", "current_attention_specs",
           "resolve_specs", "normalise_spec", "check_specs", "check_shapes", "checked_layout",
           "ambient_mesh", "mesh_for_mask", "context_size"]
