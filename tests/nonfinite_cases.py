"""NaN / inf inputs checked against the reference: shared by the JAX, reference and Triton tests.

The contract (README, "NaN and inf"; kvax_plugin/attention/reference.py):
  * exact cases (NaN / inf in q, k, scale, soft cap, sinks: the logit side): every backend's
    output is non-finite exactly where the reference's is, and equal to it elsewhere;
  * non-finite v: non-finite wherever the reference is (rows attending the token), equal to it
    where the backend is finite (block kernels may spread 0 * NaN to rows sharing a visited
    block: more NaN, never less);
  * rows with nothing to attend (padding) are exactly 0 whatever the inputs hold;
  * gradients: a row whose output is non-finite has a non-finite dq, and every kv token it
    attends a non-finite dk; a padding row's dq is exactly 0; finite entries equal the
    reference's where it is finite too.

`run_cases(backend_fn)` returns a list of failure messages (empty: all good). `backend_fn` has
the signature of the backend functions (kvax_plugin.attention.kernels.backend_function) and gets
options already normalised, as flash_attention passes them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvax_plugin.attention import validation
from kvax_plugin.attention.block_mask import create_attention_mask, dense_mask
from kvax_plugin.attention.params import FlashAttentionParamsConfig as P
from kvax_plugin.attention.reference import reference_attention

S, H, K = 48, 4, 2  # the default heads (run_cases(heads=...) takes fewer)
PARAMS = P(16, 16, 4, 1)
NAN, INF = math.nan, math.inf

# Two documents (tokens 0-19, 20-39) and 8 padding tokens: the tables then hold skipped, partial
# and full blocks, and padding rows that visit blocks holding other documents' tokens.
_SEG = np.array([0] * 20 + [1] * 20 + [-1] * 8, np.int32)
_POS = np.array(list(range(20)) * 2 + list(range(8)), np.int32)

# Cases with NaN / inf in one entry of q, k or v: (array, [S, heads, D] index, value, exact?).
# They share one call: case i is batch row i. With fewer heads (run_cases(heads=...)) the head
# index is taken modulo the heads.
POISON_CASES = {
    "q_nan_row": ("q", (25, 1, 3), NAN, True),
    "q_nan_padding_row": ("q", (44, 2, 0), NAN, True),
    "k_nan": ("k", (5, 0, 7), NAN, True),
    "k_inf": ("k", (30, 1, 2), INF, True),
    "v_nan": ("v", (5, 0, 2), NAN, False),
    "v_inf_padding": ("v", (45, 1, 0), INF, False),
}
# Cases with non-finite options (one call each), plus one poisoned entry where given.
OPTION_CASES = {
    "scale_nan": dict(scale=NAN),
    "scale_inf": dict(scale=INF),
    "soft_cap_with_q_inf": dict(cap=5.0, poison=("q", (12, 0, 1), INF)),
    "sink_nan": dict(sinks=(2, NAN)),
}


def _inputs(batch: int, seed: int, dtype, d: int, h: int = H, kh: int = K):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (batch, S, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (batch, S, kh, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (batch, S, kh, d), jnp.float32).astype(dtype)
  sinks = jax.random.normal(ks[3], (h,), jnp.float32)
  cot = jax.random.normal(ks[4], (batch, S, h, d), jnp.float32).astype(dtype)
  return {"q": q, "k": k, "v": v}, sinks, cot


def _poison(arrays: dict, which: str, row: int, idx: tuple, value) -> None:
  """arrays[which][row, t, head, d] = value, the head modulo the array's heads."""
  t, head, d = idx
  arrays[which] = arrays[which].at[row, t, head % arrays[which].shape[2], d].set(value)


def _results(fn, arrays, cot):
  """(out, dq, dk, dv) as numpy float64, the gradients of sum(out * cot)."""
  out, vjp = jax.vjp(fn, arrays["q"], arrays["k"], arrays["v"])
  dq, dk, dv = vjp(cot.astype(out.dtype))
  return tuple(np.asarray(x, np.float64) for x in (out, dq, dk, dv))


def _compare(name, what, mine, ref, *, mode: str, tol: float, failures: list):
  """mode "exact": same non-finite entries; "superset": non-finite at least where the reference
  is; "finite": only entries finite in both are compared."""
  bad_mine, bad_ref = ~np.isfinite(mine), ~np.isfinite(ref)
  if mode == "exact" and not np.array_equal(bad_mine, bad_ref):
    failures.append(f"{name}/{what}: non-finite at {np.argwhere(bad_mine).tolist()[:6]}..., "
                    f"reference at {np.argwhere(bad_ref).tolist()[:6]}...")
    return
  lost = bad_ref & ~bad_mine
  if mode != "finite" and lost.any():
    failures.append(f"{name}/{what}: finite where the reference is not (NaN lost) at "
                    f"{np.argwhere(lost).tolist()[:6]}")
  both = ~bad_mine & ~bad_ref
  err = np.max(np.abs(mine[both] - ref[both]), initial=0.0) / (np.max(np.abs(ref[both]),
                                                                      initial=0.0) + 1e-30)
  if err > tol:
    failures.append(f"{name}/{what}: finite entries differ from the reference, rel err {err:.2e}")


