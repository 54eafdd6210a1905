"""The kernels' launch orders compared in one process. Each order is an input of its kernel, so
the variants share one build and alternate call by call, free of the noise between processes.

    python -m benchmarks.tools.launch_orders [--kernel hopper_backward|mosaic_forward|
        mosaic_backward] [--seqs 16384,65536] [--cases causal,docs] [--head-dims 128]
        [--orders NAME,NAME] [--dtype bfloat16|float16] [--window W] [--soft-cap C]
        [--value-head-dim DV] [--scale S] [--rounds 9] [--out F]

Each variant is compiled on its own (about 20 s at 64k on an H200): name the --orders and
--cases a question needs.

--kernel (what is timed, backend):
  hopper_backward  forward+backward, "hopper": the CUDA backward's (kv head, kv tile) pairs
                   in fused_backward.launch_order's layouts ("documents", the default at head
                   dim 128 without a window, also with every document head by head and with
                   each tile's heads together; "heads_slowest"; "heads_fastest"), in sequence
                   (each tile's heads together) and reversed;
  mosaic_forward   the forward alone, "hopper" (the Mosaic forward): its query tiles longest
                   first (the default of both grids: the persistent grid's deal, the per-tile
                   grid's launch order), in sequence order, reversed;
  mosaic_backward  forward+backward, "mosaic": both Mosaic backward kernels' (tile, head) launch
                   positions longest first over the heads (their default), in sequence order
                   with the heads fastest, reversed.

--libraries NAME=PATH,NAME=PATH (with --kernel hopper_backward) compares builds of
fused_backward.cu instead of orders: each library is loaded and registered as an FFI target of
its own, and each variant traces the backward with fused_backward.TARGET set to its target. The
JAX side and dq's conversion kernel are this tree's (so each library must report this tree's
ABI version), so this is the same-process A/B for a change to the kernel source alone
(build each with `python -m kvax_plugin.attention.kernels.cuda_sm90.build --cache-dir DIR`);
the gate (benchmarks/gate.py) compares whole trees, one process per tree and round.

--window, --soft-cap and --value-head-dim (MLA's value head dim, e.g. --head-dims 192
--value-head-dim 128) select the kernel families beyond the plain one; all apply to every case.
--scale (default head dim ** -0.5): a scale <= 0 without a soft cap runs the CUDA backward's
mask-in-loop kernels.

Cases: the gate's (benchmarks/cases.py; causal and 12 documents + 1000 padding tokens), B=1, 32
query / 8 kv heads, bf16 unless --dtype; ms per call, median over rounds of about 20 ms of
back-to-back calls each, the variants round-robin in balanced orders (timing.round_orders).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import itertools
import json
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp

import kvax_plugin
from benchmarks.cases import layout
from benchmarks.timing import alternate
from kvax_plugin.attention import block_mask
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward
from kvax_plugin.attention.kernels.mosaic import backward as mosaic_backward
from kvax_plugin.attention.kernels.mosaic import forward


def _ascending(lower, upper, tiles_per_row, n_tiles):
  return jnp.broadcast_to(jnp.arange(n_tiles, dtype=jnp.int32), (lower.shape[0], n_tiles))


def _descending(lower, upper, tiles_per_row, n_tiles):
  return _ascending(lower, upper, tiles_per_row, n_tiles)[:, ::-1]


# The forward's deal: block_mask.longest_first's signature (forward.py calls it by that name).
FORWARD_ORDERS = {"longest_first": block_mask.longest_first, "ascending": _ascending,
                  "descending": _descending}


def _layout(layout: str, wave: int | None = None):
  """fused_backward.launch_order's layout `layout` (wave: its "documents" wave; None the GPU's)
  as the order function the wrapper calls, whatever layout it asks for."""
  saved = fused_backward.launch_order

  def launch(bounds, n_tiles, kv_heads, _layout, wave_=None):
    return saved(bounds, n_tiles, kv_heads, layout, wave=wave)
  return launch


def _ascending_pairs(bounds, n_tiles, kv_heads, _layout, wave=None):
  tiles = jnp.arange(n_tiles, dtype=jnp.int32)
  heads = jnp.arange(kv_heads, dtype=jnp.int32)
  codes = fused_backward.pack_order(jnp.tile(heads, n_tiles), jnp.repeat(tiles, kv_heads))
  return jnp.broadcast_to(codes, (bounds[0].shape[0], n_tiles * kv_heads))


# The CUDA backward's (kv head, tile) orders: fused_backward.launch_order's signature.
BACKWARD_ORDERS = {
    "documents": _layout("documents"),
    "documents_by_head": _layout("documents", wave=0),  # every document head by head
    "documents_heads_together": _layout("documents", wave=2**31 - 1),  # each tile's heads
    "heads_slowest": _layout("heads_slowest"),
    "heads_fastest": _layout("heads_fastest"),
    "ascending": _ascending_pairs,
    "descending": lambda *a, **k: _ascending_pairs(*a, **k)[:, ::-1],
}


def _over_heads_ascending(lower, upper, tiles_per_row, n_tiles, n_heads):
  n = n_tiles * n_heads
  return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (lower.shape[0], n))


# The Mosaic backward kernels' order: block_mask.longest_first_over_heads's signature, codes
# tile * n_heads + head.
MOSAIC_BACKWARD_ORDERS = {
    "longest_first": block_mask.longest_first_over_heads, "ascending": _over_heads_ascending,
    "descending": lambda *a: _over_heads_ascending(*a)[:, ::-1]}

# --kernel: (the module whose order function is replaced, its name there, the orders, backend,
# forward only)
KERNELS = {
    "hopper_backward": (fused_backward, "launch_order", BACKWARD_ORDERS, "hopper", False),
    "mosaic_forward": (forward, "longest_first", FORWARD_ORDERS, "hopper", True),
    "mosaic_backward": (mosaic_backward, "longest_first_over_heads", MOSAIC_BACKWARD_ORDERS,
                        "mosaic", False),
}


def library_targets(spec: str) -> dict:
  """{name: FFI target} for --libraries "NAME=PATH,...": each library loaded, checked for this
  tree's interface version (fused_backward.check_abi) and registered under a target of its own,
  the TARGET value its variant is traced with.

  The running tree's own library is loaded before any of them is registered: fused_backward.load
  registers it under the module's TARGET, which compile_variants patches while tracing, so a
  first load during a variant's trace would register that variant's target a second time, with
  the tree's library, and XLA refuses a second handler under one name."""
  libraries = {}
  for item in spec.split(","):
    name, sep, path = item.partition("=")
    if not sep or not name.isidentifier() or not path:
      raise ValueError(f"--libraries {item!r}: expected NAME=PATH (NAME an identifier)")
    if name in libraries:
      raise ValueError(f"--libraries: {name!r} named twice")
    lib_path = Path(path).resolve()
    if not lib_path.is_file():
      raise FileNotFoundError(f"--libraries {name}={path}: no such file")
    lib = ctypes.CDLL(str(lib_path))
    fused_backward.check_abi(lib, lib_path)
    libraries[name] = lib
  fused_backward.load()
  targets = {}
  for name, lib in libraries.items():
    target = f"{fused_backward.TARGET}_{name}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.KvaxSm90FusedBackward),
                                platform="CUDA")
    targets[name] = target
  return targets


