"""attn_backend=kvax against Levanter's attn_backend=vanilla on Levanter's own model configs.

Each family's registered config, shrunk (levanter_harness.FAMILIES), float32 on CPU, on packed
documents with padding (fresh random layout per run; the seed is in every failure message):
Levanter's training loss (cross entropy plus the MoE router losses, which average over padding
too), the logits on every token, padding included, and every gradient leaf must agree. Once on one device, and for two
families on 4-device meshes (data x model, heads sharded; data x context) built and mapped the
way Levanter's Trainer does it. The seam's trace counters show where the block masks were built:
at the decoder entry (once per decoder trace, one per causal / window combination), never
inside a layer, and no call was routed away from kvax.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import levanter_harness as harness

TOL = 1e-5  # float32 on CPU: observed differences are 1e-7 .. 2e-6
SEED = int(os.environ.get("KVAX_TEST_SEED", np.random.SeedSequence().entropy % 2**31))

# family -> (causal, window) masks its decoder entry must build
EXPECTED_MASKS = {"llama": 1, "qwen3": 1, "gemma2": 1, "olmo3": 2, "mixtral": 1, "qwen3_moe": 1}


@pytest.fixture(scope="module")
def batch():
  return harness.packed_batch(np.random.default_rng(SEED))


_REFERENCES: dict = {}


def reference(family: str, batch):
  """Vanilla attention's (loss, logits, grads) and the model, once per family per test run."""
  if family not in _REFERENCES:
    cfg = harness.config(family, "vanilla")
    model = harness.init_model(cfg, seed=SEED % 1000)
    _REFERENCES[family] = (model, harness.run(model, batch))
  return _REFERENCES[family]


def _check(family, diffs, counts, batch):
  where = f"{family} (KVAX_TEST_SEED={SEED}): {diffs}, trace counts {counts}"
  assert diffs["num_grad_leaves"] >= 10, where
  assert diffs["loss"] < TOL, where
  assert diffs["logits"] < TOL, where
  assert diffs["worst_grad"] < TOL, where
  assert counts["routed"] == 0 and counts["per_call_masks"] == 0, where
  assert counts["entries"] >= 1, where
  assert counts["entry_masks"] == counts["entries"] * EXPECTED_MASKS[family], where
  assert counts["layer_calls"] >= counts["entries"], where
  assert (batch.segment_ids == -1).any(axis=1).all(), "every row must end in padding"


@pytest.mark.parametrize("family", list(harness.FAMILIES))
def test_one_device(family, batch, kvax_levanter, seam_counts):
  model, ref = reference(family, batch)
  kvax_model = harness.init_like(model, harness.config(family, "kvax"))
  got = harness.run(kvax_model, batch)
  _check(family, harness.compare(ref, got, batch), dict(seam_counts), batch)
  assert seam_counts["sharded_calls"] == 0  # one device: no shard_map


BATCH_AXES = ("replica_dcn", "replica", "data")  # Levanter's default mapping of "batch"


@pytest.mark.parametrize("family,model_axis,context,head_axis,spec", [
    # data 2 x model 2: llama's 2 kv heads mapped to model, one per shard
    ("llama", 2, 1, "kv_head", (BATCH_AXES, None, "model", None)),
    # data 2 x model 2: gemma2's one kv head, its 4 query heads mapped to model: both shards
    # read the same kv head
    ("gemma2", 2, 1, "q_heads_per_group", (BATCH_AXES, None, "model", None)),
    # data 2 x context 2: position mapped to Levanter's context axis; kvax all-gathers key /
    # value over it (model has size 1 here)
    ("llama", 1, 2, "kv_head", (BATCH_AXES, "context", "model", None)),
])
def test_four_device_mesh(family, model_axis, context, head_axis, spec, batch, kvax_levanter,
                          seam_counts):
  """A 4-device mesh (data 2 x model 2, or data 2 x context 2) built and mapped as Levanter's
  Trainer does it; kvax runs inside shard_map with the specs read off the axis mapping."""
  model, ref = reference(family, batch)
  kvax_model = harness.init_like(model, harness.config(family, "kvax"))
  got = harness.run(kvax_model, batch, data=2, model_axis=model_axis, head_axis=head_axis,
                    context=context)
  _check(family, harness.compare(ref, got, batch), dict(seam_counts), batch)
  from kvax_plugin.integrations.levanter import seam
  assert seam_counts["sharded_calls"] == seam_counts["layer_calls"] >= 1
  assert seam.SHARDED_SPECS == {spec}
