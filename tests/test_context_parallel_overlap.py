"""The overlapped context-parallel path (create_attention_mask's overlap_kv_gather): each shard's
attention as a local part (its own key / value) and a remote part (the other shards'), merged by
log-sum-exp, on simulated CPU devices (tests/conftest.py sets 8) with the jax backend.

Every case must equal the float32 dense reference on one device (output and the gradients of
query, key, value and sinks), on rows built to be awkward for the split: packed documents with
padding and a non-contiguous document, one document, a short document inside one shard, and a
row whose second half of key / value is padding, so that a shard's local part attends nothing
(lse +inf) while its remote part does, with sinks (which must then still count).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kvax_plugin.attention import context_parallel, split_kv_attention, token_order
from kvax_plugin.attention.api import create_attention_mask, flash_attention
from kvax_plugin.attention.params import FlashAttentionParamsConfig
from kvax_plugin.attention.reference import reference_attention

NUM_DEVICES = 8
try:
  CPUS = jax.devices("cpu")
except RuntimeError:
  CPUS = []
pytestmark = pytest.mark.skipif(len(CPUS) < NUM_DEVICES,
                                reason=f"needs {NUM_DEVICES} CPU devices (tests/conftest.py)")

FWD = FlashAttentionParamsConfig(query_block_size=16, kv_block_size=16)
BWD = FlashAttentionParamsConfig(query_block_size=16, kv_block_size=16)
B, S, H, K, D = 4, 128, 4, 2, 16  # GQA: two query heads per kv head
QUERY_SPECS = ("data", "context", "tensor", None)
KV_SPECS = ("data", None, "tensor", None)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _layout():
  """(q_pos, q_seg, kv_pos, kv_seg) int32 [B, S] in natural order, one awkward row each."""
  seg = np.full((B, S), -1, np.int32)
  pos = np.zeros((B, S), np.int32)
  # Row 0: packed documents, one in two pieces around another, padding in the middle and end.
  seg[0, 0:30], seg[0, 30:52], seg[0, 70:100], seg[0, 100:117] = 7, 8, 7, 9
  pos[0, 0:30], pos[0, 30:52], pos[0, 70:100], pos[0, 100:117] = (
      np.arange(30), np.arange(22), 30 + np.arange(30), np.arange(17))
  # Row 1: one document filling the row.
  seg[1], pos[1] = 0, np.arange(S)
  # Row 2: a long document, a short one (inside one shard at cp 2 and 4: tokens 36-43), more.
  seg[2, :36], seg[2, 36:44], seg[2, 44:120] = 1, 2, 3
  pos[2, :36], pos[2, 36:44], pos[2, 44:120] = np.arange(36), np.arange(8), np.arange(76)
  # Row 3: one document; its key / value side is padding from token 64 on (below).
  seg[3], pos[3] = 5, np.arange(S)
  kv_seg, kv_pos = seg.copy(), pos.copy()
  kv_seg[3, 64:] = -1
  return pos, seg, kv_pos, kv_seg


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(16)
  q_pos, q_seg, kv_pos, kv_seg = _layout()
  return dict(q=rng.standard_normal((B, S, H, D)).astype(np.float32),
              k=rng.standard_normal((B, S, K, D)).astype(np.float32),
              v=rng.standard_normal((B, S, K, D)).astype(np.float32),
              w=rng.standard_normal((B, S, H, D)).astype(np.float32),
              sinks=rng.standard_normal((H,)).astype(np.float32),
              q_pos=q_pos, q_seg=q_seg, kv_pos=kv_pos, kv_seg=kv_seg)


def _grads(attend, d):
  """(out, dq, dk, dv, dsinks) of sum(attend(...) * w)."""
  def loss(q, k, v, s):
    out = attend(q, k, v, s)
    return jnp.sum(out * d["w"]), out
  (_, out), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
      d["q"], d["k"], d["v"], d["sinks"])
  return (out, *g)


_REFERENCE_CACHE: dict = {}


def _reference(d, causal, window, soft_cap):
  key = (causal, window, soft_cap)
  if key not in _REFERENCE_CACHE:
    _REFERENCE_CACHE[key] = _reference_uncached(d, causal, window, soft_cap)
  return _REFERENCE_CACHE[key]


def _reference_uncached(d, causal, window, soft_cap):
  # The arrays enter as arguments: closed over, XLA would constant-fold the whole reference
  # at compile time (seconds of its slow evaluator).
  def run(d):
    ints = tuple(d[n] for n in ("q_pos", "q_seg", "kv_pos", "kv_seg"))
    fn = lambda q, k, v, s: reference_attention(q, k, v, *ints, causal=causal,
                                                sliding_window=window, scale=D ** -0.5,
                                                logits_soft_cap=soft_cap, sinks=s)
    return _grads(fn, d)
  with jax.default_device(CPUS[0]):
    return [np.asarray(x) for x in jax.jit(run)(d)]


def _sharded(d, mesh, order, *, overlap, causal, window, soft_cap, backend="jax"):
  """The sharded op on `mesh` with inputs in `order`; results back in natural order."""
  cp = mesh.shape["context"]
  names = ("q", "k", "v", "w", "q_pos", "q_seg", "kv_pos", "kv_seg")
  arrays = {n: d[n] for n in names}
  tok = None
  if order != "natural":
    tok = token_order.token_order(d["q_pos"], d["q_seg"], cp, order=order,
                                  block=FWD.query_block_size, causal=causal,
                                  sliding_window=window)
    arrays = dict(zip(names, (np.asarray(x) for x in token_order.apply_token_order(
        tuple(arrays[n] for n in names), tok))))
  kw = dict(mesh=mesh, query_specs=QUERY_SPECS, kv_specs=KV_SPECS, token_order=order)

  def step(q, k, v, w, sinks, q_pos, q_seg, kv_pos, kv_seg):
    mask = context_parallel.create_attention_mask_sharded(
        q_pos, q_seg, kv_pos, kv_seg, fwd_params=FWD, bwd_params=BWD, calc_bwd_mask=True,
        causal=causal, sliding_window=window, mesh=mesh, query_specs=QUERY_SPECS,
        kv_specs=KV_SPECS, token_order=order, overlap_kv_gather=overlap)
    assert mask.layout.overlap_kv_gather == overlap
    attend = lambda q, k, v, s: flash_attention(q, k, v, q_pos, q_seg, kv_pos, kv_seg, mask,
                                                scale=D ** -0.5, logits_soft_cap=soft_cap,
                                                sinks=s, backend=backend, **kw)
    return _grads(attend, dict(q=q, k=k, v=v, w=w, sinks=sinks))

  args = [arrays[n] for n in ("q", "k", "v", "w")] + [d["sinks"]] + [
      arrays[n] for n in ("q_pos", "q_seg", "kv_pos", "kv_seg")]
  out = jax.jit(step).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)
  out = [np.asarray(x) for x in out]
  if tok is not None:
    out[:4] = [np.asarray(x) for x in token_order.undo_token_order(tuple(out[:4]), tok)]
  return out


def _mesh(cp):
  shape = {2: (2, 2, 2), 4: (1, 2, 4)}[cp]  # (data, tensor, context)
  return Mesh(np.array(CPUS[:NUM_DEVICES]).reshape(shape), ("data", "tensor", "context"))


def _assert_close(got, want, label, tol=3e-5):
  for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"{label}: {name}")


# (cp, order, causal, sliding window, soft cap): every order at cp 2 or 4 (balanced at both;
# natural at cp 2 in test_overlap_equals_existing_path), causal with sinks; a window with a soft
# cap; a bidirectional window. Each case is one compile (~5 s on a shared CPU): kept to six.
CASES = [(2, "llama3", True, None, None), (2, "balanced", True, None, None),
         (4, "natural", True, None, None), (4, "balanced", True, None, None),
         (2, "balanced", True, 40, 20.0), (4, "natural", False, 24, None)]


@pytest.mark.parametrize("cp,order,causal,window,soft_cap", CASES,
                         ids=[f"cp{c[0]}-{c[1]}-{'causal' if c[2] else 'bidir'}"
                              f"{f'-w{c[3]}' if c[3] else ''}{'-cap' if c[4] else ''}"
                              for c in CASES])
def test_overlap_equals_reference(data, cp, order, causal, window, soft_cap):
  want = _reference(data, causal, window, soft_cap)
  assert np.abs(want[4]).max() > 1e-3  # the sinks' gradient is not trivially 0
  got = _sharded(data, _mesh(cp), order, overlap=True, causal=causal, window=window,
                 soft_cap=soft_cap)
  _assert_close(got, want, f"cp={cp} {order}")


def test_overlap_equals_existing_path(data):
  """Same inputs, same mesh: the overlapped path against the all-gather path (not only both
  against the reference)."""
  mesh = _mesh(2)
  kw = dict(causal=True, window=None, soft_cap=None)
  got = _sharded(data, mesh, "natural", overlap=True, **kw)
  want = _sharded(data, mesh, "natural", overlap=False, **kw)
  _assert_close(got, want, "overlap vs all-gather", tol=1e-5)


def test_local_part_empty_rows_keep_the_sink():
  """A row whose local part attends nothing (lse +inf) and whose remote part does: the merge
  takes the remote part whole and still adds the sink; a row empty in both stays 0 / +inf."""
  rng = np.random.default_rng(0)
  o_a, o_b = (jnp.asarray(rng.standard_normal((1, 3, 1, 4)), jnp.float32) for _ in range(2))
  lse_a = jnp.asarray([[[jnp.inf, 0.5, jnp.inf]]], jnp.float32)
  lse_b = jnp.asarray([[[1.25, jnp.inf, jnp.inf]]], jnp.float32)
  o_a = o_a.at[:, 0].set(0.0).at[:, 2].set(0.0)  # kernels give 0 for empty rows
  o_b = o_b.at[:, 1].set(0.0).at[:, 2].set(0.0)
  sink = jnp.asarray([0.75], jnp.float32)
  out, lse = split_kv_attention.merge(o_a, lse_a, o_b, lse_b, sink)
  total = np.logaddexp(1.25, 0.75)
  np.testing.assert_allclose(lse[0, 0], [total, np.logaddexp(0.5, 0.75), np.inf], rtol=1e-6)
  np.testing.assert_allclose(out[0, 0], o_b[0, 0] * np.exp(1.25 - total), rtol=1e-6)
  np.testing.assert_allclose(out[0, 1], o_a[0, 1] * np.exp(0.5 - np.logaddexp(0.5, 0.75)),
                             rtol=1e-6)
  np.testing.assert_array_equal(out[0, 2], 0.0)
  nan_out, nan_lse = split_kv_attention.merge(o_a, lse_a.at[0, 0, 1].set(jnp.nan), o_b, lse_b)
  assert np.isnan(nan_lse[0, 0, 1]) and np.isnan(nan_out[0, 1]).all()  # NaN is not "empty"


def test_backend_without_kernel_parts_is_an_error(data):
  with pytest.raises(ValueError, match='backend="reference" has no separate forward'):
    _sharded(data, _mesh(2), "natural", overlap=True, causal=True, window=None, soft_cap=None,
             backend="reference")


_COLLECTIVES = ("collective-permute", "collective-permute-start", "all-gather",
                "all-gather-start", "all-reduce", "all-reduce-start", "reduce-scatter", "all-to-all")


def _hlo_graph(text: str):
  """Parse HLO text: (instructions name -> (opcode, operand names, called computations),
  computations name -> instruction names). Instruction names are unique in a module."""
  insts, comps, current = {}, {}, None
  for line in text.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+)\s.*\{$", line)
    if header and not line.startswith(" "):
      current = header.group(1)
      comps[current] = []
      continue
    if " = " not in line or current is None:
      continue
    name = line.split(" = ", 1)[0].strip().removeprefix("ROOT ").lstrip("%")
    rhs = line.split(" = ", 1)[1]
    m = re.search(r"([a-z][\w\-]*)\(", rhs)
    if not m:
      continue
    depth, i = 1, m.end()
    while depth and i < len(rhs):
      depth += {"(": 1, ")": -1}.get(rhs[i], 0)
      i += 1
    operands = [item.split()[-1].lstrip("%") for item in rhs[m.end():i - 1].split(",")
                if item.strip()]
    called = re.findall(r"(?:to_apply|body|condition|calls)=%?([\w.\-]+)", rhs[i:])
    index = re.search(r"index=(\d+)", rhs[i:])
    if m.group(1) == "get-tuple-element" and index:
      operands.append(int(index.group(1)))  # which element: read by _Dependencies
    insts[name] = (m.group(1), operands, called)
    comps[current].append(name)
  return insts, comps


class _Dependencies:
  """Data dependencies of an HLO module (pre-optimisation text: opt-barriers still in place).

  depends(x, on) is True when instruction x needs one of the instructions `on` (or, for
  on=None, any collective, also one inside a called computation). A get-tuple-element of an
  opt-barrier of a tuple follows only that element, so values passed through the same barrier
  stay apart (the barrier orders them, it does not mix them)."""

  def __init__(self, text: str):
    self.insts, self.comps = _hlo_graph(text)
    self._memo: dict = {}

  def operands(self, name):
    op, operands, _ = self.insts[name]
    if op == "get-tuple-element" and operands and isinstance(operands[-1], int):
      source, index = operands[0], operands[-1]
      if self.insts.get(source, ("",))[0] == "opt-barrier":
        source = self.insts[source][1][0]
      if self.insts.get(source, ("",))[0] == "tuple":
        return [self.insts[source][1][index]]
      return [source]
    return [o for o in operands if isinstance(o, str)]

  def _communicates(self, comp):
    return any(self.insts[n][0] in _COLLECTIVES
               or any(self._communicates(c) for c in self.insts[n][2])
               for n in self.comps.get(comp, ()))

  def depends(self, name, on=None):
    key = (name, on)
    if key not in self._memo:
      self._memo[key] = False
      if name in self.insts:
        op, _, called = self.insts[name]
        hit = (name in on) if on is not None else (
            op in _COLLECTIVES or any(self._communicates(c) for c in called))
        self._memo[key] = hit or any(self.depends(o, on) for o in self.operands(name))
    return self._memo[key]

  def barrier_elements(self):
    """[(barrier name, its tuple's element names)] for every opt-barrier of a tuple."""
    out = []
    for name, (op, operands, _) in self.insts.items():
      if op == "opt-barrier" and self.insts[operands[0]][0] == "tuple":
        out.append((name, self.insts[operands[0]][1]))
    return out

  def element(self, barrier, index):
    """The get-tuple-element instructions reading element `index` of `barrier`."""
    return frozenset(n for n, (op, operands, _) in self.insts.items()
                     if op == "get-tuple-element" and operands[0] == barrier
                     and operands[-1] == index)


def _program_text(data, *, grad: bool) -> str:
  mesh = _mesh(2)
  kw = dict(mesh=mesh, query_specs=QUERY_SPECS, kv_specs=KV_SPECS, token_order="natural")
  ints = tuple(jnp.asarray(data[n]) for n in ("q_pos", "q_seg", "kv_pos", "kv_seg"))

  def fwd(q, k, v):
    mask = context_parallel.create_attention_mask_sharded(
        *ints, fwd_params=FWD, bwd_params=BWD, calc_bwd_mask=grad, mesh=mesh,
        query_specs=QUERY_SPECS, kv_specs=KV_SPECS, token_order="natural",
        overlap_kv_gather=True)
    return flash_attention(q, k, v, *ints, mask, backend="jax", **kw)

  fn = jax.grad(lambda *a: jnp.sum(fwd(*a)), argnums=(0, 1, 2)) if grad else fwd
  return jax.jit(fn).lower(data["q"], data["k"], data["v"]).compiler_ir("hlo").as_hlo_text()


def test_local_part_does_not_wait_for_the_collective(data):
  """Forward, cp=2 (the kv arrives by collective-permute): the local part's results (the first
  two values through the barrier that orders the parts) depend on no collective; the remote
  part's key / value (its last two) do. XLA may run the permute while the local part computes."""
  deps = _Dependencies(_program_text(data, grad=False))
  assert any(op == "collective-permute" for op, _, _ in deps.insts.values())
  barriers = [e for _, e in deps.barrier_elements() if len(e) == 5]
  assert len(barriers) == 1, barriers
  out_a, lse_a, _, k_b, v_b = barriers[0]
  assert not deps.depends(out_a) and not deps.depends(lse_a)
  assert deps.depends(k_b) and deps.depends(v_b)


def test_remote_gradients_leave_before_the_local_backward(data):
  """Backward, cp=2: the collective-permutes taking the remote part's dk / dv back to their
  shard depend on the values the barrier hands to the remote part's results (elements 1, 2:
  dk_b, dv_b) and not on what it hands to the local part's backward (elements 3, 4: q, dO),
  so they can run behind the local part's backward."""
  deps = _Dependencies(_program_text(data, grad=True))
  backward = [(b, e) for b, e in deps.barrier_elements()
              if len(e) == 5 and not deps.depends(e[3])]  # (dq_b, dk_b, dv_b, q, dO)
  assert len(backward) == 1, backward
  barrier, _ = backward[0]
  remote_grads = deps.element(barrier, 1) | deps.element(barrier, 2)
  local_inputs = deps.element(barrier, 3) | deps.element(barrier, 4)
  assert remote_grads and local_inputs
  sends = [n for n, (op, _, _) in deps.insts.items()
           if op == "collective-permute" and deps.depends(n, remote_grads)]
  assert len(sends) == 2, sends  # dk and dv
  assert not any(deps.depends(n, local_inputs) for n in sends)
  # The check can fail: the local part's backward loops do depend on the barrier's local inputs.
  assert any(op == "while" and deps.depends(n, local_inputs)
             for n, (op, _, _) in deps.insts.items())