@contextlib.contextmanager
def launch_order(module, name: str, fn):
  """module.name (the order function a kernel's wrapper calls) replaced by fn while tracing."""
  saved = getattr(module, name)
  setattr(module, name, fn)
  try:
    yield
  finally:
    setattr(module, name, saved)


def compile_variants(make, args, module, name: str, orders: dict) -> dict:
  """{label: make() lowered on args and compiled with module.name replaced by orders[label]}.

  JAX caches a traced function by its identity and argument types, so a second lowering of the
  same function would silently reuse the first order's trace: the caches are cleared before
  each variant, and variants whose lowered programs are identical are refused (the patch did
  not reach the kernel's wrapper)."""
  fns, texts = {}, {}
  for label, order in orders.items():
    jax.clear_caches()
    with launch_order(module, name, order):
      lowered = make().lower(*args)
    texts[label] = lowered.as_text()
    fns[label] = lowered.compile()
  same = [(a, b) for a, b in itertools.combinations(texts, 2) if texts[a] == texts[b]]
  if same:
    raise RuntimeError(f"launch orders {same} lowered to identical programs: "
                       f"{module.__name__}.{name} is not what the kernel's wrapper calls")
  return fns


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seqs", default="16384,65536")
  ap.add_argument("--head-dims", default="128")
  ap.add_argument("--kernel", choices=tuple(KERNELS), default="hopper_backward")
  ap.add_argument("--cases", default="causal,docs")
  ap.add_argument("--orders", help="comma-separated order names (default: all of --kernel's)")
  ap.add_argument("--libraries", help="NAME=PATH,NAME=PATH: builds of fused_backward.cu to "
                  "compare instead of orders (--kernel hopper_backward)")
  ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
  ap.add_argument("--window", type=int, help="sliding window (tokens) of every case's mask")
  ap.add_argument("--soft-cap", type=float, help="logits soft cap of every call")
  ap.add_argument("--value-head-dim", type=int,
                  help="value head dim when it differs from --head-dims (MLA: 192 / 128)")
  ap.add_argument("--scale", type=float, help="softmax scale of every call (default head dim "
                  "** -0.5; <= 0 without a soft cap: the mask-in-loop kernels)")
  ap.add_argument("--rounds", type=int, default=9)
  ap.add_argument("--out", help="results file, rewritten after each case")
  args = ap.parse_args(argv)
  heads, kv_heads = 32, 8
  for name in ("window", "soft_cap", "value_head_dim"):
    value = getattr(args, name)
    if value is not None and value <= 0:
      ap.error(f"--{name.replace('_', '-')}: expected a positive number, got {value}")
  target, attr, orders, backend, forward_only = KERNELS[args.kernel]
  if args.libraries:
    if args.kernel != "hopper_backward" or args.orders:
      ap.error("--libraries: with --kernel hopper_backward and without --orders")
    try:
      orders = library_targets(args.libraries)
    except (ValueError, OSError, RuntimeError) as e:
      ap.error(str(e))
    attr = "TARGET"
  elif args.orders:
    unknown = set(args.orders.split(",")) - set(orders)
    if unknown:
      ap.error(f"--orders: {sorted(unknown)} unknown for --kernel {args.kernel} "
               f"(known: {', '.join(orders)})")
    orders = {name: orders[name] for name in args.orders.split(",")}
  if len(orders) < 2:
    ap.error("--orders: name two orders or more (one order has nothing to compare with)")
  conditions = dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      gpu=jax.devices()[0].device_kind, jax=jax.__version__, rounds=args.rounds,
      shapes=dict(batch=1, heads=heads, kv_heads=kv_heads, dtype=args.dtype,
                  value_head_dim=args.value_head_dim),
      features=dict(window=args.window, soft_cap=args.soft_cap), scale=args.scale,
      kernel=args.kernel, backend=backend,
      libraries=args.libraries and dict(x.split("=", 1) for x in args.libraries.split(",")),
      timed=("jit(flash_attention)" if forward_only else
             "jit(grad(sum(out * dO))) over q, k, v") + ", the mask prebuilt")
  dtype = jnp.dtype(args.dtype)
  rows = []
  for d, seq in itertools.product(map(int, args.head_dims.split(",")),
                                  map(int, args.seqs.split(","))):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (1, seq, heads, d), dtype)
    dv = args.value_head_dim or d
    k = jax.random.normal(keys[1], (1, seq, kv_heads, d), dtype)
    v = jax.random.normal(keys[2], (1, seq, kv_heads, dv), dtype)
    cot = jax.random.normal(keys[3], (1, seq, heads, dv), dtype)

    def attend(q, k, v, pos, seg, mask):
      scale = d ** -0.5 if args.scale is None else args.scale
      return kvax_plugin.flash_attention(q, k, v, pos, seg, pos, seg, mask, scale=scale,
                                         logits_soft_cap=args.soft_cap, backend=backend)

    def loss(q, k, v, pos, seg, mask):
      return jnp.sum(attend(q, k, v, pos, seg, mask).astype(jnp.float32)
                     * cot.astype(jnp.float32))

    for case in args.cases.split(","):
      pos, seg, _ = layout(case, seq, seed=0, counted_padding=True)
      pos, seg = jnp.asarray(pos), jnp.asarray(seg)
      mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True,
                                               sliding_window=args.window)
      call = (q, k, v, pos, seg, mask)
      make = lambda: (jax.jit(attend) if forward_only
                      else jax.jit(jax.grad(loss, argnums=(0, 1, 2))))
      fns = compile_variants(make, call, target, attr, orders)
      times = alternate(fns, call, args.rounds)
      row = dict(head_dim=d, value_head_dim=dv, seq=seq, case=case,
                 ms={n: statistics.median(t) for n, t in times.items()},
                 ms_rounds=times)
      rows.append(row)
      print(f"D={d}/{dv} {seq} {case}: "
            + "  ".join(f"{n} {ms:.3f}" for n, ms in row["ms"].items()), flush=True)
      if args.out:
        Path(args.out).write_text(json.dumps(dict(conditions=conditions, rows=rows), indent=1))
  return dict(conditions=conditions, rows=rows)


if __name__ == "__main__":
  main()
