"""What one flash_attention call runs, decided once from its validated arguments: the backend
and its options, the token order and, on a mesh, the specs and layout of the sharded path."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvax_plugin.attention import kernels, specs as specs_lib, validation
from kvax_plugin.attention.kv_exchange import KvHeadSelection, kv_head_selection
from kvax_plugin.attention.sharded_mask import ShardedAttentionMask
from kvax_plugin.attention.specs import AttentionSpecs
from kvax_plugin.attention.token_order import resolve_token_order


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
  """backend: a name of kernels.KERNEL_BACKENDS; options: what kernels.backend_options gives it.
  empty: an input has a zero size (the output is zeros). mesh None: one device; else specs,
  context_size, kv_heads (None: key / value enter sharded by kv_specs), kv_grad_reduce_dtype and
  overlap_kv_gather (both from the mask) describe the sharded path."""

  backend: str
  options: dict[str, Any]
  scale: float
  logits_soft_cap: float | None
  token_order: str
  features: tuple[str, ...]
  debug: bool = False
  empty: bool = False
  mesh: Any = None
  specs: AttentionSpecs | None = None
  context_size: int = 1
  kv_heads: KvHeadSelection | None = None
  kv_grad_reduce_dtype: str = "auto"
  overlap_kv_gather: bool = False

  @property
  def kernel_kwargs(self) -> dict[str, Any]:
    """The backend function's keyword arguments but sinks."""
    return dict(scale=self.scale, logits_soft_cap=self.logits_soft_cap, **self.options)


def features(query, key, value, mask, logits_soft_cap, sinks) -> tuple[str, ...]:
  """The kernels.FEATURES a call needs."""
  needed = {"causal": mask.spec.causal, "sliding_window": mask.spec.sliding_window is not None,
            "logits_soft_cap": logits_soft_cap is not None, "sinks": sinks is not None,
            "gqa": query.shape[2] != key.shape[2],
            "distinct_v_head_dim": value.shape[3] != query.shape[3],
            "backward": mask.has_backward}
  return tuple(name for name, used in needed.items() if used)


def _mesh_and_specs(mesh, mask, query_specs, kv_specs) -> tuple[Any, Any, Any]:
  """An explicit mesh (the mask must match it), else a sharded mask's mesh and specs (call or
  context specs win), else the surrounding mesh when specs are known (as kvax does), else None."""
  layout = mask.layout if isinstance(mask, ShardedAttentionMask) else None
  in_context = specs_lib.current_attention_specs() is not None
  if mesh is None and layout is not None and layout.mesh is not None:
    mesh = layout.mesh
  elif mesh is None and (query_specs is not None or in_context):
    mesh = specs_lib.ambient_mesh()
  if (mesh is not None and layout is not None and layout.specs is not None and query_specs is None
      and kv_specs is None and not in_context):
    query_specs, kv_specs = layout.specs.query, layout.specs.kv
  return mesh, query_specs, kv_specs


def make_plan(query, key, value, mask, *, scale: float, logits_soft_cap: float | None, sinks,
              backend: str, token_order: str | None,
              permute_tokens_for_load_balance: bool | None,
              deterministic_backward: bool | None, kernel_options,
              memory_optimized_gqa_backward: bool, mesh, query_specs, kv_specs,
              debug: bool = False) -> AttentionPlan:
  """The plan of a flash_attention call whose arguments validation.check_call accepted (scale,
  logits_soft_cap, kernel_options as it returned them). Raises what resolving them raises: an
  unknown token_order, BackendUnavailableError, specs or a mask that do not fit the mesh."""
  if (token_order is None and permute_tokens_for_load_balance is None
      and isinstance(mask, ShardedAttentionMask)):
    order = mask.token_order
  else:
    order = resolve_token_order(token_order, permute_tokens_for_load_balance)
  needed = features(query, key, value, mask, logits_soft_cap, sinks)
  name = kernels.resolve_backend_for(backend, query.dtype, query.shape[3], value.shape[3], needed,
                                     mask, deterministic_backward=deterministic_backward)
  if backend == "auto":
    kernel_options = kernels.auto_kernel_options(name, kernel_options)
  options = kernels.backend_options(
      name, memory_optimized_gqa_backward=memory_optimized_gqa_backward,
      deterministic_backward=deterministic_backward, kernel_options=kernel_options)
  plan = AttentionPlan(backend=name, options=options, scale=scale,
                       logits_soft_cap=logits_soft_cap, token_order=order, features=needed,
                       debug=debug, empty=validation.is_empty(query, key))
  if plan.empty:
    return plan
  mesh, query_specs, kv_specs = _mesh_and_specs(mesh, mask, query_specs, kv_specs)
  if mesh is None:
    return plan
  b, sq, h, _ = query.shape
  skv, kh = key.shape[1], key.shape[2]
  specs, cp, order = specs_lib.checked_layout(mesh, query_specs, kv_specs, order, batch=b,
                                              q_len=sq, kv_len=skv, heads=h, kv_heads=kh)
  validation.check_mask_layout(mask, specs, mesh, order)
  return dataclasses.replace(
      plan, mesh=mesh, specs=specs, context_size=cp, token_order=order,
      kv_heads=kv_head_selection(mesh, specs, h, kh),
      kv_grad_reduce_dtype=mask.layout.kv_grad_reduce_dtype,
      overlap_kv_gather=mask.layout.overlap_kv_gather)


__all__ = ["AttentionPlan", "make_plan", "features"]
