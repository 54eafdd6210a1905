"""The JAX side of the CUDA C++ fused backward (kvax_plugin/attention/kernels/cuda_sm90), on the
CPU: the block bounds it takes from the mask, its argument checks, and the index maps its
kernel uses (dS stored with stmatrix .trans, the dQ part staged in fragment order), simulated
from the kernel's formulas and inverted by the JAX side. The kernel itself runs in
tests/gpu/test_cuda_sm90_gpu.py (a Hopper GPU and the built shared object)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvax_plugin.attention.block_mask import FlashAttentionParamsConfig, create_attention_mask
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward as cuda_bwd

import layouts


def test_tile_bounds_are_the_dkv_table_in_64_row_blocks():
  pos, seg = layouts.packed_documents(np.random.default_rng(1), 1, 1024, num_docs=4, pad_tail=50)
  mask = create_attention_mask(jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos),
                               jnp.asarray(seg), calc_bwd_mask=True)
  bounds = cuda_bwd.tile_bounds(mask)
  assert mask.spec.bwd_params.query_block_size == 128
  assert len(bounds) == 4  # visited (lower, upper), kept whole (full_lower, full_upper)
  for got, table in zip(bounds, mask.dkv):
    assert got.dtype == jnp.int32 and got.shape == (1, 1024 // 128)
    np.testing.assert_array_equal(np.asarray(got), 2 * np.asarray(table))
  lo, up, full_lo, full_up = (np.asarray(x) for x in bounds)
  assert (lo <= up).all() and (up <= 1024 // 64).all()
  # the kernel skips the mask on steps in [full_lo, full_up): some tiles have such steps, and
  # where the range is not empty it lies inside the visited one
  whole = full_lo < full_up
  assert whole.any() and (lo[whole] <= full_lo[whole]).all() and (full_up[whole] <= up[whole]).all()
  causal = np.arange(512, dtype=np.int32)[None]
  small_kv = create_attention_mask(
      jnp.asarray(causal), jnp.zeros((1, 512), jnp.int32), jnp.asarray(causal),
      jnp.zeros((1, 512), jnp.int32), calc_bwd_mask=True,
      bwd_params=FlashAttentionParamsConfig(query_block_size=128, kv_block_size=64))
  with pytest.raises(ValueError, match="kv blocks of 128"):
    cuda_bwd.tile_bounds(small_kv)


def test_fused_backward_rejects_what_the_kernel_does_not_cover():
  z = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  ids = jnp.zeros((1, 256), jnp.int32)
  bounds = (jnp.zeros((1, 2), jnp.int32),) * 4
  stats = jnp.zeros((1, 4, 256), jnp.float32)
  # (query / key shape, extra arguments, message): what the kernel cannot take, named
  calls = (
      (((1, 256, 4, 96), (1, 256, 2, 96)), {}, r"expected head dims \(q / k, v\) one of"),
      # (192, 192): MLA's layout is built for v / d_out of 128 only
      (((1, 256, 4, 192), (1, 256, 2, 192)), {}, r"\(192, 128\)\), one batch size"),
      (((1, 256, 4, 128), (1, 256, 2, 64)), {}, r"expected head dims \(q / k, v\) one of"),
      (((1, 200, 4, 128), (1, 200, 2, 128)), {}, "Sq and Skv multiples of 128"),
      (((1, 256, 4, 128), (1, 256, 2, 128)), {"variant": "v6"},
       r"variant='v6': expected one of \['v7'\]"),
      (((1, 256, 4, 128), (1, 256, 2, 128)), {"soft_cap": -1.0}, "soft_cap=-1.0, window=0"),
      (((1, 256, 4, 128), (1, 256, 2, 128)), {"window": -5}, "soft_cap=0.0, window=-5"),
  )
  for (q_shape, k_shape), extra, message in calls:
    with pytest.raises(ValueError, match=message):
      cuda_bwd.fused_backward(z(*q_shape), z(*k_shape), z(*k_shape), z(*q_shape), stats, stats,
                              ids, ids, ids, ids, bounds, scale=0.1, causal=True, **extra)
  f32 = lambda *shape: jnp.zeros(shape, jnp.float32)
  with pytest.raises(ValueError, match="q: float32; expected bfloat16 or float16"):
    cuda_bwd.fused_backward(f32(1, 256, 4, 128), f32(1, 256, 2, 128), f32(1, 256, 2, 128),
                            f32(1, 256, 4, 128), stats, stats, ids, ids, ids, ids, bounds,
                            scale=0.1, causal=True)
  good = dict(q=z(1, 256, 4, 128), k=z(1, 256, 2, 128), v=z(1, 256, 2, 128),
              d_out=z(1, 256, 4, 128), lse=stats, delta=stats, q_pos=ids, q_seg=ids,
              kv_pos=ids, kv_seg=ids, bounds=bounds)
  for name, bad, message in (
      ("lse", jnp.zeros((1, 256, 4), jnp.float32),
       r"lse: shape \(1, 256, 4\), expected \(1, 4, 256\)"),
      ("delta", jnp.zeros((1, 4, 128), jnp.float32), r"delta: shape .*expected \(1, 4, 256\)"),
      ("d_out", z(1, 256, 2, 128), r"d_out: shape \(1, 256, 2, 128\)"),
      ("v", z(1, 256, 4, 128), r"v: shape \(1, 256, 4, 128\), expected \(1, 256, 2, 128\)"),
      ("kv_seg", jnp.zeros((1, 255), jnp.int32), r"kv_seg: shape \(1, 255\)"),
      ("bounds", bounds[:1], r"bounds: expected tile_bounds\(mask\)"),
      ("bounds", (jnp.zeros((1, 3), jnp.int32),) * 4, r"bounds: expected .*\(1, 2\)")):
    with pytest.raises(ValueError, match=message):
      cuda_bwd.fused_backward(**dict(good, **{name: bad}), scale=0.1, causal=True)


def _fragment(t: int, pair: int):
  """(row, col) of the first of the two elements of accumulator pair `pair` of thread t in a
  wgmma m64nN float32 accumulator (the kernel's comment: row r0 + 8 ((i / 2) % 2), column
  8 (i / 4) + 2 (lane % 4) with i = 2 pair)."""
  warp, lane = divmod(t, 32)
  return 16 * warp + lane // 4 + 8 * (pair % 2), 8 * (pair // 2) + 2 * (lane % 4)


def test_dq_staging_order_is_undone_by_the_jax_side():
  """v6 (FRAG) stages register pair p of thread t at float offset (p * 128 + t) * 2; after the bulk
  reduce-add the JAX side's unpermute_fragment_order must give the 64 x 64 block back."""
  block = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
  staged = np.zeros(64 * 64, np.float32)
  for t in range(128):
    for p in range(16):
      row, col = _fragment(t, p)
      staged[(p * 128 + t) * 2:(p * 128 + t) * 2 + 2] = block[row, col:col + 2]
  back = np.asarray(cuda_bwd.unpermute_fragment_order(jnp.asarray(staged)[None]))[0]
  np.testing.assert_array_equal(back, block)


