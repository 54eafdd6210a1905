"""FlashAttention-3 for JAX (PyPI flash-attn3-jax, module flash_attn3_jax) as a peer of the
benchmark: `--impls ...,fa3`.

    pip install flash-attn3-jax==0.2.3 einops     # prebuilt for sm_90 (H100 / H200)
    python -m benchmarks.run --preset quick --no-e2e --impls auto,cudnn,tokamax_mosaic,fa3

What runs:
  causal rows  flash_mha(q, k, v, softmax_scale=scale, is_causal=True) on [B, S, H, D]
               (GQA as given: 32 query, 8 kv heads); the timing is that call alone.
  documents    flash_mha_varlen on the documents as separate sequences: the tokens of every
               document (padding dropped, the rows of B > 1 one after another) gathered into
               [T, H, D], cu_seqlens from the documents' lengths, is_causal=True, the output
               scattered back into [B, S, H, D] (zeros at padding). The timing counts the
               kernel call(s) plus that gather of q, k, v and scatter of the output (and, in
               forward+backward, their transposes): what a caller holding packed rows pays.
The (q, kv) pairs it computes are the documents' causal pairs, the ones our mask keeps, so its
effective TFLOP/s use the same count.

It is "unavailable: <reason>" (a row with that error, not a failure of the run) when the package
does not import, there is no CUDA GPU, the GPU is not sm_90, the head dim is not 128 (the wheel's
only build) or query / key and value head dims differ.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cases import PAD

MODULE = "flash_attn3_jax"
HEAD_DIMS = (128,)


@dataclasses.dataclass(frozen=True)
class Varlen:
  """Packed rows as separate sequences. index: int32 [T], the flat token (b * S + s) of each
  kept token, documents in order; cu_seqlens: int32 [n + 1], where each document starts in
  those T tokens (0 first, T last); max_seqlen: the longest document."""
  index: np.ndarray
  cu_seqlens: np.ndarray
  max_seqlen: int
  batch: int
  seq: int


def varlen_layout(pos, seg) -> Varlen:
  """The documents of packed rows (positions, segment ids [B, S], host arrays) as FA3's
  sequences: a document is a run of one non-padding segment id; padding tokens (segment id PAD)
  are dropped. FA3 is causal in token order, ours in positions: a document whose positions do
  not count up by one, or a segment id met again after another (one document to our mask, two
  sequences to FA3), is refused (ValueError)."""
  pos, seg = np.asarray(pos), np.asarray(seg)
  if pos.shape != seg.shape or pos.ndim != 2:
    raise ValueError(f"positions {pos.shape} and segment ids {seg.shape}: expected both [B, S]")
  batch, seq = seg.shape
  index, lengths = [], []
  for b in range(batch):
    starts = [s for s in range(seq) if seg[b, s] != PAD and (s == 0 or seg[b, s] != seg[b, s - 1])]
    ids = [int(seg[b, s]) for s in starts]
    if len(set(ids)) != len(ids):
      raise ValueError(f"row {b}: a segment id comes back after another ({ids}): FA3's "
                       "sequences cannot hold such a document")
    for s0 in starts:
      s1 = s0 + 1
      while s1 < seq and seg[b, s1] == seg[b, s0]:
        s1 += 1
      if np.any(np.diff(pos[b, s0:s1]) != 1):
        raise ValueError(f"row {b}, segment {seg[b, s0]}: positions do not count up by one; "
                         "FA3 is causal in token order")
      index.extend(range(b * seq + s0, b * seq + s1))
      lengths.append(s1 - s0)
  cu = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
  return Varlen(index=np.asarray(index, np.int32), cu_seqlens=cu,
                max_seqlen=int(max(lengths, default=0)), batch=batch, seq=seq)


def gather_tokens(x, v: Varlen):
  """[B, S, H, D] -> [T, H, D]: the kept tokens, documents in order."""
  return x.reshape((v.batch * v.seq,) + x.shape[2:])[jnp.asarray(v.index)]


def scatter_tokens(t, v: Varlen):
  """[T, H, D] -> [B, S, H, D]: each token back at its place, zeros at padding."""
  flat = jnp.zeros((v.batch * v.seq,) + t.shape[1:], t.dtype).at[jnp.asarray(v.index)].set(t)
  return flat.reshape((v.batch, v.seq) + t.shape[1:])


def documents_fn(varlen_fn, pos, seg, scale: float):
  """(q, k, v) -> [B, S, H, Dv] attention of the packed documents through `varlen_fn`, called
  as flash_attn3_jax.flash_mha_varlen (tokens [T, H, D], int32 cu_seqlens)."""
  v_layout = varlen_layout(pos, seg)
  cu = jnp.asarray(v_layout.cu_seqlens)

  def fn(q, k, v):
    out = varlen_fn(gather_tokens(q, v_layout), gather_tokens(k, v_layout),
                    gather_tokens(v, v_layout), cu, cu, max_seqlen_q=v_layout.max_seqlen,
                    max_seqlen_k=v_layout.max_seqlen, softmax_scale=float(scale), is_causal=True)
    return scatter_tokens(out, v_layout)
  fn.varlen = v_layout
  return fn


def unavailable(dk: int, dv: int, device=None, module_name: str = MODULE) -> str | None:
  """Why FA3 cannot run here ("unavailable: ..."), or None when it can."""
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return f"unavailable: FA3 needs a CUDA GPU (JAX platform: {device.platform})"
  cc = str(getattr(device, "compute_capability", ""))
  if cc and cc != "9.0":
    return f"unavailable: the flash-attn3-jax wheel is built for sm_90 only (this GPU: sm_{cc})"
  if dk != dv or dk not in HEAD_DIMS:
    return (f"unavailable: the flash-attn3-jax wheel has head dim {HEAD_DIMS} only (here "
            f"{dk}/{dv})")
  try:
    importlib.import_module(module_name)
  except Exception as e:  # noqa: BLE001 - the reason is the row's result
    return (f"unavailable: {module_name} does not import ({type(e).__name__}: {str(e)[:200]}; "
            "pip install flash-attn3-jax==0.2.3 einops)")
  return None


def make(case: str, pos, seg, scale: float, dk: int, dv: int):
  """The fa3 implementation of a case, (q, k, v) -> out, or the "unavailable: ..." reason."""
  why = unavailable(dk, dv)
  if why:
    return why
  mod = importlib.import_module(MODULE)
  if case == "causal":
    return lambda q, k, v: mod.flash_mha(q, k, v, softmax_scale=float(scale), is_causal=True)
  return documents_fn(mod.flash_mha_varlen, pos, seg, scale)
