"""The op on a mesh (Llama 3 style context parallelism; docs/context-parallelism.md): the block
tables and the attention are computed per shard inside shard_map over batch, heads and query
sequence. Key, value and kv ids arrive sharded over the context axis and are exchanged there
(kv_exchange.py); positions and segment ids, never buffer indices, decide which pairs attend,
so any token order is exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kvax_plugin.attention import block_mask as bm
from kvax_plugin.attention import kernels
from kvax_plugin.attention import kv_exchange as kvx
from kvax_plugin.attention import split_kv_attention as split_kv
from kvax_plugin.attention import token_order as orders
from kvax_plugin.attention.block_mask import MaskSpec
from kvax_plugin.attention.kernels.custom_vjp import KernelParts, capture_kernel_parts
from kvax_plugin.attention.plan import AttentionPlan
from kvax_plugin.attention.sharded_mask import ShardedAttentionMask, ShardLayout
from kvax_plugin.attention.specs import axes_size, checked_layout, mesh_axes, spec_entry


def call_shard_map(fn, mesh, in_specs, out_specs, args):
  """shard_map(fn) under jit, each argument first moved to its in_spec (jax.reshard on Explicit
  meshes, a sharding constraint otherwise), since shard_map rejects inputs laid out otherwise.
  On a concrete mesh they are device_put first, so arrays committed to one device do not fail
  the jit with "incompatible devices"."""
  from jax.sharding import AxisType, NamedSharding

  explicit = any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))

  def shardings(spec):
    return jax.tree.map(lambda p: NamedSharding(mesh, p), spec,
                        is_leaf=lambda p: isinstance(p, P))

  def place(x, spec):
    sharding = shardings(spec)
    if explicit:
      return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)

  @jax.jit
  def run(*args):
    placed = [place(a, spec) for a, spec in zip(args, in_specs)]
    # check_vma=False: outputs are replicated over the head axes by construction.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*placed)

  # Concrete meshes only (inside jit the ambient mesh may be abstract).
  if isinstance(mesh, jax.sharding.Mesh):
    args = [jax.device_put(a, shardings(spec)) for a, spec in zip(args, in_specs)]
  return run(*args)


def create_attention_mask_sharded(query_positions: jax.Array,
                                  query_segment_ids: jax.Array,
                                  kv_positions: jax.Array,
                                  kv_segment_ids: jax.Array,
                                  *,
                                  fwd_params=None,
                                  bwd_params=None,
                                  calc_bwd_mask: bool = False,
                                  skip_pad_tokens: bool = True,
                                  causal: bool = True,
                                  sliding_window: int | None = None,
                                  mesh,
                                  query_specs=None,
                                  kv_specs=None,
                                  token_order: str = "llama3",
                                  overlap_kv_gather: bool = False,
                                  kv_grad_reduce_dtype: str = "auto"
                                  ) -> ShardedAttentionMask:
  """Per-shard block tables, built inside shard_map. query_positions / query_segment_ids: int32
  [B, Sq]; kv_positions / kv_segment_ids: int32 [B, Skv], in the order flash_attention gets the
  tokens (`token_order`, resolved). Specs: explicit or from attention_specs. overlap_kv_gather:
  build the overlapped path's local / remote tables (no effect without context parallelism).
  kv_grad_reduce_dtype: one of kv_exchange.KV_GRAD_REDUCE_CHOICES, recorded in the layout."""
  b, sq = query_positions.shape
  skv = kv_positions.shape[1]
  specs, cp, order = checked_layout(mesh, query_specs, kv_specs, token_order, batch=b, q_len=sq,
                                    kv_len=skv)
  dp = axes_size(mesh, specs.batch_axes)
  overlap = bool(overlap_kv_gather) and cp > 1
  local_specs: list[MaskSpec] = []
  mask_kw = dict(fwd_params=fwd_params, bwd_params=bwd_params, calc_bwd_mask=calc_bwd_mask,
                 skip_pad_tokens=skip_pad_tokens, causal=causal, sliding_window=sliding_window)

  def per_shard_split(qp, qs, kp, ks):
    # Local part: the shard's own kv (ascending natural order in every order). Remote part: the
    # other shards' kv; with cp > 2 llama3 / balanced interleave documents, so it is sorted.
    shard_mask = bm.create_attention_mask(qp, qs, kp, ks, **mask_kw)
    kp_r, ks_r = (kvx.gather_remote(x, specs.context_axes, cp) for x in (kp, ks))
    arrangement = None
    if cp > 2 and order != "natural":
      arrangement = orders.document_order(kp_r, ks_r)
      kp_r, ks_r = kvx.take_tokens(kp_r, arrangement), kvx.take_tokens(ks_r, arrangement)
    remote_mask = bm.create_attention_mask(qp, qs, kp_r, ks_r, **mask_kw)
    local_specs.append((shard_mask.spec, remote_mask.spec))
    return (shard_mask.fwd, shard_mask.dq, shard_mask.dkv, arrangement,
            (remote_mask.fwd, remote_mask.dq, remote_mask.dkv))

  def per_shard(qp, qs, kp, ks):
    gathered = "natural" if order == "balanced" else order
    kp, ks = kvx.gather_kv((kp, ks), specs.context_axes, cp, gathered, float_grad=False)
    arrangement = None
    if order == "balanced":
      arrangement = orders.document_order(kp, ks)
      kp, ks = kvx.take_tokens(kp, arrangement), kvx.take_tokens(ks, arrangement)
    shard_mask = bm.create_attention_mask(qp, qs, kp, ks, **mask_kw)
    local_specs.append(shard_mask.spec)
    return shard_mask.fwd, shard_mask.dq, shard_mask.dkv, arrangement

  tok = P(spec_entry(specs.batch_axes), spec_entry(specs.context_axes))
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  remote = remote_spec = None
  if overlap:
    fwd, dq, dkv, arrangement, remote = call_shard_map(per_shard_split, mesh,
                                                       (tok, tok, tok, tok), tok, ints)
    local, remote_spec = local_specs[-1]
    kv_ok = local.kv_len * cp == skv and remote_spec.kv_len == skv - local.kv_len
  else:
    fwd, dq, dkv, arrangement = call_shard_map(per_shard, mesh, (tok, tok, tok, tok), tok, ints)
    local = local_specs[-1]
    kv_ok = local.kv_len == skv
  if local.batch * dp != b or local.q_len * cp != sq or not kv_ok:
    raise AssertionError(f"internal: local mask spec {local} does not tile the global problem")
  spec = dataclasses.replace(local, batch=b, q_len=sq, kv_len=skv)
  layout = ShardLayout(mesh_axes=mesh_axes(mesh), batch_axes=specs.batch_axes,
                       context_axes=specs.context_axes, context_size=cp, token_order=order,
                       local_spec=local, mesh=mesh, specs=specs, overlap_kv_gather=overlap,
                       remote_spec=remote_spec, kv_grad_reduce_dtype=kv_grad_reduce_dtype)
  fingerprint = bm.mask_fingerprint(*ints)
  return ShardedAttentionMask(spec, fwd, dq, dkv, fingerprint=fingerprint, layout=layout,
                              kv_arrangement=arrangement, remote=remote)


def run_sharded(plan: AttentionPlan, query, key, value, query_positions, query_segment_ids,
                kv_positions, kv_segment_ids, mask: ShardedAttentionMask,
                sinks: jax.Array | None) -> jax.Array:
  """flash_attention on plan.mesh. query [B, Sq, H, Dqk] sharded by plan.specs; key / value
  [B, Skv, K, D] and kv ids [B, Skv] enter context-sharded and are gathered per shard; `mask`
  checked against the plan (make_plan). Returns [B, Sq, H, Dv] sharded like the query."""
  specs, cp, order = plan.specs, plan.context_size, plan.token_order
  reduce_choice = plan.kv_grad_reduce_dtype
  backend_fn = kernels.backend_function(plan.backend)
  kernel_kwargs = plan.kernel_kwargs
  has_sinks = sinks is not None
  pick_kv_head = (lambda x: x) if plan.kv_heads is None else plan.kv_heads.take

  def per_shard_split(q, k, v, qp, qs, kp, ks, tables, arrangement, remote_tables, s):
    k, v = pick_kv_head(k), pick_kv_head(v)
    split = kvx.split_local_remote(specs.context_axes, cp, reduce_choice)
    (k_loc, k_rem), (v_loc, v_rem) = split(k), split(v)
    kp_rem, ks_rem = (kvx.gather_remote(x, specs.context_axes, cp) for x in (kp, ks))
    if arrangement is not None:
      k_rem, v_rem = kvx.arrange(k_rem, arrangement), kvx.arrange(v_rem, arrangement)
      kp_rem, ks_rem = kvx.take_tokens(kp_rem, arrangement), kvx.take_tokens(ks_rem, arrangement)
    shard_mask = mask.local(*tables)
    remote_mask = mask.remote_part(*remote_tables)
    with capture_kernel_parts():
      parts_loc = backend_fn(q, k_loc, v_loc, qp, qs, kp, ks, shard_mask, sinks=None,
                             **kernel_kwargs)
      parts_rem = backend_fn(q, k_rem, v_rem, qp, qs, kp_rem, ks_rem, remote_mask, sinks=None,
                             **kernel_kwargs)
    if not isinstance(parts_loc, KernelParts) or not isinstance(parts_rem, KernelParts):
      raise ValueError(
          f'backend="{plan.backend}" has no separate forward / backward kernels, which the '
          "overlapped context-parallel path (a mask built with overlap_kv_gather=True) needs: "
          'use backend "hopper", "mosaic", "triton" or "jax", or build the mask without the '
          "overlap")
    return split_kv.split_kv_attention(
        parts_loc, parts_rem, q, qp, qs, split_kv.KvPart(k_loc, v_loc, kp, ks, shard_mask),
        split_kv.KvPart(k_rem, v_rem, kp_rem, ks_rem, remote_mask), s if has_sinks else None)

  def per_shard(q, k, v, qp, qs, kp, ks, tables, arrangement, s):
    k, v = pick_kv_head(k), pick_kv_head(v)
    k, v = kvx.gather_kv((k, v), specs.context_axes, cp, order, float_grad=True,
                         arrangement=arrangement, reduce_choice=reduce_choice)
    kp, ks = kvx.gather_kv((kp, ks), specs.context_axes, cp, order, float_grad=False,
                           arrangement=arrangement)
    shard_mask = mask.local(*tables)
    return backend_fn(q, k, v, qp, qs, kp, ks, shard_mask, sinks=s if has_sinks else None,
                      **kernel_kwargs)

  bat, ctx, hd = (spec_entry(a) for a in (specs.batch_axes, specs.context_axes, specs.head_axes))
  x_spec = P(bat, ctx, hd, None)
  # Without a kv-head selection key / value enter sharded by kv_specs; with one they enter whole
  # over the head axes and shard_map's transpose sums the shards' kv gradients (each zero outside
  # the heads it took).
  kv_spec = P(bat, ctx, spec_entry(specs.kv[2]) if plan.kv_heads is None else None, None)
  tok = P(bat, ctx)
  # Sinks in float32: shard_map sums their gradient over the batch / context shards.
  s = sinks.astype(jnp.float32) if has_sinks else jnp.zeros((query.shape[2],), jnp.float32)
  ints = [x.astype(jnp.int32) for x in (query_positions, query_segment_ids, kv_positions,
                                        kv_segment_ids)]
  tables = (mask.fwd, mask.dq, mask.dkv)
  if plan.overlap_kv_gather:
    return call_shard_map(
        per_shard_split, plan.mesh,
        (x_spec, kv_spec, kv_spec, tok, tok, tok, tok, tok, tok, tok, P(hd)), x_spec,
        (query, key, value, *ints, tables, mask.kv_arrangement, mask.remote, s))
  return call_shard_map(per_shard, plan.mesh,
                        (x_spec, kv_spec, kv_spec, tok, tok, tok, tok, tok, tok, P(hd)), x_spec,
                        (query, key, value, *ints, tables, mask.kv_arrangement, s))


__all__ = ["create_attention_mask_sharded", "run_sharded", "call_shard_map"]