def _write_vector_order(part):
  """A 64 x 64 block as red_add_part writes it: thread t's elements 4 j .. 4 j + 3 (accumulator
  pairs 2 j and 2 j + 1: the same columns, rows 8 apart) at float offset (j 128 + t) 4."""
  out = np.zeros(64 * 64, part.dtype)
  for t in range(128):
    for j in range(8):
      row, col = _fragment(t, 2 * j)
      off = (j * 128 + t) * 4
      out[off:off + 2] = part[row, col:col + 2]
      out[off + 2:off + 4] = part[row + 8, col:col + 2]
  return out


def test_vector_order_is_undone_by_the_jax_side():
  """The wide kernels' 16-byte reduce-adds put every element of the block somewhere distinct,
  and unpermute_vector_order gives the 64 x 64 block back."""
  block = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
  written = _write_vector_order(block)
  assert sorted(written.tolist()) == sorted(block.reshape(-1).tolist())
  back = np.asarray(cuda_bwd.unpermute_vector_order(jnp.asarray(written)[None]))[0]
  np.testing.assert_array_equal(back, block)


@pytest.mark.parametrize("head_dim", [128, 192, 256])
@pytest.mark.parametrize("variant", sorted(cuda_bwd.VARIANTS))
def test_dq_from_accum_places_every_block(variant, head_dim):
  """dq_accum[b, h, part, block] as the kernels write it (its order per 64 x 64 part: row-major,
  or FRAG's fragment order at head dims 64 / 128; the vector order at 256 and 192) back to dq
  [B, Sq, H, D], scaled. Part k holds columns 64 k ..: at head dim 128 consumer c's half (k = c);
  at 256 consumer c's two parts j = 0, 1 (k = 2 c + j, columns 128 c + 64 j ..); at 192 consumer
  1's three parts."""
  rng = np.random.default_rng(1)
  b, sq, h, parts = 2, 192, 3, head_dim // 64
  dq = rng.normal(size=(b, sq, h, head_dim)).astype(np.float32)
  accum = np.zeros((b, h, parts, sq // 64, 4096), np.float32)
  for bi, hi, k, blk in np.ndindex(b, h, parts, sq // 64):
    part = dq[bi, 64 * blk:64 * blk + 64, hi, 64 * k:64 * k + 64]
    if head_dim > 128:
      accum[bi, hi, k, blk] = _write_vector_order(part)
    elif cuda_bwd.VARIANTS[variant] & cuda_bwd.FRAG:
      for t in range(128):
        for pr in range(16):
          row, col = _fragment(t, pr)
          accum[bi, hi, k, blk, (pr * 128 + t) * 2:(pr * 128 + t) * 2 + 2] = part[row, col:col + 2]
    else:
      accum[bi, hi, k, blk] = part.reshape(-1)
  got = cuda_bwd.dq_from_accum(jnp.asarray(accum), variant, 0.5, jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), 0.5 * dq)


def _sw128(row: int, col: int) -> int:
  """Byte offset of bf16 element (row, col) in a [rows][64] tile with the 128-byte swizzle."""
  return row * 128 + ((col >> 3) ^ (row & 7)) * 16 + (col & 7) * 2


def _stmatrix_image(ds_t, trans: bool) -> dict[int, float]:
  """Shared memory (byte offset -> value) after the four stmatrix.m8n8.x4 calls per warp that
  store the consumer's dS^T accumulator (kv rows x query columns): call g, lane l addresses row
  l % 8 of matrix m = l / 8, (h, j) = (m % 2, 2 g + m / 2); register m of each lane is pair
  4 g + m. stmatrix's fragment: lane L holds matrix row L / 4, columns 2 (L % 4) + {0, 1}.
  trans (head dim 128): memory row k <- matrix column k, at query 8 j + k, kv 16 warp + 8 h;
  not trans (head dim 256): memory row k <- matrix row k, at kv 16 warp + 8 h + k, query 8 j."""
  image = {}
  for warp in range(4):
    for g in range(4):
      for m in range(4):
        h, j = m % 2, 2 * g + m // 2
        pair = 4 * g + m
        # the 8 x 8 matrix m as held in registers: lane L has row L / 4, cols 2 (L % 4) + e
        matrix = np.zeros((8, 8), np.float32)
        for lane in range(32):
          row, col = _fragment(32 * warp + lane, pair)
          assert (row, col) == (16 * warp + 8 * h + lane // 4, 8 * j + 2 * (lane % 4))
          matrix[lane // 4, 2 * (lane % 4):2 * (lane % 4) + 2] = ds_t[row, col:col + 2]
        for k in range(8):  # lane 8 m + k's address
          if trans:
            base, values = _sw128(8 * j + k, 16 * warp + 8 * h), matrix[:, k]
          else:
            base, values = _sw128(16 * warp + 8 * h + k, 8 * j), matrix[k, :]
          for e in range(8):
            image[base + 2 * e] = values[e]
  return image


def test_stmatrix_trans_writes_ds_as_the_dq_product_reads_it():
  """v6 (STM) stores dS^T (the consumer's registers: kv rows x query columns) with four
  stmatrix.m8n8.x4.trans per warp: call g, lane l addresses row l % 8 of matrix m = l / 8,
  (h, j) = (m % 2, 2 g + m / 2), at query 8 j + l % 8, kv 16 warp + 8 h; register m of each lane
  is pair 4 g + m. stmatrix's fragment: lane L holds matrix row L / 4, columns 2 (L % 4) + {0,
  1}; .trans writes matrix column k as the 8 contiguous elements at lane 8 m + k's address.
  Reading the image as the dQ product's K-major operand (element (q, kv) at _sw128(q, kv))
  must give dS = (dS^T)^T."""
  ds_t = np.random.default_rng(1).normal(size=(64, 64)).astype(np.float32)  # [kv][q]
  image = _stmatrix_image(ds_t, trans=True)
  ds = np.array([[image[_sw128(q, kv)] for kv in range(64)] for q in range(64)])
  np.testing.assert_array_equal(ds, ds_t.T)


def test_head_dim_256_stmatrix_writes_ds_t_as_dk_and_dq_read_it():
  """backward_d256_kernel stores dS^T [kv][q] with stmatrix.m8n8.x4 (not transposed): call g,
  lane l addresses row l % 8 of matrix m = l / 8 at kv row 16 warp + 8 (m % 2) + l % 8, query
  column 8 (2 g + m / 2); register m is pair 4 g + m. Without .trans, memory row k of a matrix is
  its row k (lane 4 k + i holds columns 2 i, 2 i + 1). The dK product reads the image K-major
  (element (kv, q) at _sw128(kv, q)); the dQ product reads the same bytes MN-major as dS."""
  ds_t = np.random.default_rng(2).normal(size=(64, 64)).astype(np.float32)  # [kv][q]
  image = _stmatrix_image(ds_t, trans=False)
  got = np.array([[image[_sw128(kv, q)] for q in range(64)] for kv in range(64)])
  np.testing.assert_array_equal(got, ds_t)


def test_timing_plot_draws_from_saved_results(tmp_path):
  """benchmarks/cuda_backward_check.py --plot-from: the saved H100 timings drawn again without a
  GPU."""
  import sys
  from pathlib import Path
  root = Path(__file__).resolve().parents[1]
  sys.path.insert(0, str(root / "benchmarks"))
  import json

  import cuda_backward_check as check
  saved = root / "benchmarks/results/cuda_sm90/s18_bwd_16k_v0_v1_h100.json"
  result = json.loads(saved.read_text())
  assert {r["impl"] for r in result["timings"]} == {"mosaic", "cuda_v0", "cuda_v1", "cudnn"}
  check.plot(result, tmp_path / "t.png")
  assert (tmp_path / "t.png").stat().st_size > 10_000


def test_timing_names_the_mask_in_the_loop_variant(monkeypatch):
  """cuda_backward_check's NAME+in_loop (the mask pass's A/B): NAME's bits with MASK_IN_LOOP,
  registered in this process only; any other suffix is refused by name."""
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
  import cuda_backward_check as check
  monkeypatch.setattr(cuda_bwd, "VARIANTS", dict(cuda_bwd.VARIANTS))
  check.register_in_loop(["v7", "v7+in_loop"])
  assert cuda_bwd.VARIANTS["v7+in_loop"] == cuda_bwd.VARIANTS["v7"] | cuda_bwd.MASK_IN_LOOP
  assert set(cuda_bwd.VARIANTS) == {"v7", "v7+in_loop"}
  with pytest.raises(ValueError, match="v7\\+fast"):
    check.register_in_loop(["v7+fast"])


def test_fused_backward_registers_its_target_itself(monkeypatch):
  """The op loads the library (registering the FFI target) before it emits the call: a caller
  that never called load() (backend="hopper") must not meet "No FFI handler registered"."""
  import jax
  calls = []
  monkeypatch.setattr(cuda_bwd, "load", lambda *a: calls.append(a))
  z = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  f32 = jax.ShapeDtypeStruct((1, 4, 256), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  bounds = (jax.ShapeDtypeStruct((1, 2), jnp.int32),) * 4
  dq, dk, dv = jax.eval_shape(
      lambda *a: cuda_bwd.fused_backward(*a[:10], a[10:], scale=0.1, causal=True),
      z(1, 256, 4, 128), z(1, 256, 2, 128), z(1, 256, 2, 128), z(1, 256, 4, 128), f32, f32,
      ids, ids, ids, ids, *bounds)
  assert calls == [()]
  assert dq.shape == (1, 256, 4, 128) and dk.shape == dv.shape == (1, 256, 2, 128)
  # Sq != Skv: the shapes follow each side (the kernel indexes them apart)
  k512 = z(1, 512, 2, 128)
  kv_ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)
  bounds4 = (jax.ShapeDtypeStruct((1, 4), jnp.int32),) * 4
  dq, dk, dv = jax.eval_shape(
      lambda *a: cuda_bwd.fused_backward(*a[:10], a[10:], scale=0.1, causal=True),
      z(1, 256, 4, 128), k512, k512, z(1, 256, 4, 128), f32, f32, ids, ids, kv_ids, kv_ids,
      *bounds4)
  assert dq.shape == (1, 256, 4, 128) and dk.shape == dv.shape == (1, 512, 2, 128)


@pytest.fixture
def ffi_call(monkeypatch):
  """fused_backward's FFI calls recorded instead of run (no library needed): the dict gets the
  backward's inputs ("args") and attributes ("attrs"), and every call as (target, args, attrs,
  results) in "calls"; the results are zeros of their shapes."""
  import jax
  monkeypatch.setattr(cuda_bwd, "load", lambda *a: None)
  got = {"calls": []}

  def fake_ffi_call(target, results):
    def call(*args, **attrs):
      got["calls"].append((target, args, attrs, results))
      if target == cuda_bwd.TARGET:
        got.update(args=args, attrs=attrs)
      return tuple(jnp.zeros(r.shape, r.dtype) for r in results)
    return call
  monkeypatch.setattr(jax.ffi, "ffi_call", fake_ffi_call)
  return got


@pytest.mark.parametrize("head_dims,cta_rows", [((128, 128), 128), ((64, 64), 128),
                                                  ((256, 256), 64), ((192, 128), 64)])
def test_fused_backward_launch_order(ffi_call, monkeypatch, head_dims, cta_rows):
  """The `order` input: per batch row every (kv head, kv tile) pair of the kernel once (64-row
  tiles at head dims 256 and 192 / 128, two per table row), coded (head << 20) | tile. At head
  dim 128 without a window ("documents"): the tiles grouped by their last visited block, the
  groups by descending summed visited blocks; a group of more pairs than the GPU's wave (4 here)
  runs its tiles in tile order once per head, the heads one after another, a smaller one each
  tile's heads together. Head dim 64 without a window ("heads_fastest"): the tiles by
  descending visited blocks (ties in tile order), each tile's heads together. Head dims 256 and
  192 / 128, and any head dim with a window ("heads_slowest"): that tile order once per head."""
  monkeypatch.setattr(cuda_bwd, "gpu_wave", lambda: 4)
  d, dv_dim = head_dims
  b, s, h, kh = 2, 512, 4, 2
  x = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  ids = jnp.zeros((b, s), jnp.int32)
  lse = jnp.zeros((b, h, s), jnp.float32)
  # visited 64-row query blocks per 128-row kv tile (4 table rows): row 0 causal-like (one
  # document), row 1 three documents (tiles 0 | 1, 2 | 3 by their last visited block) whose
  # longest tile is not the first, with a tie between tiles 0 and 2
  lower = jnp.array([[0, 2, 4, 6], [0, 1, 2, 7]], jnp.int32)
  upper = jnp.array([[8, 8, 8, 8], [3, 5, 5, 8]], jnp.int32)
  per_table_row = 128 // cta_rows
  # row 0: one document of 8 pairs, head by head; row 1's documents: work 3 (tile 0), 7
  # (tiles 1, 2), 1 (tile 3), each of at most 4 pairs, so each tile's heads together
  documents = [[(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)],
               [(0, 1), (1, 1), (0, 2), (1, 2), (0, 0), (1, 0), (0, 3), (1, 3)]]
  longest = [[per_table_row * t + j for t in row for j in range(per_table_row)]
             for row in [[0, 1, 2, 3], [1, 0, 2, 3]]]  # row 1: counts 3, 4, 3, 1
  heads_slowest = [[(k, t) for k in range(kh) for t in row] for row in longest]
  heads_fastest = [[(k, t) for t in row for k in range(kh)] for row in longest]
  for window in (0, 100):
    cuda_bwd.fused_backward(x(b, s, h, d), x(b, s, kh, d), x(b, s, kh, dv_dim),
                            x(b, s, h, dv_dim), lse, lse, ids, ids, ids, ids,
                            (lower, upper, lower, lower), scale=0.1, causal=True, window=window)
    order = np.asarray(ffi_call["args"][-1])  # the handler's last input
    assert order.dtype == np.int32 and order.shape == (b, kh * s // cta_rows)
    pairs = [list(zip((row >> 20).tolist(), (row & (2**20 - 1)).tolist())) for row in order]
    expected = (documents if d == 128 and not window else
                heads_fastest if d == 64 and not window else heads_slowest)
    assert pairs == expected, (d, window)


@pytest.mark.parametrize("layout", cuda_bwd.LAYOUTS)
def test_launch_order_runs_every_pair_once(layout):
  """Each layout's order is, per batch row, a permutation of every (kv head, kv tile) pair, on
  random tables (documents of random lengths, empty tiles, tiles visiting nothing), for waves
  that put every document, some or none head by head."""
  rng = np.random.default_rng(7)
  b, n_tiles, kv_heads = 3, 24, 5
  lower = rng.integers(0, 30, (b, n_tiles))
  upper = np.where(rng.random((b, n_tiles)) < 0.2, lower, lower + rng.integers(0, 20, (b, n_tiles)))
  bounds = (jnp.asarray(lower, jnp.int32), jnp.asarray(upper, jnp.int32))
  for wave in (1, 12, 10**6):
    order = np.asarray(cuda_bwd.launch_order(bounds, n_tiles, kv_heads, layout, wave=wave))
    assert order.shape == (b, kv_heads * n_tiles)
    everything = sorted((k << 20) | t for k in range(kv_heads) for t in range(n_tiles))
    for row in order:
      assert sorted(row.tolist()) == everything


def test_gpu_wave_is_the_first_gpus_core_count(monkeypatch):
  """The "documents" layout's wave: the first GPU's SM count (the device's core_count), 132 (an
  H100 / H200's) where no GPU or no count is reported."""
  import types
  import jax
  gpu = lambda **kw: types.SimpleNamespace(platform="gpu", **kw)
  cpu = types.SimpleNamespace(platform="cpu", core_count=4)
  for devices, expected in (([cpu, gpu(core_count=114)], 114), ([gpu()], 132), ([cpu], 132),
                            ([gpu(core_count=0)], 132)):
    monkeypatch.setattr(jax, "local_devices", lambda devices=devices: devices)
    assert cuda_bwd.gpu_wave() == expected, devices


def test_launch_order_refuses_what_its_code_cannot_hold():
  bounds = (jnp.zeros((1, 4), jnp.int32),) * 2
  with pytest.raises(ValueError, match="layout='sideways'"):
    cuda_bwd.launch_order(bounds, 4, 2, "sideways")
  with pytest.raises(ValueError, match="2048 kv heads"):
    cuda_bwd.launch_order(bounds, 4, 4096, "heads_slowest")


@pytest.mark.parametrize("scale, soft_cap, head_dim, in_loop", [
    (0.1, 0.0, 128, False),    # the mask as a pass of its own (dropped logits -inf)
    (-0.1, 0.0, 128, True),    # -inf times a negative scale would be +inf
    (0.0, 0.0, 64, True),      # ... times 0, NaN
    (float("nan"), 0.0, 128, True),
    (-0.1, 3.0, 128, False),   # the soft cap's kernels mask in their loop anyway (no such bit)
    (-0.1, 0.0, 256, False),   # head dim 256's layout masks in its loop (no such bit)
    (-0.1, 0.0, (192, 128), False),  # so does MLA's
])
def test_fused_backward_masks_in_the_loop_when_the_scale_is_not_positive(
    ffi_call, scale, soft_cap, head_dim, in_loop):
  """The kernel's mask pass sets dropped logits to -inf before they are scaled, which holds only
  for a scale > 0: for any other the JAX side asks for the kernels that mask in their loop."""
  x = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  ids, lse = jnp.zeros((1, 256), jnp.int32), jnp.zeros((1, 4, 256), jnp.float32)
  bounds = (jnp.zeros((1, 2), jnp.int32),) * 4
  d, dv = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
  cuda_bwd.fused_backward(x(1, 256, 4, d), x(1, 256, 2, d), x(1, 256, 2, dv),
                          x(1, 256, 4, dv), lse, lse, ids, ids, ids, ids, bounds,
                          scale=scale, causal=True, soft_cap=soft_cap)
  variant = int(ffi_call["attrs"]["variant"])
  assert bool(variant & cuda_bwd.MASK_IN_LOOP) == in_loop
  assert bool(variant & cuda_bwd.SOFTCAP) == bool(soft_cap)


@pytest.mark.parametrize("head_dims", [(128, 128), (64, 64), (256, 256), (192, 128)])
def test_fused_backward_converts_dq_on_the_gpu(ffi_call, head_dims):
  """dq comes from the library's second target: the backward's dq_accum and the lse it was given
  (+inf on the rows to zero), the scale, and the staging order (FRAG at head dims 64 / 128, which
  every built variant stages in; the vector order in the wide kernels), into q's shape and type."""
  d, dv = head_dims
  x = lambda *shape: jnp.zeros(shape, jnp.float16)
  ids = jnp.zeros((1, 256), jnp.int32)
  lse = jnp.full((1, 4, 256), jnp.inf, jnp.float32).at[:, :, :100].set(1.0)
  bounds = (jnp.zeros((1, 2), jnp.int32),) * 4
  dq, _, _ = cuda_bwd.fused_backward(x(1, 256, 4, d), x(1, 256, 2, d), x(1, 256, 2, dv),
                                     x(1, 256, 4, dv), lse, lse, ids, ids, ids, ids, bounds,
                                     scale=0.25, causal=True)
  (t0, *_, backward_results), (t1, args, attrs, results) = ffi_call["calls"]
  assert (t0, t1) == (cuda_bwd.TARGET, cuda_bwd.DQ_TARGET)
  assert args[0].shape == backward_results[2].shape == (1, 4, d // 64, 256 // 64, 4096)
  np.testing.assert_array_equal(args[1], lse)
  assert float(attrs["scale"]) == 0.25
  assert int(attrs["vector_order"]) == (d not in cuda_bwd.MAIN_LAYOUT_HEAD_DIMS)
  assert results[0].shape == dq.shape == (1, 256, 4, d) and dq.dtype == jnp.float16
  assert all(bits & cuda_bwd.FRAG for bits in cuda_bwd.VARIANTS.values())


def test_dq_conversion_kernel_reads_the_staging_orders():
  """dq_from_accum_kernel's index arithmetic, as written in fused_backward.cu, against the
  staging orders' definitions (unpermute_fragment_order, unpermute_vector_order): thread i of a
  (batch, head, block) CTA writes row (i / 8) % 64, columns 8 (i % 8) .. + 7 of part i / 512,
  from these accumulator offsets."""
  from pathlib import Path
  src = (Path(cuda_bwd.__file__).parent / "fused_backward.cu").read_text()
  frag = "src + (((g * 2 + a1) * 4 + a2) * 8 + a3) * 8"
  vector = "src + ((((g * 4 + c1) * 8 + c2) * 4 + c3) * 2 + c4) * 2"
  assert frag in src and vector in src
  assert "const int part = i / 512, g = i % 8, row = (i / 8) % 64;" in src
  accum = np.arange(4096, dtype=np.float32)
  for order, unpermute in ((frag, cuda_bwd.unpermute_fragment_order),
                           (vector, cuda_bwd.unpermute_vector_order)):
    want = np.asarray(unpermute(jnp.asarray(accum)))
    got = np.full((64, 64), -1.0, np.float32)
    for i in range(512):
      g, row = i % 8, (i // 8) % 64
      if order is frag:
        a2, a1, a3 = row // 16, (row // 8) % 2, row % 8
        got[row, 8 * g:8 * g + 8] = accum[(((g * 2 + a1) * 4 + a2) * 8 + a3) * 8 + np.arange(8)]
      else:
        c1, c4, c2 = row // 16, (row // 8) % 2, row % 8
        for c3 in range(4):
          off = ((((g * 4 + c1) * 8 + c2) * 4 + c3) * 2 + c4) * 2
          got[row, 8 * g + 2 * c3:8 * g + 2 * c3 + 2] = accum[off:off + 2]
    np.testing.assert_array_equal(got, want)


# --- DECOUPLE (v7): the consumers' dS hand-over, simulated -------------------------------------
# The kernel's order of named-barrier operations and dS buffer accesses per consumer, as written
# in fused_backward.cu (the step loop, dq_part and the tail). A named barrier completes when 256
# threads (both consumers' 128) have arrived; a consumer that arrives twice in one generation
# would complete it alone (a race on the GPU), so the simulation treats that as an error.
BAR_DS_FULL, BAR_DS_FREE = 4, 8


def _consumer_ops(c: int, steps: int, skip_free_sync: bool = False):
  """The events of consumer c: ("sync" | "arrive", barrier), ("write", buffer, step),
  ("read_begin" | "read_end", buffer, step): the dQ wgmmas read both halves of a buffer from
  their issue to their wait; ("loaded", step): waits for the producer's ring slot;
  ("release", step): the slot handed back (after the wait that retires the step's products)."""
  def dq_part(m, release):
    bm = m % 2
    yield ("sync", BAR_DS_FULL + 2 * bm + c)
    yield ("read_begin", bm, m)
    yield ("read_end", bm, m)  # wg_wait<0>
    if release is not None:
      yield ("release", release)
    if m + 2 < steps:
      yield ("arrive", BAR_DS_FREE + 2 * bm + (1 - c))

  for n in range(steps):
    yield ("loaded", n)
    buf = n % 2
    if n >= 2 and not skip_free_sync:
      yield ("sync", BAR_DS_FREE + 2 * buf + c)
    yield ("write", buf, n)
    yield ("arrive", BAR_DS_FULL + 2 * buf + (1 - c))
    if n >= 1:
      yield from dq_part(n - 1, release=n)
    else:
      yield ("release", 0)
  if steps > 0:
    yield from dq_part(steps - 1, release=None)


def _run_consumers(ops: list, rng, buffer_event, trace: list | None = None) -> str | None:
  """Run the two consumers' event lists and the producer's (ops[2], a ring of 2: it loads step n
  once both consumers released step n - 2) in a random interleaving. Barrier, load and release
  events are handled here; every other event goes to buffer_event(consumer, op), which returns
  a problem or None. Returns the first problem found (a deadlock, a barrier a consumer passes
  alone, a barrier left mid-generation, a slot not released once per consumer), or None
  (trace: gets (actor, event) in the order they ran)."""
  pc = [0, 0, 0]
  loaded, released = set(), {}
  arrived: dict[int, set] = {}   # barrier -> consumers arrived in the current generation
  waiting: dict[int, int] = {}   # consumer -> barrier it is blocked on
  steps = len(ops[2])

  def ready(a):
    if pc[a] >= len(ops[a]) or a in waiting:
      return False
    op = ops[a][pc[a]]
    if op[0] == "loaded":
      return op[1] in loaded
    if op[0] == "load":
      return op[1] < 2 or released.get(op[1] - 2, 0) == 2
    return True

  while any(pc[a] < len(ops[a]) for a in range(3)):
    runnable = [a for a in range(3) if ready(a)]
    if not runnable:
      return f"deadlock at {[ops[a][pc[a]] if pc[a] < len(ops[a]) else 'end' for a in range(3)]}"
    c = runnable[rng.integers(len(runnable))]
    op = ops[c][pc[c]]
    pc[c] += 1
    if trace is not None:
      trace.append((c, op))
    if op[0] in ("load", "loaded"):
      loaded.add(op[1])
    elif op[0] == "release":
      released[op[1]] = released.get(op[1], 0) + 1
    elif op[0] in ("sync", "arrive"):
      got = arrived.setdefault(op[1], set())
      if c in got:
        return f"consumer {c} arrives twice at barrier {op[1]} in one generation"
      got.add(c)
      if len(got) == 2:  # generation complete: release the waiter
        arrived[op[1]] = set()
        for w, bar in list(waiting.items()):
          if bar == op[1]:
            del waiting[w]
      elif op[0] == "sync":
        waiting[c] = op[1]
    else:
      problem = buffer_event(c, op)
      if problem:
        return problem
  if any(arrived.values()):
    return f"barriers left mid-generation at exit: {arrived}"
  if any(released.get(n, 0) != 2 for n in range(steps)):
    return f"ring slots not released exactly once per consumer: {released}"
  return None


def _simulate(steps: int, rng, trace: list | None = None, **kw) -> str | None:
  """Head dim 128's dS hand-over (two buffers by step parity, each consumer writing its half)
  under _run_consumers: the first problem found, or None."""
  ops = [list(_consumer_ops(c, steps, **kw)) for c in (0, 1)] + [
      [("load", n) for n in range(steps)]]
  half = {}         # (buffer, consumer) -> step whose dS that half holds
  reads_left = {}   # (buffer, step) -> consumers that still have to read it

  def buffer_event(c, op):
    if op[0] == "write":
      _, buf, n = op
      if reads_left.get((buf, n - 2)):
        return f"consumer {c} overwrites buffer {buf} at step {n} before step {n - 2} is read"
      half[(buf, c)] = n
      reads_left[(buf, n)] = {0, 1}
    elif op[0] == "read_begin":
      _, buf, m = op
      if half.get((buf, 0)) != m or half.get((buf, 1)) != m:
        return f"consumer {c} reads buffer {buf} for step {m}: halves hold {half}"
    else:
      _, buf, m = op
      reads_left[(buf, m)].discard(c)
    return None

  return _run_consumers(ops, rng, buffer_event, trace)


def test_decoupled_ds_hand_over_has_no_race_or_deadlock():
  assert cuda_bwd.VARIANTS["v7"] & cuda_bwd.DECOUPLE
  rng = np.random.default_rng(7)
  for steps in range(0, 7):
    for _ in range(150):
      problem = _simulate(steps, rng)
      assert problem is None, f"steps={steps}: {problem}"


def test_decoupled_consumers_drift_apart():
  """What DECOUPLE is for: some interleavings have one consumer a step ahead (its dS of step
  n + 1 written before the other wrote step n's)."""
  rng = np.random.default_rng(9)
  ahead = 0
  for _ in range(100):
    trace = []
    assert _simulate(4, rng, trace=trace) is None
    written = [(c, op[2]) for c, op in trace if op[0] == "write"]
    ahead += any(n1 > n0 for i, (c0, n0) in enumerate(written) for c1, n1 in written[i + 1:]
                 if c1 != c0)
  assert ahead > 0


def test_the_hand_over_simulation_catches_a_missing_barrier():
  rng = np.random.default_rng(8)
  found = [_simulate(5, rng, skip_free_sync=True) for _ in range(200)]
  assert any(f and "overwrites buffer" in f for f in found)


def test_snake_walk_counters_follow_the_producers_blocks():
  """SNAKE (every kernel without a window or the mask in the loop): the producer loads step n's
  block by snake_block (the odd heads of the group walked downwards); the lean step's consumers
  count (step_head, step_qb, step_dir) along, the other kernels' consumers call snake_block with
  the producer's SNAKE. Both orders, as written in fused_backward.cu, visit the same blocks, each
  head's range once."""
  import re
  from pathlib import Path
  src = (Path(cuda_bwd.__file__).parent / "fused_backward.cu").read_text()
  assert "SNAKE && (n / steps_per_head) % 2 ? lo + steps_per_head - 1 - r : lo + r" in src
  assert "if (step_qb == (step_dir > 0 ? hi - 1 : lo)) {" in src
  assert "constexpr bool SNAKE = !WIN && !(F & MASK_IN_LOOP);" in src
  # Each kernel (the main one, head dim 256's, MLA's) hands its SNAKE to the producer and walks
  # the same blocks in its consumers; no consumer computes a block without snake_block.
  kernels = re.split(r"\n(?=template <int F, bool HALF)", src)
  walking = [k for k in kernels if "produce<" in k]
  assert len(walking) == 3
  for k in walking:
    assert re.search(r"produce<[^>]*, SNAKE(, [^>]*)?>\(", k), k[:200]
    assert "snake_block<SNAKE>(n, lo, steps_per_head)" in k
    assert "lo + n % steps_per_head" not in k
  for lo, hi, group in [(0, 1, 4), (3, 7, 4), (0, 5, 1), (2, 4, 8)]:
    spb = hi - lo
    producer = []
    for n in range(spb * group):
      r, j = n % spb, n // spb
      producer.append((j, lo + spb - 1 - r if j % 2 else lo + r))
    head, qb, step_dir, consumer = 0, lo, 1, []
    for _ in range(spb * group):
      consumer.append((head, qb))
      if qb == (hi - 1 if step_dir > 0 else lo):
        step_dir, head = -step_dir, head + 1
      else:
        qb += step_dir
    assert consumer == producer, (lo, hi, group)
    for j in range(group):
      assert sorted(b for h, b in producer if h == j) == list(range(lo, hi))

# --- Head dim 256: the consumers' P^T / dS^T hand-over, simulated ------------------------------
# backward_d256_kernel's order of named-barrier operations and buffer accesses per consumer, as
# written in fused_backward.cu: consumer 0 writes P^T (one buffer) and reads dS^T, consumer 1
# reads P^T and writes dS^T (one buffer), both read dS^T in their dK / dQ products. Barriers as
# above: complete when both consumers have arrived once.
D256_P_FULL, D256_P_FREE, D256_DS_FULL, D256_DS_FREE = 4, 5, 6, 7
D256_READERS = {"PT": {1}, "DS": {0, 1}}


def _d256_ops(c: int, steps: int, drop: tuple = ()):
  """The events of consumer c at head dim 256. drop: barrier pairs (one consumer's arrive and the
  other's sync) to leave out: "p_full", "p_free", "ds_full", "ds_free"."""
  for n in range(steps):
    yield ("loaded", n)
    if c == 0:
      if n >= 1 and "p_free" not in drop:
        yield ("sync", D256_P_FREE)
      yield ("write", "PT", n)
      if "p_full" not in drop:
        yield ("arrive", D256_P_FULL)
      if "ds_full" not in drop:
        yield ("sync", D256_DS_FULL)
    else:
      if "p_full" not in drop:
        yield ("sync", D256_P_FULL)
      yield ("read_begin", "PT", n)
      yield ("read_end", "PT", n)
      if n + 1 < steps and "p_free" not in drop:
        yield ("arrive", D256_P_FREE)
      if n >= 1 and "ds_free" not in drop:
        yield ("sync", D256_DS_FREE)
      yield ("write", "DS", n)
      if "ds_full" not in drop:
        yield ("arrive", D256_DS_FULL)
    yield ("read_begin", "DS", n)  # dK, then both dQ parts
    yield ("release", n)           # wg_wait<1>: dV, dK and the first dQ part retired
    yield ("read_end", "DS", n)    # wg_wait<0>
    if c == 0 and n + 1 < steps and "ds_free" not in drop:
      yield ("arrive", D256_DS_FREE)


def _simulate_d256(steps: int, rng, **kw) -> str | None:
  """Head dim 256's P^T / dS^T hand-over (one buffer each) under _run_consumers: the first
  problem found (besides the scheduler's: a buffer overwritten before its readers are done,
  or read holding another step), or None."""
  ops = [list(_d256_ops(c, steps, **kw)) for c in (0, 1)] + [[("load", n) for n in range(steps)]]
  holds: dict[str, int] = {}   # buffer -> the step whose data it holds
  unread: dict[str, set] = {}  # buffer -> readers still to finish with it

  def buffer_event(c, op):
    _, buf, n = op
    if op[0] == "write":
      if unread.get(buf):
        return f"consumer {c} overwrites {buf} with step {n} before {unread[buf]} read step {holds[buf]}"
      holds[buf], unread[buf] = n, set(D256_READERS[buf])
    elif op[0] == "read_begin":
      if holds.get(buf) != n:
        return f"consumer {c} reads {buf} for step {n}; it holds step {holds.get(buf)}"
    else:
      unread[buf].discard(c)
    return None

  return _run_consumers(ops, rng, buffer_event)


def test_head_dim_256_hand_over_has_no_race_or_deadlock():
  rng = np.random.default_rng(11)
  for steps in range(0, 7):
    for _ in range(150):
      problem = _simulate_d256(steps, rng)
      assert problem is None, f"steps={steps}: {problem}"


@pytest.mark.parametrize("drop, found", [("p_full", "reads PT"), ("ds_full", "reads DS")])
def test_the_head_dim_256_simulation_catches_a_missing_barrier(drop, found):
  rng = np.random.default_rng(12)
  problems = [_simulate_d256(5, rng, drop=(drop,)) for _ in range(300)]
  assert any(p and found in p for p in problems), set(problems)


def test_head_dim_256_free_barriers_are_implied_by_the_full_ones():
  """This simulation shows that P_FREE and DS_FREE order nothing the FULL pair does not.
  Consumer 0 writes P^T of step n + 1 only after DS_FULL of step n, which consumer 1 passes
  after reading P^T of step n; consumer 1 writes dS^T of step n + 1 only after P_FULL of step
  n + 1, which consumer 0 passes after its products of step n retired. The kernel keeps them
  until a GPU run checks the version without (a candidate for two fewer barriers per step)."""
  rng = np.random.default_rng(13)
  for steps in range(0, 6):
    for _ in range(100):
      assert _simulate_d256(steps, rng, drop=("p_free", "ds_free")) is None


def test_a_library_path_is_loaded_as_an_absolute_path(tmp_path, monkeypatch):
  """load(path) with a bare file name: dlopen would search the library path for it, not the
  working directory."""
  import ctypes
  (tmp_path / "x.so").write_bytes(b"")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(cuda_bwd, "_LOADED", [])
  seen = []

  def fake_load(name):
    seen.append(name)
    raise OSError("stop here")
  monkeypatch.setattr(ctypes.cdll, "LoadLibrary", fake_load)
  with pytest.raises(OSError, match="stop here"):
    cuda_bwd.load("x.so")
  assert seen == [str(tmp_path / "x.so")]


def test_a_library_from_another_source_is_refused(tmp_path):
  class Lib:  # what ctypes gives for a library with / without the version symbol
    def __init__(self, version):
      if version is not None:
        self.KvaxSm90AbiVersion = lambda: version
  cuda_bwd.check_abi(Lib(cuda_bwd.ABI_VERSION), tmp_path / "lib.so")
  for stale in (None, cuda_bwd.ABI_VERSION - 1):
    with pytest.raises(RuntimeError, match=r"built from another fused_backward.cu .*rebuild"):
      cuda_bwd.check_abi(Lib(stale), tmp_path / "lib.so")


# --- the builder's command line and report (the cache, the lock and the toolchain message:
# tests/test_cuda_sm90_build.py) -----------------------------------------------------------------
def test_builder_command_and_report():
  from pathlib import Path
  from kvax_plugin.attention.kernels.cuda_sm90 import build
  cmd = build.nvcc_command(Path("/x/nvcc"), build.SOURCE, build.OUTPUT, "/inc")
  assert cmd[0] == "/x/nvcc" and "arch=compute_90a,code=sm_90a" in cmd
  assert cmd[cmd.index("-cudart") + 1] == "static" and "-I/inc" in cmd
  assert cmd[-3:] == [str(build.SOURCE), "-o", str(build.OUTPUT)]
  assert build.SOURCE.exists() and build.OUTPUT == cuda_bwd.PREBUILT
  keep = lambda line: build._keep(line, build.SOURCE)
  assert keep("ptxas info    : Used 168 registers, used 16 barriers")
  assert keep("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
  assert keep("fused_backward.cu(12): warning #177-D: variable declared but never referenced")
  assert keep("x.cu(1): error: expected an expression")
  assert not keep("  __attribute__((always_inline)) typename ErrorPolicy::Status VerifyBuffer(")
  assert not keep("                 ^")


def test_the_kernel_source_and_the_jax_side_agree():
  """fused_backward.cu's feature bits, the variants its handler launches and its interface
  version are what fused_backward.py passes (read from the source, no nvcc needed). A variant
  named in VARIANTS but not built fails only on a GPU, with 'not one of the feature sets'."""
  import re
  from kvax_plugin.attention.kernels.cuda_sm90 import build
  src = build.SOURCE.read_text()
  bits = {k: int(v) for k, v in re.findall(
      r"\b(STM|FRAG|EXP|DECOUPLE_BIT|MASK_IN_LOOP|SOFTCAP|WINDOW) = (\d+)", src)}
  py = {"STM": cuda_bwd.STM, "FRAG": cuda_bwd.FRAG, "EXP": cuda_bwd.EXP,
        "DECOUPLE_BIT": cuda_bwd.DECOUPLE, "MASK_IN_LOOP": cuda_bwd.MASK_IN_LOOP,
        "SOFTCAP": cuda_bwd.SOFTCAP,
        "WINDOW": cuda_bwd.WINDOW}
  assert bits == py
  for name in ("KVAX_SM90_V7", "KVAX_SM90_V7_WIDE"):
    bits[name] = eval(re.search(rf"#define {name} (\(.*?\))\n", src).group(1), {}, bits)

  def built(name):
    text = re.search(rf"#define {name}\s*\\\n(.*?)\n(?:\n|#)", src, re.S).group(1)
    return {eval(term.replace("\\", "").strip(), {}, bits) for term in text.split(",")}

  # the default variant alone, with each combination of the attention features, and with the
  # mask in the loop alone and with the window (head dims 128 and 64); the head dim 256 and MLA
  # kernels without DECOUPLE or MASK_IN_LOOP (what fused_backward passes there)
  default = cuda_bwd.VARIANTS[cuda_bwd.DEFAULT_VARIANT]
  assert set(cuda_bwd.VARIANTS.values()) == {default}
  extras = (0, cuda_bwd.SOFTCAP, cuda_bwd.WINDOW, cuda_bwd.SOFTCAP | cuda_bwd.WINDOW)
  in_loop = (cuda_bwd.MASK_IN_LOOP, cuda_bwd.MASK_IN_LOOP | cuda_bwd.WINDOW)
  assert built("KVAX_SM90_VARIANTS") == {default | extra for extra in extras + in_loop}
  assert built("KVAX_SM90_VARIANTS_WIDE") == {(default & ~cuda_bwd.DECOUPLE) | extra
                                             for extra in extras}
  version = re.search(r"KvaxSm90AbiVersion\(\) \{ return (\d+); \}", src).group(1)
  assert int(version) == cuda_bwd.ABI_VERSION


def test_head_dim_256_soft_cap_derivative_from_p_and_lse():
  """backward_d256_kernel's consumer 1 has P = 2^(tanh(y) c' - lse log2 e) (c' = cap log2 e) but
  not the logit: it takes tanh back as (log2 P + lse log2 e) / c' and the cap's derivative as
  1 - tanh^2 (0 where P is 0). In float32 over the range P takes, against the exact
  derivative: dS's factor moves by far less than bf16's rounding of dS (2^-9)."""
  rng = np.random.default_rng(4)
  for cap in (3.0, 30.0, 50.0):
    c = np.float32(cap * np.log2(np.e))
    th = np.tanh(rng.uniform(-3, 3, 100_000)).astype(np.float32)
    # lse at or above the row's largest capped logit; P from 1 down to underflow
    lse = (th.astype(np.float64) * cap + rng.uniform(0, 60, th.size)).astype(np.float32)
    p = np.exp2(th * c - lse * np.float32(np.log2(np.e)))
    kept = p > 0
    th_back = (np.log2(p[kept]) + lse[kept] * np.float32(np.log2(np.e))) / c
    got = 1 - th_back * th_back
    want = 1 - th[kept].astype(np.float64) ** 2
    assert kept.mean() > 0.5
    assert np.max(np.abs(got - want) * p[kept]) < 2**-9 * 1e-2, cap

