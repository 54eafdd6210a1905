"""The implementations the kernel benchmark times, by name, and how each sees a case.

Ours, through the public op (kvax_plugin.flash_attention), one per backend name: auto, hopper,
mosaic, mosaic_fused (= mosaic with deterministic_backward=False), triton, jax; and --variant
labels (one of ours with kvax_plugin.KernelOptions fields set). The peers:
  cudnn           jax.nn.dot_product_attention(implementation="cudnn"); documents as a dense
                  [B, 1, S, S] boolean mask (it has no segment ids);
  tokamax_mosaic, tokamax_triton
                  tokamax's Mosaic GPU and Pallas-Triton flash attention; documents as a
                  per-row k_start mask (each row sees keys from its document's start, plus
                  causality; padding rows attend to themselves, which costs nothing extra);
  fa3             FlashAttention-3 for JAX (benchmarks/fa3.py: flash_mha on causal rows,
                  flash_mha_varlen on the documents as separate sequences).
A peer that cannot run here is a string saying why instead of a function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import fa3
from benchmarks.cases import NO_FEATURES, PAD, dense_mask
from kvax_plugin.attention.api import flash_attention
from kvax_plugin.attention.block_mask import create_attention_mask
from kvax_plugin.attention.kernels import resolve_backend_for
from kvax_plugin.attention.options import KernelOptions

OURS = ("auto", "hopper", "mosaic", "mosaic_fused", "triton", "jax")
PEERS = ("cudnn", "tokamax_mosaic", "tokamax_triton", "fa3")
IMPLS = OURS + PEERS
PEER_NAMES = {"cudnn": "cuDNN", "tokamax_mosaic": "tokamax Mosaic",
              "tokamax_triton": "tokamax Pallas-Triton", "fa3": "FA3"}


def impl_order(rows) -> list[str]:
  """The implementations of timed rows: ours, the peers, then --variant labels as they came."""
  names = [r["impl"] for r in rows if r.get("pass") in ("fwd", "fwd_bwd")]
  return ([n for n in IMPLS if n in names]
          + [n for n in dict.fromkeys(names) if n not in IMPLS])


def parse_variant(spec: str) -> tuple[str, str, dict]:
  """'label=BACKEND:field=value,field=value' -> (label, backend, KernelOptions fields): a run of
  one of our backends with kvax_plugin.KernelOptions set (values: integers, true / false, or
  strings as written)."""
  label, sep, rest = spec.partition("=")
  backend, _, fields = rest.partition(":")
  if not sep or not label or backend not in OURS:
    raise ValueError(f"--variant {spec!r}: expected LABEL=BACKEND:FIELD=VALUE,... with BACKEND "
                     f"one of {OURS}")
  options = {}
  for item in filter(None, fields.split(",")):
    key, eq, value = item.partition("=")
    if not eq:
      raise ValueError(f"--variant {spec!r}: {item!r} is not FIELD=VALUE")
    low = value.lower()
    options[key] = (True if low == "true" else False if low == "false"
                    else int(value) if value.lstrip("-").isdigit() else value)
  return label, backend, options


def auto_choice(mask, dtype, dk: int, dv: int, features=NO_FEATURES) -> str | None:
  """What backend="auto" runs for these inputs here (None if it cannot say)."""
  needed = [name for name, on in (("sliding_window", features["window"]),
                                  ("logits_soft_cap", features["soft_cap"]),
                                  ("sinks", features["sinks"])) if on]
  try:
    return resolve_backend_for("auto", dtype, dk, dv, tuple(needed), mask)
  except Exception:  # noqa: BLE001 - only a label for the table
    return None


def _tokamax(case, seg, scale, wanted):
  """tokamax's implementations by name, or why each cannot run."""
  out = {}
  try:
    from tokamax._src.ops.attention import api as tk_api  # optional peer: imported when asked
    from tokamax._src.ops.attention import base as tk_base
    if case == "causal":
      tk_mask = tk_base.Mask(is_causal=True)
    else:
      start = np.zeros(seg.shape[1], np.int32)
      for i in range(seg.shape[1]):  # start index of each row's document; padding: itself
        same = i and seg[0, i] != PAD and seg[0, i - 1] == seg[0, i]
        start[i] = start[i - 1] if same else i
      tk_mask = tk_base.Mask(k_start=jnp.asarray(start)[None, None, :], is_causal=True)
    for name in wanted:
      key = "mosaic_gpu" if name == "tokamax_mosaic" else "triton"
      if key not in tk_api.IMPLEMENTATIONS:
        out[name] = f"tokamax has no {key!r} implementation here"
        continue
      impl = tk_api.IMPLEMENTATIONS[key]
      out[name] = (lambda impl: (lambda q, k, v: impl(q, k, v, mask=tk_mask,
                                                      logits_scale=scale)))(impl)
  except Exception as e:  # noqa: BLE001 - record why the peer is missing
    for name in wanted:
      out[name] = f"tokamax import failed: {e!r}"
  return out


