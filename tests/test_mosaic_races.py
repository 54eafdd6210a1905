"""The Mosaic GPU kernels under Pallas' interpreter race detector (CPU).

`InterpretGPUParams(detect_races=True)` keeps a vector clock per warpgroup (and per TMA copy)
and prints "RACE DETECTED" for any two accesses to one buffer, one a write, that no barrier
orders. How it models what the kernels rely on (jax 0.11.2, interpret/gpu_callbacks.py and
shared_memory.py; each point is shown by a small ring kernel below):

1. A barrier joins the clocks of ALL its arrivals (Barrier.arrive), and a wait acquires them.
   A `free` barrier with 2 arrivals (one per consumer) orders both consumers' reads before the
   producer's next write into the slot (`test_ring_orders_both_arrivals`).
2. A TMA copy's write into shared memory is checked against the issuing thread's *async-proxy*
   clock, which only commit_smem (a proxy fence on the GPU) advances; a barrier wait does not.
   So every refill of a ring slot after its `free` wait is reported against the consumers'
   reads of the slot's previous block, with 1 arrival as with 2 (`test_ring_reuse_artefact`).
   On the GPU the reads complete before the consumers' arrive (release), the producer's wait
   acquires them and only then issues the copy: no fence is needed for that write-after-read
   (CUTLASS's TMA pipelines and Pallas' own emit_pipeline_warp_specialized refill the same way).
   The kernels commit after each `free` wait in interpreter mode only (`released_for_tma`,
   kernels/mosaic/forward.py), which keeps a real early release visible.
3. wgmma's shared-memory operand reads are not checked at all (gpu_callbacks.wgmma has no
   vector clocks), so a slot released before the product that reads it goes unreported
   (`test_ring_wgmma_reads`). Here `plgpu.wgmma` is wrapped so that its shared-memory operands
   are also read where it is issued (the kernels are unchanged; the interpreter runs wgmma
   synchronously there), which makes those reads visible.

With that, any report on the kernels is a real race, such as the fused backward's K buffer
staged with dK while the other consumer's last dQ product could still read it (the `k_done`
barrier orders the two); a K slot of the forward released before its Q K^T product is reported
too. The kernel cases have more blocks than ring slots, so every ring wraps around.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

import jax.experimental.pallas as pl  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402

import race_reports  # noqa: E402
import test_mosaic_interpret as kernels_in_interpreter  # noqa: E402

_WGMMA = kernels_in_interpreter._WGMMA  # plgpu.wgmma itself
_wgmma_with_visible_reads = kernels_in_interpreter._wgmma_with_visible_reads  # point 3


@pytest.fixture
def race_detector(monkeypatch):
  """Interpreted kernels run with the race detector on and wgmma reads visible."""
  monkeypatch.setattr(plgpu, "InterpretGPUParams", race_reports.detector_params())
  monkeypatch.setattr(plgpu, "wgmma", _wgmma_with_visible_reads)


# --- a minimal ring: 1 producer, `consumers` consumers, a `free` barrier of one arrival each ---

STAGES, BLOCKS, TILE = 2, 5, 64  # 5 blocks through 2 slots: 3 refills


def _tile_smem(shape):
  """bf16 shared memory in the (8, 64)-tiled, 128-byte swizzled layout wgmma reads."""
  return plgpu.SMEM(shape, jnp.bfloat16, transforms=(plgpu.TilingTransform((8, 64)),
                                                      plgpu.SwizzleTransform(128)))


def _ring(x, a, *, consumers=2, fill="tma", read="load", commit=False, early_release=False):
  """Each consumer c computes sum_n a @ x[n], the x[n] streamed through a STAGES-slot ring.

  x: [BLOCKS, 64, 64] bf16, a: [64, 64] bf16 -> [consumers, 64, 64] float32, and the detector's
  printed output. fill: the producer's write into a slot, "tma" (copy_gmem_to_smem) or "store"
  (a plain store, then an arrive on `ready`); read: the consumers' read of the slot, "load" (a
  plain load and jnp.dot, as the kernels' interpreter products) or "wgmma"; commit: the
  producer's commit_smem after each `free` wait (kernels: released_for_tma); early_release: the
  consumers arrive on `free` BEFORE reading the slot (a real race on the GPU).
  """

  def body(x_ref, a_ref, out_ref, ring, a_smem, out_smem, ready, free, a_ready):
    wg = lax.axis_index("wg")

    @pl.when(wg == consumers)
    def producer():
      @pl.loop(0, BLOCKS)
      def _(n):
        slot = lax.rem(n, STAGES)

        @pl.when(n >= STAGES)
        def _():
          plgpu.barrier_wait(free.at[slot])
          if commit:
            plgpu.commit_smem()
        if fill == "tma":
          plgpu.copy_gmem_to_smem(x_ref.at[n], ring.at[slot], ready.at[slot])
        else:
          ring.at[slot][...] = x_ref.at[n][...]
          plgpu.barrier_arrive(ready.at[slot])

      @pl.loop(BLOCKS - STAGES, BLOCKS)  # observe the last releases too
      def _(n):
        plgpu.barrier_wait(free.at[lax.rem(n, STAGES)])

    @pl.when(wg < consumers)
    def consumer():
      my_a = a_smem.at[wg]
      plgpu.copy_gmem_to_smem(a_ref, my_a, a_ready.at[wg])
      plgpu.barrier_wait(a_ready.at[wg])

      def step(n, acc):
        slot = lax.rem(n, STAGES)
        plgpu.barrier_wait(ready.at[slot])
        if early_release:
          plgpu.barrier_arrive(free.at[slot])
        if read == "load":
          acc = acc + jnp.dot(my_a[...], ring.at[slot][...], preferred_element_type=jnp.float32)
        else:
          def product(ref):
            plgpu.wgmma(ref, my_a, ring.at[slot])
            return ref[...]
          acc = acc + pl.run_scoped(product, plgpu.ACC((TILE, TILE), jnp.float32))
        if not early_release:
          plgpu.barrier_arrive(free.at[slot])
        return acc

      zeros = plgpu.layout_cast(jnp.zeros((TILE, TILE), jnp.float32), plgpu.Layout.WGMMA)
      out_smem.at[wg][...] = lax.fori_loop(0, BLOCKS, step, zeros)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[wg], out_ref.at[wg])
      plgpu.wait_smem_to_gmem(0)

  def entry(x_ref, a_ref, out_ref):
    pl.run_scoped(lambda *s: body(x_ref, a_ref, out_ref, *s),
                  _tile_smem((STAGES, TILE, TILE)), _tile_smem((consumers, TILE, TILE)),
                  plgpu.SMEM((consumers, TILE, TILE), jnp.float32),
                  plgpu.Barrier(num_barriers=STAGES),
                  plgpu.Barrier(num_arrivals=consumers, num_barriers=STAGES),
                  plgpu.Barrier(num_barriers=consumers),
                  collective_axes="wg")

  with race_reports.captured_reports() as printed:
    out = plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((consumers, TILE, TILE), jnp.float32),
                       num_threads=consumers + 1, thread_name="wg",
                       interpret=plgpu.InterpretGPUParams())(x, a)
    out = jax.block_until_ready(out)
  return out, printed.getvalue()


def _ring_reports(**kwargs) -> int:
  """Race reports of one _ring run. Its result must match the reference unless the consumers
  release early: that race is real, and the interpreter's threads may then read a slot
  already refilled (the detector reports it however the threads happened to run)."""
  keys = jax.random.split(jax.random.PRNGKey(14), 2)
  x = jax.random.normal(keys[0], (BLOCKS, TILE, TILE), jnp.bfloat16)
  a = jax.random.normal(keys[1], (TILE, TILE), jnp.bfloat16)
  out, printed = _ring(x, a, **kwargs)
  f32 = lambda t: np.asarray(t, np.float32)
  want = sum(f32(a) @ f32(x[n]) for n in range(BLOCKS))
  if not kwargs.get("early_release"):
    np.testing.assert_allclose(f32(out), np.broadcast_to(want, out.shape), rtol=1e-5, atol=1e-3)
  return printed.count("RACE DETECTED")


def test_ring_orders_both_arrivals(race_detector):
  """Point 1: with plain stores into the slots, the 2-arrival `free` barrier orders BOTH
  consumers' reads before the refill (the detector does not keep only the last arrival);
  releasing before the read is reported."""
  assert _ring_reports(fill="store") == 0
  assert _ring_reports(fill="store", early_release=True) > 0


@pytest.mark.parametrize("consumers", [1, 2])
def test_ring_reuse_artefact(race_detector, consumers):
  """Point 2: a TMA refill after the `free` wait is reported against the previous block's
  reads, one report per refill, however many arrivals the barrier has; after a commit it is
  not, and a real early release still is."""
  assert _ring_reports(consumers=consumers) == BLOCKS - STAGES
  assert _ring_reports(consumers=consumers, commit=True) == 0
  assert _ring_reports(consumers=consumers, commit=True, early_release=True) > 0


def test_ring_wgmma_reads(race_detector, monkeypatch):
  """Point 3: a slot read by wgmma and released before the product is unreported by the
  detector alone, and reported with wgmma's operand reads made visible."""
  assert _ring_reports(read="wgmma", commit=True) == 0
  assert _ring_reports(read="wgmma", commit=True, early_release=True) > 0
  monkeypatch.setattr(plgpu, "wgmma", _WGMMA)
  assert _ring_reports(read="wgmma", commit=True, early_release=True) == 0


