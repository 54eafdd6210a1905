"""MaxText meshes and logical axis rules -> the kvax op's mesh and sharding specs.

The specs are resolved at call time from the flax logical-axis-rules context MaxText has
active (its training rules in train_step, its eval rules in eval_step), using the same logical
names MaxText's Attention module gives query/key/value, so kvax shards exactly like MaxText's
own kernels would. Key/value sequence maps to no axis (all-gather context parallelism).

Context parallelism: MaxText's input pipeline already permutes tokens into the load-balanced
order when context_parallel_load_balance is on (max_utils.reordered_cp_size > 1). We never
permute again: we only tell the op the tokens arrive permuted.
"""

from __future__ import annotations

import contextlib
import importlib


def _sharding_module():
  """kvax_plugin's sharding module, or None when this kvax_plugin has none yet."""
  try:
    return importlib.import_module("kvax_plugin.attention.sharding")
  except ImportError:
    return None


def permuted_for_load_balance(config, mesh) -> bool:
  """Whether MaxText's input pipeline delivered the batch in load-balanced order."""
  if mesh is None:
    return False
  from maxtext.utils import max_utils
  return max_utils.reordered_cp_size(config, mesh) > 1


def attention_mesh(config, mesh):
  """(mesh for the kvax op or None, tokens-arrive-permuted flag).

  None means: call the op unsharded and let jit partition it (one device, or no sharding
  support in this kvax_plugin). That is exact on any mesh, only slower.
  """
  permuted = permuted_for_load_balance(config, mesh)
  if mesh is None or mesh.size <= 1 or _sharding_module() is None:
    return None, permuted
  return mesh, permuted


def resolve_specs(mesh):
  """(query_spec, kv_spec) BSHD from the active logical axis rules, as mesh axis names."""
  from maxtext.common.common_types import ATTN_LENGTH, KV_BATCH, KV_HEAD, KV_HEAD_DIM
  from maxtext.utils.sharding import get_logical_axis_rules, logical_to_mesh_axes
  rules = get_logical_axis_rules()
  q = tuple(logical_to_mesh_axes((KV_BATCH, ATTN_LENGTH, KV_HEAD, KV_HEAD_DIM), mesh=mesh,
                                 rules=rules))
  q = (q[0], q[1], q[2], None)
  kv = (q[0], None, q[2], None)
  return q, kv


@contextlib.contextmanager
def attention_specs_for(config, mesh, sharded_mesh):
  """Make MaxText's current specs the op's specs (a no-op when the op runs unsharded)."""
  del config
  if sharded_mesh is None:
    yield
    return
  sharding = _sharding_module()
  q, kv = resolve_specs(mesh)
  with sharding.attention_specs(q, kv):
    yield