def make_impls(case, pos, seg, scale, names=IMPLS, variants=(), features=NO_FEATURES,
               heads: int = 32, head_dims: tuple[int, int] | None = None):
  """name -> forward function of (q, k, v), or a string saying why it cannot run here; and the
  block mask ours use (built once, as a training step does). variants: parse_variant's
  (label, backend, KernelOptions fields), each an implementation named by its label.
  features: window / soft_cap / sinks (NO_FEATURES: none); with any, the peers do not run.
  head_dims: (Dk, Dv), for the peers that exist for some head dims only (default: 1 / scale^2)."""
  jpos, jseg = jnp.asarray(pos), jnp.asarray(seg)
  mask = create_attention_mask(jpos, jseg, jpos, jseg, calc_bwd_mask=True,
                               sliding_window=features["window"])
  impls = {}
  sinks = (jnp.linspace(-1.0, 1.0, heads, dtype=jnp.float32) if features["sinks"] else None)

  def ours(backend, **kw):
    def fn(q, k, v):
      return flash_attention(q, k, v, jpos, jseg, jpos, jseg, mask, scale=scale,
                             backend=backend, logits_soft_cap=features["soft_cap"],
                             sinks=sinks, **kw)
    fn.mask = mask
    return fn

  for name in names:
    if name == "mosaic_fused":  # dq reduce-added by the dk/dv kernel: 5 products, not bitwise
      impls[name] = ours("mosaic", deterministic_backward=False)
    elif name in OURS:
      impls[name] = ours(name)
  for label, backend, fields in variants:
    impls[label] = ours("mosaic" if backend == "mosaic_fused" else backend,
                        kernel_options=KernelOptions(**fields),
                        **({"deterministic_backward": False} if backend == "mosaic_fused" else {}))
    impls[label].kernel_options = fields
  platform = jax.devices()[0].platform
  if features != NO_FEATURES:
    for name in PEERS:
      if name in names:
        impls[name] = f"not run with {features} (our backends' comparison)"
    return impls, mask
  if "cudnn" in names:
    if platform != "gpu":
      impls["cudnn"] = f"cuDNN needs a CUDA GPU (JAX platform: {platform})"
    elif case == "causal":
      impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    else:
      def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=dense_mask(jpos, jseg)[:, None],
                                            scale=scale, implementation="cudnn")
      impls["cudnn"] = cudnn
  wanted_tk = [n for n in ("tokamax_mosaic", "tokamax_triton") if n in names]
  if wanted_tk and platform != "gpu":
    for n in wanted_tk:
      impls[n] = f"tokamax's GPU kernels need a CUDA GPU (JAX platform: {platform})"
  elif wanted_tk:
    impls.update(_tokamax(case, seg, scale, wanted_tk))
  if "fa3" in names:
    dk, dv = head_dims or (round(scale ** -2),) * 2
    impls["fa3"] = fa3.make(case, pos, seg, scale, dk, dv)
  return impls, mask