# The kernels' runs: every interpreter run of tests/test_mosaic_interpret.py has the race
# detector on (test_mosaic_interpret.race_detection: this fixture's setting) and is memoised, so
# the tests below read the run their case names (made here if this file runs alone).

@pytest.mark.parametrize("name", ["window_masked_full_masked_det", "docs_padding_gqa"])
def test_kernels_have_no_race_in_the_interpreter(name):
  """The forward and the deterministic backward (dk/dv and dq kernels; K/V and q/dO rings
  wrap), and the forward and the fused backward (column-split dq, shared dS, the K buffer
  reused for dK): no race reported, and the results still match the float32 reference."""
  kernels_in_interpreter.check_case(name)  # asserts no "RACE DETECTED" in the run's output


def test_persistent_forward_has_no_race_in_the_interpreter():
  """The persistent forward (mosaic_forward_grid="persistent"; 3 CTAs in the interpreter, so each
  runs several work items): one kv ring across a CTA's items, Q double-buffered and loaded one
  item ahead into the buffer that staged the item before's output. No race reported; matches
  the reference. docs_padding_gqa (2 query tiles x 4 heads: 8 items over 3 CTAs) at head dim
  128 runs it by default ("auto"; asserted), the same kernel as "persistent" asks for."""
  run = kernels_in_interpreter.check_case("docs_padding_gqa")
  assert [cfg.num_ctas for cfg in run.forward] == [3], run.forward


def test_mla_forward_output_in_q_memory_has_no_race():
  """The per-tile forward at MLA head dims stages O in a RefUnion with Q (forward.o_in_q): no
  race between one consumer's O store and the other's Q reads (the detector checks accesses of a
  union's different members); matches the reference. (The consumers' ping-pong barrier already
  orders them here: without the explicit q_dead barrier the detector reports nothing either; the
  barrier keeps the union safe independently of the ping-pong protocol.) prefill_mla runs the
  per-tile forward by default ("auto" at MLA head dims; asserted)."""
  run = kernels_in_interpreter.check_case("prefill_mla")
  assert [(cfg.num_ctas, cfg.block_kv) for cfg in run.forward] == [(0, 128)], run.forward
