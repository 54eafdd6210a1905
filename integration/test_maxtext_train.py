"""Real training steps through MaxText's own entry point, attention=kvax vs dot_product.

MaxText's synthetic input pipeline with packing=true gives packed rows (several segments per
row); both runs start from the same seed, so their per-step losses must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from maxtext_results import report

pytestmark = pytest.mark.maxtext

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 4


def _argv(tmp_path, attention: str, model: str, extra: dict) -> list[str]:
  import maxtext_harness as H
  args = dict(model_name=model, override_model_config="true", hardware="cpu",
              skip_jax_distributed_system="true", **{k: v for k, v in H.SHRINK[model].items()},
              vocab_size=512, max_target_length=256, per_device_batch_size=2,
              attention=attention, dtype="float32", weight_dtype="float32",
              matmul_precision="highest", dataset_type="synthetic", packing="true",
              max_segments_per_seq=6, steps=STEPS, enable_checkpointing="false",
              base_output_directory=str(tmp_path), run_name=f"kvax_train_{attention}",
              log_config="false", learning_rate=1e-3, kvax_backend=H.COMMON["kvax_backend"],
              kvax_fwd_query_block_size=32, kvax_fwd_kv_block_size=32,
              kvax_bwd_query_block_size=32, kvax_bwd_kv_block_size=32,
              jax_cache_dir=H.COMMON["jax_cache_dir"])
  args.update(extra)
  argv = [os.path.join(H.maxtext_dir(), "configs", "base.yml")]
  return argv + [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in args.items()]


MODELS = [("llama3-8b", {}), ("gemma2-2b", {"sliding_window_size": 48})]
ATTENTIONS = ("dot_product", "kvax")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
  """(model, attention) -> KVAX_RESULT of its run, or the worker's failure text. Every run of
  this file, one after the other in one worker process: one MaxText import (~14 s of CPU) for
  all of them instead of one per model."""
  plan = [(m, e, a, tmp_path_factory.mktemp(f"{m}_{a}")) for m, e in MODELS for a in ATTENTIONS]
  runs = [(str(d / "metrics.jsonl"), _argv(d, a, m, e)) for m, e, a, d in plan]
  proc = subprocess.run([sys.executable, os.path.join(HERE, "maxtext_train_worker.py"),
                         json.dumps(runs)], capture_output=True, text=True,
                        timeout=900 * len(runs), env={**os.environ, "JAX_PLATFORMS": "cpu"})
  lines = [l for l in proc.stdout.splitlines() if l.startswith("KVAX_RESULT ")]
  failure = (f"MaxText training failed after {len(lines)} of {len(runs)} runs, "
             f"rc={proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
  out = {(m, a): failure for m, _, a, _ in plan}
  if proc.returncode == 0:
    out.update({(m, a): json.loads(l[len("KVAX_RESULT "):]) for (m, _, a, _), l in
                zip(plan, lines)})
  return out


@pytest.mark.parametrize("model,extra", MODELS, ids=["llama3-8b", "gemma2-2b-window48"])
def test_training_steps_match(trained, model, extra):
  runs = {a: trained[(model, a)] for a in ATTENTIONS}
  for a, r in runs.items():
    assert isinstance(r, dict), f"{model} {a}: {r}"
  ref, got = runs["dot_product"], runs["kvax"]
  side = "  ".join(f"step {i}: {a:.6f} | {b:.6f}" for i, (a, b) in
                   enumerate(zip(ref["losses"], got["losses"])))
  report(f"[maxtext train] {model} {extra or ''} losses dot_product | kvax: {side}")
  assert ref["trace_counts"].get("apply", 0) == 0
  assert got["trace_counts"].get("prepare", 0) >= 1 and got["trace_counts"].get("apply", 0) >= 1
  assert len(ref["losses"]) == len(got["losses"]) == STEPS
  assert ref["losses"][-1] < ref["losses"][0], "training should lower the loss"
  for a, b in zip(ref["losses"], got["losses"]):
    assert abs(a - b) <= 2e-5 * abs(a), f"losses differ: {ref['losses']} vs {got['losses']}"