def _check_row(name, exact, got, want, keep, grad_propagation, tol, failures):
  """All checks on one batch row: got / want are (out, dq, dk, dv) of shapes [S, ...]."""
  out, dq, dk, _ = got
  group = out.shape[1] // dk.shape[1]  # query heads per kv head
  padding_rows = _SEG == -1
  _compare(name, "out", out, want[0], mode="exact" if exact else "superset", tol=tol,
           failures=failures)
  if np.any(out[padding_rows] != 0):
    failures.append(f"{name}/out: a padding row is not exactly 0")
  if np.any(dq[padding_rows] != 0):
    failures.append(f"{name}/dq: a padding row's gradient is not exactly 0")
  if grad_propagation:
    # A non-finite row must make its dq and the dk of every token it attends non-finite.
    for t, h in np.argwhere(~np.isfinite(out).all(axis=-1)):
      if np.isfinite(dq[t, h]).any():
        failures.append(f"{name}/dq: row {t} head {h} has a non-finite output but finite dq")
        break
      if np.isfinite(dk[keep[t], h // group]).all(axis=-1).any():
        failures.append(f"{name}/dk: a token attended by non-finite row {t} (head {h}) has a "
                        "finite dk")
        break
  for what, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
    # The reference's dense gradient products spread NaN further than block kernels do.
    _compare(name, what, a, b, mode="finite", tol=tol, failures=failures)


def run_cases(backend_fn, *, option_cases=None, grad_propagation: bool = True,
              tol: float = 2e-5, seed: int = 0, dtype=jnp.float32, head_dim: int = 16,
              params: P = PARAMS, heads: tuple[int, int] = (H, K)) -> list[str]:
  """Runs every poison case (one call) and the named option cases (default all).

  grad_propagation: check that non-finite rows reach dq / dk (the block backends do it through
  delta = rowsum(dO * O); the reference's autodiff does not for non-finite v).
  dtype / head_dim / params: inputs and mask blocks, for backends with narrower support (the
  reference always computes on the same inputs upcast to float32).
  heads: (query heads, kv heads), fewer for backends whose every head costs (an interpreter);
  GQA either way.
  """
  h, kh = heads
  d = head_dim
  keep = np.asarray(dense_mask(_POS[None], _SEG[None], _POS[None], _SEG[None]))[0]
  failures: list[str] = []

  def run(batch, arrays, cot, scale, cap, sinks):
    pos = jnp.asarray(np.tile(_POS, (batch, 1)))
    seg = jnp.asarray(np.tile(_SEG, (batch, 1)))
    ints = (pos, seg, pos, seg)
    mask = create_attention_mask(*ints, fwd_params=params, bwd_params=params,
                                 calc_bwd_mask=True)
    n_scale, n_cap = validation.check_options(scale, cap, sinks, h)
    mine = lambda q, k, v: backend_fn(q, k, v, *ints, mask, scale=n_scale, logits_soft_cap=n_cap,
                                      sinks=sinks)
    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v: reference_attention(f32(q), f32(k), f32(v), *ints, scale=scale,
                                              logits_soft_cap=cap, sinks=sinks)
    # The reference in exact float32 products: on a GPU, XLA's default precision may use TF32
    # (~5e-4 relative error), which would fail a float32 kernel that is exact. Jitted: one
    # compile instead of one per operation.
    with jax.default_matmul_precision("highest"):
      want = _results(jax.jit(ref), arrays, cot)
    return _results(jax.jit(mine), arrays, cot), want

  names = list(POISON_CASES)
  arrays, _, cot = _inputs(len(names), seed, dtype, d, h, kh)
  for i, name in enumerate(names):
    which, idx, value, _ = POISON_CASES[name]
    _poison(arrays, which, i, idx, value)
  got, want = run(len(names), arrays, cot, d ** -0.5, None, None)
  for i, name in enumerate(names):
    _check_row(name, POISON_CASES[name][3], [x[i] for x in got], [x[i] for x in want], keep,
               grad_propagation, tol, failures)

  for name in (OPTION_CASES if option_cases is None else option_cases):
    opts = OPTION_CASES[name]
    arrays, sinks, cot = _inputs(1, seed, dtype, d, h, kh)
    if "poison" in opts:
      which, idx, value = opts["poison"]
      _poison(arrays, which, 0, idx, value)
    if "sinks" in opts:
      sinks = sinks.at[opts["sinks"][0]].set(opts["sinks"][1])
    else:
      sinks = None
    got, want = run(1, arrays, cot, opts.get("scale", d ** -0.5), opts.get("cap"), sinks)
    _check_row(name, True, [x[0] for x in got], [x[0] for x in want], keep, grad_propagation,
               tol, failures)
  return failures
