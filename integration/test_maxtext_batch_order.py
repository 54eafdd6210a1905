"""kvax_context_parallel_order: which token order MaxText's input pipeline applies with
attention=kvax (kvax_plugin.integrations.maxtext.batch_order), and the hook that applies it.

Configs are plain namespaces here (the keys batch_order reads); the parity of the whole model
in the balanced order is integration/test_maxtext_mesh.py's.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.maxtext

CP = 2


def _config(**kw):
  base = dict(attention="kvax", max_target_length=256, context_parallel_load_balance=True,
              shard_mode="auto", kvax_fwd_query_block_size=32, kvax_fwd_kv_block_size=32,
              kvax_bwd_query_block_size=16, kvax_bwd_kv_block_size=32)
  base.update(kw)
  return types.SimpleNamespace(**base)


def _batch(seed=0, batch=2, seq_len=256):
  """A MaxText batch: packed documents (segment ids 1..n along the row), padding (0) last."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((batch, seq_len), np.int32)
  pos = np.zeros((batch, seq_len), np.int32)
  for b in range(batch):
    lengths = [150, 40, 30] if b == 0 else [20, 90, 60, 50]
    start = 0
    for d, ln in enumerate(lengths):
      seg[b, start:start + ln] = d + 1
      pos[b, start:start + ln] = np.arange(ln)
      start += ln
  tokens = rng.integers(1, 100, size=(batch, seq_len)).astype(np.int32)
  return dict(inputs=jnp.asarray(tokens), targets=jnp.asarray(tokens + 1),
              inputs_position=jnp.asarray(pos), targets_position=jnp.asarray(pos),
              inputs_segmentation=jnp.asarray(seg), targets_segmentation=jnp.asarray(seg),
              other=jnp.asarray(np.arange(batch)))


@pytest.mark.parametrize("key,reorder_cp,context,want", [
    ("auto", 2, 2, "balanced"), ("auto", 1, 2, "natural"), ("auto", 1, 1, "natural"),
    ("balanced", 2, 2, "balanced"), ("llama3", 2, 2, "llama3"), ("natural", 2, 2, "natural"),
    ("balanced", 1, 1, "natural")])
def test_order_resolution(key, reorder_cp, context, want):
  from kvax_plugin.integrations.maxtext import batch_order
  config = _config(kvax_context_parallel_order=key)
  assert batch_order.order_for(config, reorder_cp, context) == want


def test_order_errors_name_the_keys():
  from kvax_plugin.integrations.maxtext import batch_order
  with pytest.raises(ValueError, match=r"kvax_context_parallel_order='striped': must be one of"):
    batch_order.order_for(_config(kvax_context_parallel_order="striped"), 2, 2)
  with pytest.raises(ValueError, match=r"'balanced' needs context_parallel_load_balance=true"):
    batch_order.order_for(_config(kvax_context_parallel_order="balanced",
                                  context_parallel_load_balance=False), 1, 2)
  with pytest.raises(ValueError, match=r"max_target_length \(224\) must be a multiple of 64"):
    batch_order.balanced_reorder(_config(max_target_length=224), CP)


def test_reorder_callable_per_order():
  from kvax_plugin.attention import token_order as orders
  from kvax_plugin.integrations.maxtext import batch_order
  upstream = lambda batch: ("upstream", batch)
  batch = _batch()
  assert batch_order.reorder_callable(_config(attention="dot_product"), CP, upstream) is upstream
  assert batch_order.reorder_callable(_config(kvax_context_parallel_order="llama3"), CP,
                                      upstream) is upstream
  assert batch_order.reorder_callable(_config(kvax_context_parallel_order="natural"), CP,
                                      upstream)(batch) is batch
  out = batch_order.reorder_callable(_config(), CP, upstream)(batch)
  # The balanced order of each row (unit 32 = the larger query block), on every reordered key.
  seg = np.where(np.asarray(batch["inputs_segmentation"]) == 0, -1,
                 np.asarray(batch["inputs_segmentation"]))
  tok = orders.balanced_order(np.asarray(batch["inputs_position"]), seg, CP, block=32)
  for k in batch_order.REORDER_KEYS:
    if k in batch:
      np.testing.assert_array_equal(np.asarray(out[k]),
                                    np.asarray(orders.apply_token_order(batch[k], tok)), err_msg=k)
  np.testing.assert_array_equal(np.asarray(out["other"]), np.asarray(batch["other"]))
  assert not np.array_equal(np.asarray(out["inputs"]), np.asarray(batch["inputs"]))
  # MaxText-style restoration from the reordered batch alone.
  back = batch_order.to_natural_order({k: out[k] for k in ("inputs", "targets")}, out)
  np.testing.assert_array_equal(np.asarray(back["inputs"]), np.asarray(batch["inputs"]))
  np.testing.assert_array_equal(np.asarray(back["targets"]), np.asarray(batch["targets"]))


def test_setup_train_loop_hook_swaps_the_reorder_callable():
  from maxtext.utils import maxtext_utils
  from kvax_plugin.integrations.maxtext import batch_order
  original = maxtext_utils.get_reorder_callable
  seen = {}

  def setup(config, recorder, devices=None):  # stands in for train_utils.setup_train_loop
    seen["fn"] = maxtext_utils.get_reorder_callable(CP, "auto", None, "cpu")
    return "state"

  wrapped = batch_order.setup_train_loop_entry(setup)
  assert batch_order.setup_train_loop_entry(wrapped) is wrapped  # never wrapped twice
  assert wrapped(_config(), None) == "state"
  out = seen["fn"](_batch())
  assert not np.array_equal(np.asarray(out["inputs"]), np.asarray(_batch()["inputs"]))
  assert maxtext_utils.get_reorder_callable is original  # restored after the call
  wrapped(_config(attention="dot_product"), None)  # other kernels: MaxText's own callable
  assert seen["fn"].func is maxtext_utils.shard_reorder_causal_load_balanced

