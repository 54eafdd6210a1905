"""The Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

Runs the very kernels backend="triton" launches on a GPU, via the interpreter path of
kvax_plugin.attention.kernels.triton.compat (jax.pure_callback on numpy buffers, outputs poisoned
with NaN first), inside jit and the custom VJP, and compares out / dq / dk / dv / dsinks with the float32 reference.
NaN / inf inputs are checked against the contract of nonfinite_cases.py.
Skipped when Triton is not installed (it is optional: the [gpu] extra). Runs in a subprocess
because the interpreter must be switched on before Triton is first imported.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (optional [gpu] extra)")

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from kvax_plugin.attention.api import positions_from_segment_ids
    from kvax_plugin.attention.block_mask import create_attention_mask
    from kvax_plugin.attention.params import FlashAttentionParamsConfig as P
    from kvax_plugin.attention.reference import reference_attention
    from kvax_plugin.attention.kernels.triton import backend as triton_backend

    # Two query heads over one kv head (GQA) by default: the interpreter runs every program of
    # the grid in Python, so each head is more time, and no case here is about head counts.
    def case(name, sq=100, skv=None, h=2, kh=1, dk=32, dv=None, dtype=jnp.float32, causal=True,
             window=None, cap=None, sinks=False, params=None, inplace=False, tol=1e-5,
             options=None):
        skv = skv or sq; dv = dv or dk
        ks = jax.random.split(jax.random.PRNGKey(sum(map(ord, name))), 6)
        q = jax.random.normal(ks[0], (1, sq, h, dk)).astype(dtype)
        k = jax.random.normal(ks[1], (1, skv, kh, dk)).astype(dtype)
        v = jax.random.normal(ks[2], (1, skv, kh, dv)).astype(dtype)
        if sq == skv:
            qseg = jnp.sort(jax.random.randint(ks[3], (1, sq), 0, 3), axis=1).astype(jnp.int32)
            qseg = qseg.at[:, -7:].set(-1)
            kvseg, qpos = qseg, positions_from_segment_ids(qseg)
            kvpos = qpos
        else:
            qseg, kvseg = jnp.zeros((1, sq), jnp.int32), jnp.zeros((1, skv), jnp.int32)
            kvpos = jnp.arange(skv, dtype=jnp.int32)[None]
            qpos = kvpos[:, skv - sq:]
        s = jax.random.normal(ks[4], (h,)) if sinks else None
        kw = {} if params is None else dict(fwd_params=params[0], bwd_params=params[1])
        mask = create_attention_mask(qpos, qseg, kvpos, kvseg, calc_bwd_mask=True, causal=causal,
                                     sliding_window=window, **kw)
        cot = jax.random.normal(ks[5], (1, sq, h, dv))
        ints = (qpos, qseg, kvpos, kvseg)
        ours = lambda q, k, v, s: triton_backend.flash_attention_triton(
            q, k, v, *ints, mask, scale=dk ** -0.5, logits_soft_cap=cap, sinks=s,
            memory_optimized_gqa_backward=inplace, kernel_options=options)
        ref = lambda q, k, v, s: reference_attention(
            q, k, v, *ints, causal=causal, sliding_window=window, scale=dk ** -0.5,
            logits_soft_cap=cap, sinks=s)
        def run(fn, q, k, v, s):
            # One forward (each kernel launch is interpreted): the output and the gradients of
            # sum(out * cot), as jax.grad of that sum gives them.
            if s is None:
                out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None), q, k, v)
            else:
                out, vjp = jax.vjp(fn, q, k, v, s)
            return (out,) + vjp(cot.astype(out.dtype))
        f32 = lambda x: None if x is None else x.astype(jnp.float32)
        mine = jax.jit(lambda *a: run(ours, *a))(q, k, v, s)
        theirs = jax.jit(lambda *a: run(ref, *a))(f32(q), f32(k), f32(v), f32(s))
        for n, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], mine, theirs):
            a, b = f32(a), f32(b)
            assert bool(jnp.all(jnp.isfinite(a))), (name, n, "not finite / unwritten")
            err = float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))
            assert err < tol, (name, n, err)
        print(name, "ok")

    small = (P(32, 32, 4, 1), P(16, 32, 4, 1))
    case("default_params_subdivided_tiles")
    case("softcap_sinks_window", cap=5.0, sinks=True, window=9, params=small)
    case("not_causal_mla_inplace", causal=False, dk=48, dv=32, inplace=True, params=small)
    case("decode_fp16", sq=1, skv=77, dtype=jnp.float16, params=small, tol=2e-3)
    # The dq kernel after the dk/dv kernel (KernelOptions.dq_after_dkv, for context
    # parallelism) computes the same gradients.
    from kvax_plugin.attention.options import KernelOptions
    case("dq_after_dkv_option", sinks=True, params=small,
         options=KernelOptions(dq_after_dkv=True))

    # The kernels as parts (the context-parallel overlap's path): kv in halves, merged by
    # split_kv_attention under jit and grad (tests/kernel_parts_case.py).
    import kernel_parts_case
    kernel_parts_case.check(triton_backend.flash_attention_triton, s_len=96, h=2, kh=1, d=32,
                            dtype=jnp.float32, tol=1e-5)
    print("kernel_parts ok")

    # The opt-in autotune runs candidates end to end (timings are meaningless here).
    seg = jnp.zeros((1, 40), jnp.int32); pos = jnp.arange(40, dtype=jnp.int32)[None]
    m = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True, fwd_params=small[0],
                              bwd_params=small[1])
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 40, 2, 16))
    best, times = triton_backend.autotune_tiles(
        x, x, x, pos, seg, pos, seg, m, rounds=1,
        candidates=["", "fwd=16,16,4,1;dq=16,16,4,1;dkv=16,16,4,1"])
    assert best in times and len(times) == 2 and all(t < float("inf") for t in times.values())
    print("autotune ok")

    # NaN / inf follow the reference (tests/nonfinite_cases.py, on the PYTHONPATH).
    import nonfinite_cases
    failures = nonfinite_cases.run_cases(triton_backend.flash_attention_triton,
                                         option_cases=["scale_nan", "sink_nan"], heads=(2, 1))
    assert not failures, " | ".join(failures)
    print("nonfinite ok")
""")


def test_kernels_in_triton_interpreter():
  root = Path(__file__).resolve().parents[1]
  env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"),
                                         os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  assert proc.stdout.count(" ok") == 8, proc.stdout
