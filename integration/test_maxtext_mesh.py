"""attention=kvax vs dot_product on simulated 4- and 8-device CPU meshes (fsdp, tensor, context).

The cases run in a subprocess per device count (the host device count is fixed when JAX
starts): one for the three 4-device cases, one for the 8-device case. The kvax op
must actually be sharded there: a mesh, the specs MaxText's logical axis rules give, and the
token order MaxText's pipeline applied (the reorder callable its setup_train_loop builds with
attention=kvax): the per-batch balanced order by default (kvax_context_parallel_order=auto), the
Llama 3 order when the key asks for it. gpt-oss (sinks, alternating local / global layers, MoE)
runs without context parallelism: batch over fsdp, heads (and sinks) over tensor, natural order.
Every case also checks the kvax op's trace counters: one prepare per traced step and one mask
per (causal, window) kind of layer.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from maxtext_results import report

pytestmark = pytest.mark.maxtext

HERE = os.path.dirname(os.path.abspath(__file__))

CASES = [  # model, devices, MaxText keys, expected query specs, token order, masks per step
    ("llama3-8b", 4, dict(ici_fsdp_parallelism=2, ici_context_parallelism=2,
                          per_device_batch_size=0.5), ("fsdp", "context", None), "balanced", 1),
    ("gemma2-2b", 8, dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=2,
                          ici_context_parallelism=2, per_device_batch_size=0.25,
                          sliding_window_size=48, kvax_context_parallel_order="llama3"),
     ("fsdp", "context", "tensor"), "llama3", 2),
    ("deepseek3-tiny", 4, dict(ici_tensor_parallelism=2, ici_context_parallelism=2,
                               per_device_batch_size=0.5), (None, "context", "tensor"),
     "balanced", 1),
    ("gpt-oss-20b", 4, dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=2,
                            per_device_batch_size=0.5), ("fsdp", None, "tensor"), "natural", 2),
]


@functools.cache
def _worker_results(devices: int) -> tuple[list[dict], str]:
  """Every case on `devices` devices, in one worker process (one MaxText import for all of
  them): (a result per case, in CASES order, or None when the worker failed; its output tail).
  A failed worker is remembered too: its other cases fail at once instead of running it again."""
  cases = [(model, mesh) for model, d, mesh, *_ in CASES if d == devices]
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                       f" --xla_force_host_platform_device_count={devices}").strip()}
  proc = subprocess.run([sys.executable, os.path.join(HERE, "maxtext_mesh_worker.py"),
                         json.dumps(cases)], capture_output=True, text=True,
                        timeout=900 * len(cases), env=env)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("KVAX_RESULT ")]
  tail = f"rc={proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
  if proc.returncode != 0 or len(lines) != len(cases):
    return None, tail
  return [json.loads(l[len("KVAX_RESULT "):]) for l in lines], tail


@pytest.mark.parametrize("model,devices,mesh,spec,order,masks", CASES,
                         ids=[f"{m}-{d}dev-{o}" for m, d, _, _, o, _ in CASES])
def test_mesh_parity(model, devices, mesh, spec, order, masks):
  results, tail = _worker_results(devices)
  assert results is not None, f"worker failed, {tail}"
  index = [c[2] for c in CASES if c[1] == devices].index(mesh)
  r = results[index]
  assert r["model"] == model and "error" not in r, r.get("error") or tail
  report(f"[maxtext mesh] {model} on {r['devices']} devices "
         f"{ {k: v for k, v in r['mesh'].items() if v > 1} }: loss dot_product="
         f"{r['loss_dot_product']:.6f} kvax={r['loss_kvax']:.6f} | logits {r['logit_rel_diff']:.2e}"
         f" | {r['num_grads']} grads, worst {r['worst_grad_rel_diff']:.2e} at {r['worst_grad']}"
         f" | kvax q specs {r['query_specs']} | token order {r['token_order']}")
  assert r["devices"] == devices
  assert r["kvax_sharded"], "kvax ran unsharded on a multi-device mesh"
  assert r["token_order"] == order, "kvax must be told the order MaxText's pipeline applied"
  if order == "natural":  # no context parallelism: MaxText's pipeline reorders nothing
    assert r["batch_order"] == ["natural"], r["batch_order"]
  else:
    assert order in r["batch_order"] and "natural" not in r["batch_order"], (
        f"the batch carries {r['batch_order']}, expected the {order} order")
  assert r["trace_counts"]["prepare"] == 1, r["trace_counts"]
  assert r["trace_counts"]["mask_builds"] == masks, r["trace_counts"]
  assert r["trace_counts"]["apply"] >= 1, r["trace_counts"]
  want = tuple(spec)
  got = eval(r["query_specs"])  # repr of a tuple of str / None, written by our worker
  assert (got[0], got[1], got[2]) == want, f"query specs {got}, expected {want}"
  assert r["grad_names_match"]
  assert abs(r["loss_kvax"] - r["loss_dot_product"]) <= 1e-5 * abs(r["loss_dot_product"])
  assert r["logit_rel_diff"] <= r["logit_tol"]
  assert not r["grads_over_tolerance"], r["grads_over_tolerance"]
