// A 5-product attention backward for Hopper (sm_90a) in CUDA C++, called from JAX through XLA FFI.
//
// Why C++: every 5-product backward written in Pallas Mosaic GPU spilled or had its setmaxnreg
// split ignored by ptxas (docs/performance.md). Here the register
// budget of each warpgroup is set by hand and checked offline (nvcc -Xptxas -v) before a GPU
// minute is spent.
//
// Layout of one CTA (384 threads, three warpgroups), for one kv head, one 128-row kv tile and one
// batch row:
//   warpgroup 0 (producer, 24 registers): TMA-loads K and V of the tile once, then, for each query
//     head of the kv head's group and each 64-row query block of the tile's block-table row,
//     Q, dO (TMA, 128B-swizzled, two 64-column halves each) and the block's positions, segment
//     ids, lse and delta (1-D bulk copies) into a ring of STAGES slots.
//   warpgroups 1, 2 (consumers, 240 registers): consumer c owns kv rows 64c .. 64c + 63. Per
//     query block (64 rows):
//       S^T  = K_c Q^T      (wgmma m64n64k16 x 8, both operands in shared memory)
//       dP^T = V_c dO^T     (same)
//       S^T  = -inf on dropped pairs: a pass run only on steps the table does not keep whole
//       P^T  = exp2(S^T scale log2(e) - lse log2(e))
//       dS^T = P^T (dP^T - delta)
//       dV_c += P^T dO      (wgmma m64n128k16 x 4, P^T from registers, dO MN-major)
//       dK_c += dS^T Q      (same, dS^T from registers; scaled once at the end)
//       dS^T -> shared memory as dS [q][kv] (both consumers' halves), then
//       dQ[:, 64c:64c+64] = dS K[:, 64c:64c+64]   (wgmma m64n64k16 x 8: the column split keeps
//                            each consumer's dQ accumulator at 32 registers)
//       the dQ part staged in shared memory and bulk reduce-added (float32) into dq_accum.
//     The plain head dim 128 kernels (DK_LAST below) issue dK after the previous step's dQ, so
//     that dK is still in the tensor cores while the dQ part is staged.
//   Live accumulators at a step's peak: dK 64 + dV 64 + S^T 32 + dP^T 32 registers per thread;
//   dQ's 32 live only after S^T / dP^T are converted (16 + 16 registers of bf16 A operands).
//
// Scope (backend="hopper"'s backward, kernels/hopper.py; benchmarks/cuda_backward_check.py and
// tests/gpu/test_cuda_sm90_gpu.py check it against the float32 reference): bf16 or fp16, head
// dim 128 or 64 for Q / K / V (the layout below is 128's; 64 is in the kernel's comment; 256 has
// its own kernel and layout, backward_d256_kernel below), causal
// or not, segment ids, sliding window, soft cap, GQA / MQA, Sq, Skv
// multiples of 128 (kernels/hopper.py pads other lengths). Sinks need nothing here: the forward's
// lse holds them, and their gradient is computed on the JAX side. Template feature bits F,
// below; the sets built are KVAX_SM90_VARIANTS (head dims 128, 64) and _WIDE (256, 192).
// dq_accum is float32 [B, H, HD / 64, Sq /
// 64, 64 x 64] (per 64-column part and 64-row block), zeroed by the handler; the JAX side turns
// it into dq.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace kvax_sm90 {

constexpr int KV_TILE = 128;      // kv rows per CTA
constexpr int Q_BLOCK = 64;       // query rows per step (Plan<64> below: 128)
constexpr int STAGES = 2;         // ring depth
constexpr int CONSUMERS = 2;
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int IDS_SLOT = 4 * Q_BLOCK * 4;  // per stage of 64-row steps: q_pos, q_seg, lse, delta
constexpr int DQ_STAGE = 64 * 64 * 4;      // a consumer's dQ part [64 rows][64 cols] float32

// Shared memory plan of fused_backward_kernel at head dim HD, 128 or 64 (bytes; every tile
// 1024-aligned for the 128B swizzle). Q, K, V, dO come in column pieces of 64 (HD / 64 of them).
// A step covers QB query rows: 64 at head dim 128, 128 at 64, so that both head dims do the same
// tensor-core work per step and reduce-add the same 64 x 64 dQ part per consumer.
template <int HD>
struct Plan {
  static constexpr int PIECES = HD / 64;
  static constexpr int QB = HD == 64 ? 128 : 64;       // query rows per step
  static constexpr int KV_PIECE = KV_TILE * 64 * 2;   // [128 rows][64 cols] 16-bit = 16 KiB
  static constexpr int Q_PIECE = QB * 64 * 2;         // [QB rows][64 cols] 16-bit
  static constexpr int OFF_K = 0;                     // K: PIECES column pieces
  static constexpr int OFF_V = OFF_K + PIECES * KV_PIECE;
  static constexpr int OFF_RING = OFF_V + PIECES * KV_PIECE;  // per stage: Q pieces, dO pieces
  static constexpr int SLOT = 2 * PIECES * Q_PIECE;
  static constexpr int IDS = 4 * QB * 4;               // per stage: q_pos, q_seg, lse, delta
  static constexpr int OFF_DS = OFF_RING + STAGES * SLOT;  // dS [QB q][128 kv], two kv pieces, x2
  static constexpr int DS_BUF = 2 * Q_PIECE;
  static constexpr int OFF_DQ = OFF_DS + 2 * DS_BUF;   // per consumer: its dQ part, float32
  static constexpr int OFF_IDS = OFF_DQ + CONSUMERS * DQ_STAGE;
  static constexpr int OFF_BAR = OFF_IDS + STAGES * IDS;
  static constexpr int SMEM_BYTES = OFF_BAR + 8 * (2 * STAGES + 1) + 1024;  // + alignment slack
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory over the 227 KiB limit");
};

struct Params {
  CUtensorMap tm_q, tm_k, tm_v, tm_do;  // 3-D views (HD, heads, rows) of [B * S, heads, HD]
  const int* q_pos;
  const int* q_seg;
  const int* kv_pos;
  const int* kv_seg;
  const float* lse;      // [B, H, Sq]
  const float* delta;    // [B, H, Sq]
  const int* lower;      // [B, n_tiles]: first visited 64-row query block of each kv tile
  const int* upper;      // [B, n_tiles]: one past the last
  const int* full_lower; // [B, n_tiles]: the first 64-row query block the tile keeps whole
  const int* full_upper; // [B, n_tiles]: one past the last (those steps skip the mask)
  const int* order;      // [B, KH * Skv / CTA tile]: launch position -> (kv head, kv tile),
                         // coded (kv head << ORDER_TILE_BITS) | tile (fused_backward.py's
                         // launch_order; cta_tile, cta_kv_head)
  void* dk;              // [B, Skv, KH, HD], the inputs' 16-bit type
  void* dv;
  float* dq_accum;       // [B, H, HD / 64, Sq / 64, 64 x 64]: per 64-column part and 64-row block,
                         // row-major, or in the consumers' fragment order (FRAG; the wide
                         // kernels, head dims 256 and 192: red_add_part's vector order)
  int s_q, s_kv, heads, kv_heads;
  float scale;
  int causal;
  int window;            // WINDOW: keep q_pos - kv_pos < window (and kv_pos - q_pos < window
                         // when not causal)
  float cap_log2e;       // SOFTCAP: the cap times log2(e)
  float scale_over_cap;  // SOFTCAP: scale / cap
};

// ---------------------------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Each launch position (blockIdx.x; the batch row blockIdx.z) runs the (kv head, kv tile) pair
// Params::order codes there, (kv head << ORDER_TILE_BITS) | tile: the host decides which pairs
// are in flight together (fused_backward.py's launch_order). The producer and head dim 256's
// consumers read the kv head once and hold it: read at each step, its global load sits on the
// step's path (the consumer's first use waits for it). MLA's kernel and the soft cap's producer
// at head dim 128 read it at each step, which is the faster way for those two
// (docs/tuning-history.md). The head dim 128 / 64 consumers either count the step's query head
// along from one read (the lean step) or read it again where used (the others: held across the
// step loop, it spills at head dim 64): asm volatile keeps the compiler from merging the reads,
// and the entry is decoded inside the asm so that it is not hoisted and held either.
constexpr int ORDER_TILE_BITS = 20;
#define KVAX_SM90_ORDER_ASM(DECODE)   \
  "{\n"                               \
  ".reg .u32 x, n, z, i, e;\n"        \
  ".reg .u64 a;\n"                    \
  "mov.u32 x, %%ctaid.x;\n"           \
  "mov.u32 n, %%nctaid.x;\n"          \
  "mov.u32 z, %%ctaid.z;\n"           \
  "mad.lo.u32 i, z, n, x;\n"          \
  "mad.wide.u32 a, i, 4, %1;\n"       \
  "ld.global.nc.b32 e, [a];\n"        \
  DECODE                              \
  "}"
// The CTA's kv tile.
__device__ __forceinline__ int cta_tile(const Params& p) {
  int tile;
  asm volatile(KVAX_SM90_ORDER_ASM("and.b32 %0, e, 1048575;\n") : "=r"(tile) : "l"(p.order));
  return tile;
}
// The CTA's kv head.
__device__ __forceinline__ int cta_kv_head(const Params& p) {
  int kv_head;
  asm volatile(KVAX_SM90_ORDER_ASM("shr.u32 %0, e, 20;\n") : "=r"(kv_head) : "l"(p.order));
  return kv_head;
}
static_assert((1 << ORDER_TILE_BITS) - 1 == 1048575, "cta_tile's mask");
#undef KVAX_SM90_ORDER_ASM

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Waits for the barrier's phase `phase` to complete. The suspend-time hint (10 ms, an upper
// bound: the thread wakes when the phase completes) makes ptxas sleep between polls
// (NANOSLEEP.SYNCS) instead of spinning, so the producer's wait for a released slot does not
// take issue slots from the consumer warps of its SM sub-partition.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1, %2;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(phase), "n"(10000000)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read0() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait0() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle. K-major tiles: rows of 64 bf16 (128 B),
// 8-row groups 1024 B apart (SBO); a k16 step moves the start 32 B. MN-major tiles: the same
// rows hold 64 MN-contiguous elements of one k; 8-k groups 1024 B apart (SBO), the next 64 MN
// elements at LBO; a k16 step moves the start 2048 B.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // 128B swizzle
  return d;
}

// Descriptor d with its start address moved by off bytes (a multiple of 16): a 32-bit add to the
// low word, which cannot carry into the LBO field while the address stays below 256 KiB (all of
// shared memory). With off a compile-time constant, each wgmma of an unrolled k loop costs one
// add on a descriptor built once, instead of a descriptor rebuilt from its address.
__device__ __forceinline__ uint64_t desc_moved(uint64_t d, uint32_t off) {
  const uint32_t lo = static_cast<uint32_t>(d) + (off >> 4);
  return (d & 0xFFFFFFFF00000000ull) | lo;
}

// The float32 accumulator operands of the wgmmas: the m64n64 / m64n128 register lists in the PTX
// text and the read-write constraints, 16 at a time (m64n64: 32, m64n128: 64).
#define KVAX_REGS32                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                    \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KVAX_REGS64                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                    \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "           \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "           \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define KVAX_ACC16(d, i)                                                                       \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),   \
      "+f"(d[i + 6]), "+f"(d[i + 7]), "+f"(d[i + 8]), "+f"(d[i + 9]), "+f"(d[i + 10]),          \
      "+f"(d[i + 11]), "+f"(d[i + 12]), "+f"(d[i + 13]), "+f"(d[i + 14]), "+f"(d[i + 15])
#define KVAX_ACC64(d) KVAX_ACC16(d, 0), KVAX_ACC16(d, 16), KVAX_ACC16(d, 32), KVAX_ACC16(d, 48)

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], both from shared memory. tnsp_b: B MN-major. TY: the
// operands' type in the PTX name ("bf16" or "f16").
#define KVAX_WGMMA_64x64_SS(TY)                                                                \
  asm volatile(                                                                                \
      "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"                                             \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                               \
      KVAX_REGS32 ", "                                                                          \
      "%32, %33, p, 1, 1, %35, %36;\n}\n"                                                       \
      : KVAX_ACC16(d, 0), KVAX_ACC16(d, 16)                                                    \
      : "l"(da), "l"(db), "r"(accumulate), "n"(TNSP_A), "n"(TNSP_B))
template <bool HALF, int TNSP_A, int TNSP_B>
__device__ __forceinline__ void wgmma_64x64_ss(float (&d)[32], uint64_t da, uint64_t db,
                                               int accumulate) {
  if constexpr (HALF) {
    KVAX_WGMMA_64x64_SS("f16");
  } else {
    KVAX_WGMMA_64x64_SS("bf16");
  }
}

// D[64 x N] += A[64 x 16] (registers, 16-bit pairs) B[16 x N] (shared memory, MN-major), N =
// 128 or 64.
#define KVAX_WGMMA_64x128_RS(TY)                                                               \
  asm volatile(                                                                                \
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"                                               \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " KVAX_REGS64 ", "             \
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                              \
      : KVAX_ACC64(d)                                                                          \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
#define KVAX_WGMMA_64x64_RS(TY)                                                                \
  asm volatile(                                                                                \
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"                                               \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                               \
      KVAX_REGS32 ", "                                                                          \
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                              \
      : KVAX_ACC16(d, 0), KVAX_ACC16(d, 16)                                                    \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
template <bool HALF, int N>
__device__ __forceinline__ void wgmma_64xN_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t db) {
  static_assert(N == 128 || N == 64, "N: 128 or 64");
  if constexpr (N == 128) {
    if constexpr (HALF) {
      KVAX_WGMMA_64x128_RS("f16");
    } else {
      KVAX_WGMMA_64x128_RS("bf16");
    }
  } else {
    if constexpr (HALF) {
      KVAX_WGMMA_64x64_RS("f16");
    } else {
      KVAX_WGMMA_64x64_RS("bf16");
    }
  }
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], both from shared memory (head dim 256's dK += dS^T Q
// in the consumer that reads dS^T from shared memory).
#define KVAX_WGMMA_64x128_SS(TY)                                                               \
  asm volatile(                                                                                \
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                                             \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " KVAX_REGS64 ", "             \
      "%64, %65, p, 1, 1, %67, %68;\n}\n"                                                       \
      : KVAX_ACC64(d)                                                                          \
      : "l"(da), "l"(db), "r"(accumulate), "n"(TNSP_A), "n"(TNSP_B))
template <bool HALF, int TNSP_A, int TNSP_B>
__device__ __forceinline__ void wgmma_64x128_ss(float (&d)[64], uint64_t da, uint64_t db,
                                                int accumulate) {
  if constexpr (HALF) {
    KVAX_WGMMA_64x128_SS("f16");
  } else {
    KVAX_WGMMA_64x128_SS("bf16");
  }
}

// *addr += (a, b, c, d) in global memory, as one 16-byte float32 vector reduction (sm_90).
__device__ __forceinline__ void red_add_f32x4(float* addr, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
}

// A 64 x 64 float32 wgmma accumulator (32 per thread t of the warpgroup) reduce-added into a
// dq_accum part at dst in the wide kernels' vector order: thread t's elements 4j .. 4j + 3 (rows
// r0 and r0 + 8, columns 8j + 2 (lane % 4) + {0, 1}) at float offset (j * 128 + t) * 4, one
// 16-byte reduction each (fused_backward.py's unpermute_vector_order undoes it): half the
// instructions of 8-byte pairs.
__device__ __forceinline__ void red_add_part(float* dst, const float (&acc)[32], int t) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
    red_add_f32x4(dst + (j * 128 + t) * 4, acc[4 * j], acc[4 * j + 1], acc[4 * j + 2],
                  acc[4 * j + 3]);
}

// Two floats as one register of the 16-bit operand type (HALF: fp16, else bf16), rounded.
template <bool HALF>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (HALF) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// tanh(y) as 1 - 2 / (2^(2 y log2 e) + 1): one MUFU.EX2 and one MUFU.RCP, relative error ~1e-6
// away from 0 (absolute ~1e-7 near it), and exactly +-1 at the extremes (2^x saturates to inf or
// 0). Not tanh.approx.f32: its 2^-11 relative error, times a cap of 30 or 50, moves a logit by up
// to ~0.02, a 2% error in P against the forward's lse.
__device__ __forceinline__ float tanh_of(float y) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(y * 2.8853900817779268f));  // 2 log2(e)
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.f));
  return fmaf(-2.f, r, 1.f);
}

// 2^x: ex2.approx.ftz (FAST) or exp2f; both give +0 at -inf.
template <bool FAST>
__device__ __forceinline__ float exp2_of(float x) {
  if constexpr (FAST) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  } else {
    return exp2f(x);
  }
}

// Byte offset of element (row, col) in a [rows][64] bf16 tile with the 128B swizzle (1024-aligned).
__device__ __forceinline__ uint32_t sw128_offset(int row, int col) {
  const int chunk = (col >> 3) ^ (row & 7);  // 16-byte chunk within the 128-byte row
  return row * 128 + chunk * 16 + (col & 7) * 2;
}

// The query block of step n of a CTA that walks blocks lo .. lo + steps_per_head - 1 for each of
// its query heads in turn: upwards for every head, or (SNAKE) upwards for the even heads of the
// group and downwards for the odd ones, so that each head starts at the block where the one
// before ended. A CTA's walk takes a while per head, and the CTAs in flight change heads at
// different steps: in the upward walk a CTA entering its next head starts at the bottom of the
// range while the CTAs of later tiles are still at the top of the head before, so more distinct
// Q / dO / dq blocks are live in L2 at once than where each head turns back.
template <bool SNAKE>
__device__ __forceinline__ int snake_block(int n, int lo, int steps_per_head) {
  const int r = n % steps_per_head;
  return SNAKE && (n / steps_per_head) % 2 ? lo + steps_per_head - 1 - r : lo + r;
}

// The two layouts' shared parts: the ring's barriers and the producer warpgroup. A layout's
// shared memory holds K and V of the CTA's kv tile (PIECES column pieces of 64 each, KV_PIECE
// bytes apart) and a ring of STAGES slots, each with the query block's Q pieces (Q_PIECE bytes
// apart from the slot's start), its dO pieces (from piece DO_FIRST) and, in a separate array,
// its positions, segment ids, lse and delta.
struct Ring {
  uint32_t k, v;             // K / V tile
  uint32_t slots, slot_bytes;
  uint32_t ids;              // 4 x (query rows per step) x 4 bytes per slot
  uint32_t full, empty, kv;  // barriers: STAGES "slot loaded", STAGES "slot released", K / V
};

// Thread 0 initialises the ring's barriers; every thread then meets at __syncthreads.
__device__ __forceinline__ void init_ring_barriers(const Ring& r) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(r.full + 8 * s, 1);
      mbar_init(r.empty + 8 * s, CONSUMERS);
    }
    mbar_init(r.kv, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// The producer (one thread): K and V of the tile (kv rows kv_row.., TMA boxes of the tile's
// rows), then for each of `steps` steps (steps_per_head query blocks from block lo, for each
// of the group's query heads of kv_head) the block's Q and dO pieces and ids into slot
// n % STAGES, once both consumers released step n - STAGES. PIECES: the column pieces of Q and
// K; V_PIECES: of V and dO (fewer for MLA's head dims 192 / 128). QB: query rows per step, loaded
// as 64-row boxes (the tensor maps' box) one under the other. SNAKE: the group's odd heads walk
// their query blocks from the last to the first (snake_block). HEAD_EACH_STEP: the step's kv
// head read from Params::order at each step rather than the kv_head argument held (where that
// is faster: the soft cap's kernels at head dim 128, MLA's).
template <int PIECES, int KV_PIECE, int Q_PIECE, int DO_FIRST, int V_PIECES = PIECES,
          int QB = Q_BLOCK, bool SNAKE = false, bool HEAD_EACH_STEP = false>
__device__ __forceinline__ void produce(const Params& p, const Ring& r, int kv_row, int kv_head,
                                        int b, int group, int lo, int steps_per_head, int steps) {
  mbar_expect_tx(r.kv, (PIECES + V_PIECES) * KV_PIECE);
  if constexpr (V_PIECES == PIECES) {
    for (int h = 0; h < PIECES; ++h) {
      tma_load_3d(r.k + h * KV_PIECE, &p.tm_k, r.kv, 64 * h, kv_head, kv_row);
      tma_load_3d(r.v + h * KV_PIECE, &p.tm_v, r.kv, 64 * h, kv_head, kv_row);
    }
  } else {
    for (int h = 0; h < PIECES; ++h)
      tma_load_3d(r.k + h * KV_PIECE, &p.tm_k, r.kv, 64 * h, kv_head, kv_row);
    for (int h = 0; h < V_PIECES; ++h)
      tma_load_3d(r.v + h * KV_PIECE, &p.tm_v, r.kv, 64 * h, kv_head, kv_row);
  }
  for (int n = 0; n < steps; ++n) {
    const int s = n % STAGES;
    if (n >= STAGES) mbar_wait(r.empty + 8 * s, ((n / STAGES) - 1) & 1);
    const int head = (HEAD_EACH_STEP ? cta_kv_head(p) : kv_head) * group + n / steps_per_head;
    const int q0 = snake_block<SNAKE>(n, lo, steps_per_head) * QB;
    const uint32_t slot = r.slots + s * r.slot_bytes;
    const uint32_t ids = r.ids + s * (4 * QB * 4);
    const uint32_t full = r.full + 8 * s;
    mbar_expect_tx(full, (PIECES + V_PIECES) * Q_PIECE + 4 * QB * 4);
    if constexpr (QB != Q_BLOCK) {
      static_assert(V_PIECES == PIECES && QB % 64 == 0 && Q_PIECE == QB * 128, "QB: 64-row boxes");
      for (int h = 0; h < PIECES; ++h) {
        for (int r64 = 0; r64 < QB / 64; ++r64) {
          const int row = b * p.s_q + q0 + 64 * r64;
          tma_load_3d(slot + h * Q_PIECE + r64 * 8192, &p.tm_q, full, 64 * h, head, row);
          tma_load_3d(slot + (DO_FIRST + h) * Q_PIECE + r64 * 8192, &p.tm_do, full, 64 * h, head,
                      row);
        }
      }
    } else if constexpr (V_PIECES == PIECES) {
      for (int h = 0; h < PIECES; ++h) {
        tma_load_3d(slot + h * Q_PIECE, &p.tm_q, full, 64 * h, head, b * p.s_q + q0);
        tma_load_3d(slot + (DO_FIRST + h) * Q_PIECE, &p.tm_do, full, 64 * h, head, b * p.s_q + q0);
      }
    } else {
      for (int h = 0; h < PIECES; ++h)
        tma_load_3d(slot + h * Q_PIECE, &p.tm_q, full, 64 * h, head, b * p.s_q + q0);
      for (int h = 0; h < V_PIECES; ++h)
        tma_load_3d(slot + (DO_FIRST + h) * Q_PIECE, &p.tm_do, full, 64 * h, head, b * p.s_q + q0);
    }
    const size_t row = static_cast<size_t>(b) * p.s_q + q0;
    const size_t hrow = (static_cast<size_t>(b) * p.heads + head) * p.s_q + q0;
    bulk_load(ids, p.q_pos + row, QB * 4, full);
    bulk_load(ids + QB * 4, p.q_seg + row, QB * 4, full);
    bulk_load(ids + 2 * QB * 4, p.lse + hrow, QB * 4, full);
    bulk_load(ids + 3 * QB * 4, p.delta + hrow, QB * 4, full);
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------
// F selects the variant by feature bits (the JAX side's fused_backward.VARIANTS names them):
//   STM   dS stored to shared memory by stmatrix .trans (else 2-byte scalar stores);
//   FRAG  the dQ part staged in the consumers' fragment order (else row-major: 8-way bank
//         conflicts, rows 256 B apart);
//   EXP   exponentials by ex2.approx.ftz (one MUFU.EX2; exp2f adds a range check and two
//         predicated multiplies for subnormal results, which P does not need).
//   DECOUPLE  the consumers hand dS over by named-barrier arrive / sync pairs (per buffer and
//         direction) instead of meeting at one barrier each step, and each does step n - 1's dQ
//         during step n: they may drift up to a step apart (else they run in lockstep, and
//         both idle the tensor cores through their element-wise stretches at the same time).
//   SOFTCAP   logits cap * tanh(scale q.k / cap) (Gemma 2): P from the capped logit, and dS times
//         the cap's derivative 1 - tanh^2 (folded into P's float copy once the 16-bit P is
//         packed, so no register stays live for it).
//   WINDOW    the sliding-window test on each pair (two more compares per element).
//   MASK_IN_LOOP  the mask tested on every step, also those the table keeps whole (the JAX side
//         sets it when the scale is not > 0; the soft cap implies it).
// A compile-time bool passed to a generic lambda, so one body serves both cases of a branch.
template <bool V>
struct BoolTag {
  static constexpr bool value = V;
};

constexpr int STM = 2, FRAG = 4, EXP = 16, DECOUPLE_BIT = 32, MASK_IN_LOOP = 64, SOFTCAP = 1024,
              WINDOW = 2048;
// (bits 1, 8, 128, 256 and 512 are free)
// Named barriers (0 is __syncthreads): 1 the consumers' per-step meeting; 2, 3 each consumer's
// staging; DECOUPLE: BAR_DS_FULL + 2 b + c "the other consumer's half of dS buffer b is written,
// for reader c", BAR_DS_FREE + 2 b + c "buffer b is read by the other consumer, writer c may
// overwrite its half".
constexpr int BAR_DS_FULL = 4, BAR_DS_FREE = 8;

// HALF: fp16 operands (else bf16); accumulation is float32 either way. HD: the head dim, 128 or
// 64 (Plan<HD>). At 64 a step covers 128 query rows: consumer c holds S^T, dP^T of its 64 kv rows
// against all 128 (m64n128 products), and computes dQ for query rows 64c .. 64c + 63 of the block
// from both consumers' dS (K = 128 kv rows), handed over as at 128. Each consumer then reduce-adds
// one 64 x 64 dQ part per step, as at 128: the dq traffic per pair is half of 64-row steps'.
template <int F, bool HALF, int HD>
__global__ void __launch_bounds__(THREADS, 1)
    fused_backward_kernel(const __grid_constant__ Params p) {
  static_assert(HD == 128 || HD == 64, "HD: 128 or 64");
  constexpr bool USE_STM = F & STM, USE_FRAG = F & FRAG, FAST_EXP = F & EXP;
  constexpr bool DECOUPLE = F & DECOUPLE_BIT, CAP = F & SOFTCAP, WIN = F & WINDOW;
  // The mask tested only on steps the table does not keep whole (below); MASK_IN_LOOP and the
  // soft cap's kernels test it on every step.
  constexpr bool SKIP_WHOLE = !CAP && !(F & MASK_IN_LOOP);
  // The lean step (descriptors moved by constants, the step's head and query block counted
  // along, the warpgroup index warp-uniform): head dim 128 without the soft cap or the window,
  // the kernels where it is measured faster and tested on a GPU. At head dim 64 and with the
  // soft cap its counters and uniform index spill; with the window it is not measured, so
  // those kernels keep the plain step.
  constexpr bool LEAN_STEP = HD == 128 && SKIP_WHOLE && !WIN;
  // DK_LAST: dK += dS^T Q issued after step n - 1's dQ product rather than with dV, so that the
  // tensor cores run dK while the consumer stages the dQ part (DECOUPLE's order, where dQ runs a
  // step late; in the lean step's kernels, like LEAN_STEP).
  constexpr bool DK_LAST = LEAN_STEP && DECOUPLE;
  // SNAKE: the odd heads of the group walk their query blocks downwards (snake_block). Not with
  // a window: its tiles' walks are equally long, so the CTAs in flight change heads together.
  // Nor with the mask in the loop (a scale <= 0, rare), whose head dim 64 kernels it spills.
  constexpr bool SNAKE = !WIN && !(F & MASK_IN_LOOP);
  static_assert(HD == 128 || DECOUPLE, "head dim 64's 128-row steps need DECOUPLE's dS hand-over");
  using L = Plan<HD>;
  constexpr int HALVES = L::PIECES;  // 64-column pieces of Q, K, V, dO (and of dQ's parts)
  constexpr int QB = L::QB;          // query rows per step
  constexpr int KSTEPS = HD / 16;  // k16 steps of S^T = K Q^T and dP^T = V dO^T
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Aligned by pointer arithmetic on the shared array: through an integer cast the compiler
  // loses the address space and every shared access becomes a generic LD.E / ST.E.
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t base = smem_u32(smem);
  const Ring ring{base + L::OFF_K,   base + L::OFF_V,
                  base + L::OFF_RING, L::SLOT,
                  base + L::OFF_IDS,  base + L::OFF_BAR,
                  base + L::OFF_BAR + 8 * STAGES, base + L::OFF_BAR + 16 * STAGES};
  const uint32_t bar_full = ring.full, bar_empty = ring.empty, bar_kv = ring.kv;

  const int tile = cta_tile(p), b = blockIdx.z;
  const int group = p.heads / p.kv_heads;
  const int n_tiles = p.s_kv / KV_TILE;
  // The table's bounds count 64-row query blocks; a 128-row step covers two of them (one may have
  // nothing kept for this tile: the element-wise mask zeroes it).
  int lo = p.lower[b * n_tiles + tile], hi = p.upper[b * n_tiles + tile];
  // Steps kept whole: a 128-row step only when both of its 64-row blocks are.
  int full_lo = p.full_lower[b * n_tiles + tile], full_hi = p.full_upper[b * n_tiles + tile];
  if constexpr (QB == 128) {
    hi = hi > lo ? (hi + 1) / 2 : lo / 2;
    lo /= 2;
    full_lo = (full_lo + 1) / 2;
    full_hi /= 2;
  }
  const int steps_per_head = hi - lo;
  const int steps = steps_per_head * group;
  // LEAN_STEP: the warpgroup index through a shuffle from lane 0, so that the compiler knows it
  // is the same in every lane and keeps what derives from it (the consumer's K / V descriptors)
  // in uniform registers, which the wgmmas read without a move per product.
  const int wg = LEAN_STEP ? __shfl_sync(0xFFFFFFFF, threadIdx.x / 128, 0) : threadIdx.x / 128;
  const int t = threadIdx.x % 128;
  init_ring_barriers(ring);

  if (wg == 0) {  // ------------------------------------------------------------ producer
    set_max_regs_dec<24>();
    if (t == 0) {
      produce<HALVES, L::KV_PIECE, L::Q_PIECE, HALVES, HALVES, QB, SNAKE, CAP && HD == 128>(
          p, ring, b * p.s_kv + tile * KV_TILE, cta_kv_head(p), b, group, lo, steps_per_head, steps);
    }
    return;
  }

  // ------------------------------------------------------------------------------ consumers
  set_max_regs_inc<240>();
  const int c = wg - 1;             // this consumer's kv rows: 64c .. 64c + 63 of the tile
  const int warp = t / 32, lane = t % 32;
  const int r0 = 16 * warp + lane / 4;  // accumulator rows r0 and r0 + 8 (kv rows of S^T)
  const float sl2 = p.scale * 1.4426950408889634f;
  const bool not_causal = !p.causal;

  // The two kv rows of this thread (ids constant over the CTA).
  const int kv_tok0 = b * p.s_kv + tile * KV_TILE + 64 * c + r0;
  const int kvp0 = p.kv_pos[kv_tok0], kvs0 = p.kv_seg[kv_tok0];
  const int kvp1 = p.kv_pos[kv_tok0 + 8], kvs1 = p.kv_seg[kv_tok0 + 8];

  float dk[HD / 2], dv[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk[i] = dv[i] = 0.f;

  mbar_wait(bar_kv, 0);
  // K_c / V_c rows of this consumer, as A operands (K-major): the tile's rows 64c.., two halves.
  const uint32_t k_c = base + L::OFF_K + 64 * c * 128, v_c = base + L::OFF_V + 64 * c * 128;

  // The wgmmas' shared-memory descriptors: LEAN_STEP, the operand's base descriptor moved by the
  // k step's constant offset; else rebuilt from the address.
  auto desc_at = [&](uint32_t addr, uint32_t off, uint32_t lbo) -> uint64_t {
    return LEAN_STEP ? desc_moved(desc_sw128(addr, lbo, 1024), off)
                     : desc_sw128(addr + off, lbo, 1024);
  };
  // Head dim 128: dQ[:, 64c : 64c + 64] of step m = dS K[:, 64c : 64c + 64] (M = 64 query rows,
  // N = 64 (d), K = 128 kv rows; dS K-major from buffer m % 2, K MN-major: column half c of the
  // K tile), reduce-added into dq_accum[b, head_m, c, q0_m / 64]. Head dim 64: dQ[64c .. 64c + 63]
  // = dS[64c .., :] K (the block's query rows 64c.., all 64 columns, K = 128 kv rows), into
  // dq_accum[b, head_m, 0, q0_m / 64 + c]. The part is staged and bulk reduce-added. Row-major
  // staging
  // has 8-way bank conflicts (rows are 256 B apart); FRAG stages in fragment order, register pair
  // i of thread t at float offset (i / 2 * 128 + t) * 2, one conflict-free 256-byte run per warp
  // and pair (the JAX side undoes the order). release: the ring slot's "empty" barrier to
  // arrive at once the products are done (0: none).
  // m < 0 (DK_LAST's first step): the products run on whatever dS buffer 1 holds, and
  // dq_finish discards them; issued all the same, so that every step has the same wgmma
  // sequence (a dQ product issued on one path only makes ptxas serialize the step's wgmmas).
  auto dq_issue = [&](int m, float (&dq)[32]) {
    const int bm = DK_LAST ? (m & 1) : m % 2;
    if constexpr (DECOUPLE) {
      if (!DK_LAST || m >= 0) named_sync(BAR_DS_FULL + 2 * bm + c, 256);  // the other half written
    }
    wg_fence();
    const uint32_t ds_base = base + L::OFF_DS + bm * L::DS_BUF;
    if constexpr (HD == 128) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t aoff = (k / 4) * L::Q_PIECE + (k % 4) * 32;
        wgmma_64x64_ss<HALF, 0, 1>(dq, desc_at(ds_base, aoff, 16),
                                   desc_at(base + L::OFF_K + c * L::KV_PIECE, k * 2048,
                                           L::KV_PIECE), k > 0);
      }
    } else {  // rows 64c.. of dS (8 KiB into each kv piece), all of K (one column piece)
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t aoff = (k / 4) * L::Q_PIECE + c * 8192 + (k % 4) * 32;
        wgmma_64x64_ss<HALF, 0, 1>(dq, desc_at(ds_base, aoff, 16),
                                   desc_at(base + L::OFF_K, k * 2048, L::KV_PIECE), k > 0);
      }
    }
    wg_commit();
  };
  // pending: the wgmma groups committed after dQ's that may stay in flight (DK_LAST's dK: 1).
  auto dq_finish = [&](int m, int head_m, int q0_m, uint32_t release, const float (&dq)[32],
                       auto pending) {
    const int bm = DK_LAST ? (m & 1) : m % 2;
    wg_wait<decltype(pending)::value ? 1 : 0>();
    if (DK_LAST && m < 0) return;
    if (release && t == 0) mbar_arrive(release);  // Q / dO slot free
    if constexpr (DECOUPLE) {  // buffer bm read: the other consumer may write its half at m + 2
      if (m + 2 < steps) named_arrive(BAR_DS_FREE + 2 * bm + (1 - c), 256);
    }
    float* stage = reinterpret_cast<float*>(smem + L::OFF_DQ + c * DQ_STAGE);
    if (t == 0) bulk_wait_read0();  // the previous reduce has read the staging buffer
    named_sync(2 + c, 128);
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int row = r0 + 8 * ((i / 2) % 2);
      const int col = 8 * (i / 4) + 2 * (lane % 4);
      float* at = USE_FRAG ? stage + ((i / 2) * 128 + t) * 2 : stage + row * 64 + col;
      *reinterpret_cast<float2*>(at) = make_float2(dq[i], dq[i + 1]);
    }
    fence_async_smem();
    named_sync(2 + c, 128);
    if (t == 0) {
      const int part = HD == 128 ? c : 0, row0 = HD == 128 ? q0_m : q0_m + 64 * c;
      float* dst = p.dq_accum +
                   ((((static_cast<size_t>(b) * p.heads + head_m) * HALVES + part) * p.s_q) +
                    row0) * 64;
      bulk_reduce_add_f32(dst, smem_u32(stage), DQ_STAGE);
      bulk_commit();
    }
  };
  auto dq_part = [&](int m, int head_m, int q0_m, uint32_t release) {
    float dq[32];
    dq_issue(m, dq);
    dq_finish(m, head_m, q0_m, release, dq, BoolTag<false>{});
  };
  int prev_head = 0, prev_q0 = 0;  // DECOUPLE: the step whose dQ is still to do
  // Step n's query head and QB-row query block, kv_head * group + n / steps_per_head and
  // snake_block: LEAN_STEP counts them along (step_head, step_qb, advanced at the end of each
  // step by step_dir, which SNAKE turns at each head's last block) rather than dividing them out
  // at each step.
  int step_head = LEAN_STEP ? cta_kv_head(p) * group : 0, step_qb = lo, step_dir = 1;

  for (int n = 0; n < steps; ++n) {
    const int s = n % STAGES;
    // Step n's query head, computed where used: the lean step counts it along, the other
    // kernels read the kv head again rather than hold it across the step.
    auto step_query_head = [&] {
      return LEAN_STEP ? step_head : cta_kv_head(p) * group + n / steps_per_head;
    };
    // This step's query block.
    const int qb = LEAN_STEP ? step_qb : snake_block<SNAKE>(n, lo, steps_per_head);
    const int q0 = qb * QB;
    const uint32_t slot = base + L::OFF_RING + s * L::SLOT;
    const float* ids = reinterpret_cast<const float*>(smem + L::OFF_IDS + s * L::IDS);
    mbar_wait(bar_full + 8 * s, (n / STAGES) & 1);

    // S^T = K_c Q^T and dP^T = V_c dO^T: M = 64 kv rows, N = QB query rows, K = HD.
    float st[QB / 2], dpt[QB / 2];
    auto ss_product = [&](float (&acc)[QB / 2], uint64_t da, uint64_t db, int accumulate) {
      if constexpr (QB == 64) {
        wgmma_64x64_ss<HALF, 0, 0>(acc, da, db, accumulate);
      } else {
        wgmma_64x128_ss<HALF, 0, 0>(acc, da, db, accumulate);
      }
    };
    wg_fence();
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      const uint32_t koff = (k / 4) * L::KV_PIECE + (k % 4) * 32;
      const uint32_t qoff = (k / 4) * L::Q_PIECE + (k % 4) * 32;
      ss_product(st, desc_at(k_c, koff, 16), desc_at(slot, qoff, 16), k > 0);
    }
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
      const uint32_t koff = (k / 4) * L::KV_PIECE + (k % 4) * 32;
      const uint32_t qoff = HALVES * L::Q_PIECE + (k / 4) * L::Q_PIECE + (k % 4) * 32;
      ss_product(dpt, desc_at(v_c, koff, 16), desc_at(slot, qoff, 16), k > 0);
    }
    wg_commit();
    wg_wait<0>();

    // P^T (in place over S^T, float32) and its bf16 A fragments. Element i of the accumulator:
    // row r0 + 8 * ((i / 2) % 2), column 8 * (i / 4) + 2 * (lane % 4) + i % 2. The query-side
    // values of a column pair come as one 8-byte load each. A step the table keeps whole (nearly
    // all of a causal row's) runs the loop without the mask test (SKIP_WHOLE); any other step
    // tests each pair in the loop (or in MASK_PASS's pass), its dropped pairs' exponentials taken
    // of -inf, so 0.
    const int* qpos = reinterpret_cast<const int*>(ids);
    const int* qseg = qpos + QB;
    const float* lse = ids + 2 * QB;
    const float* delta = ids + 3 * QB;
    // The mask test of element e of pair (j, half): the pair's query ids and the thread's kv row.
    auto kept = [&](int2 qp2, int2 qs2, int half, int e) {
      const int kp = half ? kvp1 : kvp0, ks = half ? kvs1 : kvs0;
      const int qs = e ? qs2.y : qs2.x, qp = e ? qp2.y : qp2.x;
      bool keep = (qs == ks) & (qs != -1) & (not_causal | (kp <= qp));
      if constexpr (WIN) keep &= (qp - kp < p.window) & (!not_causal | (kp - qp < p.window));
      return keep;
    };
    // dS^T in the same pass as P^T, so each element's S^T / dP^T registers die as it is
    // converted: at head dim 128 (no soft-cap spills), and at 64 with the soft cap or the
    // window (in two passes ptxas serializes the soft cap's wgmmas, warning C7512, and the
    // window's kernel spills).
    // Head dim 64's plain kernel keeps two passes: in one it spills.
    constexpr bool ONE_PASS = HD == 128 || CAP || WIN;
    // Head dim 64's plain kernel masks a step the table does not keep whole in a pass of its own
    // (its dropped logits set to -inf) rather than in a second copy of the loop, which spills.
    constexpr bool MASK_PASS = SKIP_WHOLE && !ONE_PASS;
    const bool whole = qb >= full_lo && qb < full_hi;
    if constexpr (MASK_PASS) {
      if (!whole) {
#pragma unroll
        for (int j = 0; j < QB / 8; ++j) {
          const int col = 8 * j + 2 * (lane % 4);
          const int2 qp2 = *reinterpret_cast<const int2*>(qpos + col);
          const int2 qs2 = *reinterpret_cast<const int2*>(qseg + col);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = 4 * j + 2 * half + e;
              st[i] = kept(qp2, qs2, half, e) ? st[i] : -INFINITY;
            }
          }
        }
      }
    }
    uint32_t pa[QB / 4], dsa[QB / 4];
    // MASKED: whether this step tests the mask (a compile-time tag, so each case is its own loop).
    auto p_and_ds = [&](auto masked) {
      constexpr bool MASKED = decltype(masked)::value;
#pragma unroll
      for (int j = 0; j < QB / 8; ++j) {
        const int col = 8 * j + 2 * (lane % 4);
        const float2 l2 = *reinterpret_cast<const float2*>(lse + col);
        int2 qp2{}, qs2{};
        if constexpr (MASKED) {
          qp2 = *reinterpret_cast<const int2*>(qpos + col);
          qs2 = *reinterpret_cast<const int2*>(qseg + col);
        }
        [[maybe_unused]] float2 d2;
        if constexpr (ONE_PASS) d2 = *reinterpret_cast<const float2*>(delta + col);
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // accumulator rows r0 (half 0) and r0 + 8
          const int i = 4 * j + 2 * half;
          [[maybe_unused]] float capd[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const bool keep = !MASKED || kept(qp2, qs2, half, e);
            const float neg_lse2 = (e ? l2.y : l2.x) * -1.4426950408889634f;
            if constexpr (CAP) {
              const float th = tanh_of(st[i + e] * p.scale_over_cap);
              st[i + e] = exp2_of<FAST_EXP>(keep ? fmaf(th, p.cap_log2e, neg_lse2) : -INFINITY);
              capd[e] = fmaf(-th, th, 1.f);  // d cap tanh(y / cap) / dy
            } else {
              st[i + e] = exp2_of<FAST_EXP>(keep ? fmaf(st[i + e], sl2, neg_lse2) : -INFINITY);
            }
          }
          pa[i / 2] = pack2<HALF>(st[i], st[i + 1]);
          if constexpr (CAP) {  // P's float copy becomes P (1 - tanh^2): dS^T below needs only it
            st[i] *= capd[0];
            st[i + 1] *= capd[1];
          }
          if constexpr (ONE_PASS) {
            dsa[i / 2] = pack2<HALF>(st[i] * (dpt[i] - d2.x), st[i + 1] * (dpt[i + 1] - d2.y));
          }
        }
      }
    };
    if constexpr (MASK_PASS) {
      p_and_ds(BoolTag<false>{});
    } else if (!SKIP_WHOLE || !whole) {
      p_and_ds(BoolTag<true>{});
    } else {
      p_and_ds(BoolTag<false>{});
    }
    // Two passes: dS^T = P^T (dP^T - delta), bf16 A fragments, after all of P^T.
    if constexpr (!ONE_PASS) {
#pragma unroll
      for (int j = 0; j < QB / 8; ++j) {
        const float2 d2 = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * (lane % 4));
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = 4 * j + 2 * half;
          dsa[i / 2] = pack2<HALF>(st[i] * (dpt[i] - d2.x), st[i + 1] * (dpt[i + 1] - d2.y));
        }
      }
    }

    // dV_c += P^T dO and dK_c += dS^T Q: M = 64 kv rows, N = HD, K = QB query rows. The A
    // fragment of k-step kk is the accumulator's columns 16 kk .. 16 kk + 15: pairs 4kk .. 4kk+3
    // in the order (row r0, cols 0-7), (row r0 + 8, cols 0-7), (r0, cols 8-15), (r0 + 8, 8-15).
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < QB / 16; ++kk) {
      const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wgmma_64xN_rs<HALF, HD>(dv, a, desc_at(slot, HALVES * L::Q_PIECE + kk * 2048, L::Q_PIECE));
    }
    auto dk_products = [&] {
#pragma unroll
      for (int kk = 0; kk < QB / 16; ++kk) {
        const uint32_t a[4] = {dsa[4 * kk], dsa[4 * kk + 1], dsa[4 * kk + 2], dsa[4 * kk + 3]};
        wgmma_64xN_rs<HALF, HD>(dk, a, desc_at(slot, kk * 2048, L::Q_PIECE));
      }
    };
    if constexpr (!DK_LAST) dk_products();
    wg_commit();

    // dS [q][kv] in shared memory (K-major A of the dQ product: rows = query, 64 kv per 128-byte
    // row): this consumer's 64 kv columns are kv half c of a buffer both consumers fill
    // (double-buffered by step parity).
    const int buf = n % 2;
    uint8_t* ds_buf = smem + L::OFF_DS + buf * L::DS_BUF + c * L::Q_PIECE;
    // DECOUPLE: this half of buffer buf was last read (dQ of step n - 2) by both consumers: the
    // other one says so on BAR_DS_FREE (this consumer's own read is behind it in program order).
    if constexpr (DECOUPLE) {
      if (n >= 2) named_sync(BAR_DS_FREE + 2 * buf + c, 256);
    }
    if constexpr (USE_STM) {
      // stmatrix .trans: register pair i of dS^T is, per lane, row r0 + 8 (i % 2) and columns
      // 8 (i / 2) + 2 (lane % 4) + {0, 1} of an 8 x 8 matrix's fragment (the ldmatrix layout);
      // stored transposed, memory row k of matrix (h, j) is query 8 j + k, holding kv rows
      // 16 warp + 8 h .. + 7 (16 contiguous bytes). x4 call g covers j = 2g, 2g + 1, h = 0, 1;
      // lane l gives the address of row l % 8 of matrix l / 8.
      const int m = lane / 8, k = lane % 8;
#pragma unroll
      for (int g = 0; g < QB / 16; ++g) {
        const int j = 2 * g + m / 2, h = m % 2;
        const uint32_t addr = smem_u32(ds_buf) + sw128_offset(8 * j + k, 16 * warp + 8 * h);
        asm volatile(
            "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
            ::"r"(addr), "r"(dsa[4 * g]), "r"(dsa[4 * g + 1]), "r"(dsa[4 * g + 2]),
            "r"(dsa[4 * g + 3])
            : "memory");
      }
    } else {
#pragma unroll
      for (int i = 0; i < QB / 4; ++i) {
        const int col = 8 * (i / 2) + 2 * (lane % 4);     // query rows (dS row)
        const int row = r0 + 8 * (i % 2);                 // kv column of dS within the half
        const uint16_t lo = dsa[i] & 0xFFFF, hi = dsa[i] >> 16;  // two 16-bit values
        *reinterpret_cast<uint16_t*>(ds_buf + sw128_offset(col, row)) = lo;
        *reinterpret_cast<uint16_t*>(ds_buf + sw128_offset(col + 1, row)) = hi;
      }
    }
    fence_async_smem();
    if constexpr (DECOUPLE) {
      // Tell the other consumer this half is written (it waits there before its dQ of step n,
      // which it runs during its step n + 1), then do this consumer's dQ of step n - 1. The
      // consumers may drift up to a step apart: one's element-wise stretch can overlap the
      // other's products instead of both idling the tensor cores at once.
      named_arrive(BAR_DS_FULL + 2 * buf + (1 - c), 256);
      if constexpr (DK_LAST) {
        float dq[32];
        dq_issue(n - 1, dq);
        wg_fence();
        dk_products();
        wg_commit();
        dq_finish(n - 1, prev_head, prev_q0, 0, dq, BoolTag<true>{});
        wg_wait<0>();  // dK done: it has read Q
        if (t == 0) mbar_arrive(bar_empty + 8 * s);  // Q / dO slot free
      } else if (n >= 1) {
        dq_part(n - 1, prev_head, prev_q0, bar_empty + 8 * s);  // waits for all
      } else {
        wg_wait<0>();
        if (t == 0) mbar_arrive(bar_empty + 8 * s);  // Q / dO slot free
      }
      prev_head = step_query_head();
      prev_q0 = q0;
    } else {
      named_sync(1, 256);  // both consumers' dS halves written
      dq_part(n, step_query_head(), q0, bar_empty + 8 * s);
    }
    if constexpr (LEAN_STEP && SNAKE) {
      if (step_qb == (step_dir > 0 ? hi - 1 : lo)) {
        step_dir = -step_dir;
        ++step_head;
      } else {
        step_qb += step_dir;
      }
    } else if constexpr (LEAN_STEP) {
      if (++step_qb == hi) {
        step_qb = lo;
        ++step_head;
      }
    }
  }
  if constexpr (DECOUPLE) {
    if (steps > 0) dq_part(steps - 1, prev_head, prev_q0, 0);
  }
  if (t == 0) bulk_wait0();

  // dK (scaled) and dV of this consumer's 64 kv rows: accumulator element i at row
  // r0 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (lane % 4) + i % 2.
  const int done_tile = cta_tile(p), done_kv_head = cta_kv_head(p);
#pragma unroll
  for (int i = 0; i < HD / 2; i += 2) {
    const int row = done_tile * KV_TILE + 64 * c + r0 + 8 * ((i / 2) % 2);
    const int col = 8 * (i / 4) + 2 * (lane % 4);
    const size_t off =
        ((static_cast<size_t>(b) * p.s_kv + row) * p.kv_heads + done_kv_head) * HD + col;
    reinterpret_cast<uint32_t*>(p.dk)[off / 2] = pack2<HALF>(dk[i] * p.scale, dk[i + 1] * p.scale);
    reinterpret_cast<uint32_t*>(p.dv)[off / 2] = pack2<HALF>(dv[i], dv[i + 1]);
  }
}

// ---------------------------------------------------------------------------------------------
// Head dim 256: the consumers split the head dim instead of the kv rows
// ---------------------------------------------------------------------------------------------
// At head dim 256 the layout above would hold dK and dV of 64 kv rows x 256 columns per consumer:
// 256 float32 registers per thread, more than the 240 a consumer has. Here a CTA owns 64 kv rows
// and both consumers work on all of them, each owning half of the head dim: consumer c holds
// dK[:, 128c : 128c + 128] and dV[:, 128c : 128c + 128] (64 + 64 registers). The two products
// that contract over the head dim are dealt one per consumer:
//   consumer 0: S^T = K Q^T (K = 256), P^T = exp2(...) with the mask (and soft cap), P^T stored
//     to shared memory as float32 in fragment order (both consumers' accumulators have the same
//     thread layout, so each thread reads back exactly what its twin wrote: no bank conflicts);
//   consumer 1: dP^T = V dO^T (K = 256), then from P^T: dS^T = P^T (dP^T - delta) (times the
//     soft cap's 1 - tanh^2, recovered from P and lse: log2 P = tanh cap log2 e - lse log2 e),
//     stored to shared memory as dS^T [kv][q] (128B swizzle; stmatrix).
// Then both: dV_c += P^T dO[:, half c] (P^T from registers), dK_c += dS^T Q[:, half c] (dS^T
// from shared memory, so both run the same instructions) and dQ[:, half c] = dS K[:, half c]
// in two 64-column parts (A = dS: dS^T's buffer read MN-major), each reduce-added into dq_accum
// from registers (red_add_part: 16-byte reductions; no staging buffer fits next to the
// 64 KiB ring slots). Five products per tile pair, as at 128, and the same float32 dq_accum.
// The P^T and dS^T buffers are single: named barriers P_FULL / P_FREE and DS_FULL / DS_FREE
// (arrive by one consumer, sync by the other) order their reuse. (The FULL pairs alone already
// imply both FREE orders, tests/test_cuda_sm90.py simulates it; the FREE pairs stay until a GPU
// run checks the kernel without them.) Kv tiles of 64 rows take their
// query-block bounds from the mask's 128-row table (row tile / 2): a half tile may visit a block
// with nothing kept for it, which the element-wise mask zeroes.
namespace d256 {
constexpr int HD = 256;
constexpr int KV_TILE = 64;
constexpr int PIECE = 64 * 64 * 2;                // [64 rows][64 cols] 16-bit, 128B swizzle
constexpr int PIECES = HD / 64;
constexpr int OFF_K = 0;                          // K, V: 4 column pieces each
constexpr int OFF_V = OFF_K + PIECES * PIECE;
constexpr int OFF_RING = OFF_V + PIECES * PIECE;  // per stage: Q pieces 0-3, dO pieces 4-7
constexpr int SLOT = 2 * PIECES * PIECE;
constexpr int OFF_PT = OFF_RING + STAGES * SLOT;  // P^T float32 [64 x 64], fragment order
constexpr int OFF_DS = OFF_PT + 64 * 64 * 4;      // dS^T [64 kv][64 q], 16-bit, 128B swizzle
constexpr int OFF_IDS = OFF_DS + PIECE;
constexpr int OFF_BAR = OFF_IDS + STAGES * IDS_SLOT;
constexpr int SMEM_BYTES = OFF_BAR + 8 * (2 * STAGES + 1) + 1024;  // + alignment slack
static_assert(SMEM_BYTES <= 227 * 1024, "head dim 256: shared memory over the 227 KiB limit");
// Named barriers (1-3 are the 128 layout's; these pair one consumer's arrive with the other's sync)
constexpr int BAR_P_FULL = 4, BAR_P_FREE = 5, BAR_DS_FULL = 6, BAR_DS_FREE = 7;
}  // namespace d256

template <int F, bool HALF>
__global__ void __launch_bounds__(THREADS, 1)
    backward_d256_kernel(const __grid_constant__ Params p) {
  // This layout's constants (d256::), hiding the 128 layout's names of the same meaning.
  constexpr int HD = d256::HD, KV_TILE = d256::KV_TILE, PIECE = d256::PIECE, PIECES = d256::PIECES;
  constexpr int OFF_K = d256::OFF_K, OFF_V = d256::OFF_V, OFF_RING = d256::OFF_RING;
  constexpr int SLOT = d256::SLOT, OFF_PT = d256::OFF_PT, OFF_DS = d256::OFF_DS;
  constexpr int OFF_IDS = d256::OFF_IDS, OFF_BAR = d256::OFF_BAR;
  constexpr int BAR_P_FULL = d256::BAR_P_FULL, BAR_P_FREE = d256::BAR_P_FREE;
  constexpr int BAR_DS_FULL = d256::BAR_DS_FULL, BAR_DS_FREE = d256::BAR_DS_FREE;
  constexpr bool FAST_EXP = F & EXP, CAP = F & SOFTCAP, WIN = F & WINDOW;
  constexpr bool SNAKE = !WIN;  // the group's odd heads walked downwards (snake_block)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t base = smem_u32(smem);
  const Ring ring{base + OFF_K, base + OFF_V, base + OFF_RING, SLOT, base + OFF_IDS,
                  base + OFF_BAR, base + OFF_BAR + 8 * STAGES, base + OFF_BAR + 16 * STAGES};
  const uint32_t bar_full = ring.full, bar_empty = ring.empty, bar_kv = ring.kv;

  // Head dims 256 and 192 launch the kv heads slowest (fused_backward.py's layout_for).
  const int tile = cta_tile(p), kv_head = cta_kv_head(p), b = blockIdx.z;
  const int group = p.heads / p.kv_heads;
  const int n_table = p.s_kv / 128;  // the mask's 128-row kv blocks: this tile's is tile / 2
  const int lo = p.lower[b * n_table + tile / 2], hi = p.upper[b * n_table + tile / 2];
  const int steps_per_head = hi - lo;
  const int steps = steps_per_head * group;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  init_ring_barriers(ring);

  if (wg == 0) {  // ------------------------------------------------------------ producer
    set_max_regs_dec<24>();
    if (t == 0) {
      produce<PIECES, PIECE, PIECE, PIECES, PIECES, Q_BLOCK, SNAKE>(
          p, ring, b * p.s_kv + tile * KV_TILE, kv_head, b, group, lo, steps_per_head, steps);
    }
    return;
  }

  // ------------------------------------------------------------------------------ consumers
  set_max_regs_inc<240>();
  const int c = wg - 1;  // this consumer's head-dim half: columns 128c .. 128c + 127
  const int warp = t / 32, lane = t % 32;
  const int r0 = 16 * warp + lane / 4;  // accumulator rows r0 and r0 + 8 (kv rows of S^T)
  const float sl2 = p.scale * 1.4426950408889634f;
  const bool not_causal = !p.causal;
  const int kv_tok0 = b * p.s_kv + tile * KV_TILE + r0;
  const int kvp0 = p.kv_pos[kv_tok0], kvs0 = p.kv_seg[kv_tok0];
  const int kvp1 = p.kv_pos[kv_tok0 + 8], kvs1 = p.kv_seg[kv_tok0 + 8];

  float dk[64], dv[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;
  // pair i / 2 of thread t at i / 2 * 128 + t
  float2* pt = reinterpret_cast<float2*>(smem + OFF_PT);
  const uint32_t ds = base + OFF_DS;
  auto desc_at = [&](uint32_t addr, uint32_t off, uint32_t lbo) -> uint64_t {
    return desc_sw128(addr + off, lbo, 1024);
  };
  mbar_wait(bar_kv, 0);

  for (int n = 0; n < steps; ++n) {
    const int s = n % STAGES;
    const int head = kv_head * group + n / steps_per_head;
    const int q0 = snake_block<SNAKE>(n, lo, steps_per_head) * Q_BLOCK;
    const uint32_t slot = base + OFF_RING + s * SLOT;
    const float* ids = reinterpret_cast<const float*>(smem + OFF_IDS + s * IDS_SLOT);
    const int* qpos = reinterpret_cast<const int*>(ids);
    const int* qseg = qpos + Q_BLOCK;
    const float* lse = ids + 2 * Q_BLOCK;
    const float* delta = ids + 3 * Q_BLOCK;
    mbar_wait(bar_full + 8 * s, (n / STAGES) & 1);

    // Consumer 0: S^T = K Q^T; consumer 1: dP^T = V dO^T. M = 64 kv rows, N = 64 query rows,
    // K = 256 (16 k16 steps over the 4 column pieces).
    float acc[32];
    {
      const uint32_t a_src = base + (c == 0 ? OFF_K : OFF_V);
      const uint32_t b_src = slot + (c == 0 ? 0 : PIECES * PIECE);
      wg_fence();
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const uint32_t off = (k / 4) * PIECE + (k % 4) * 32;
        wgmma_64x64_ss<HALF, 0, 0>(acc, desc_at(a_src, off, 16), desc_at(b_src, off, 16), k > 0);
      }
      wg_commit();
      wg_wait<0>();
    }

    uint32_t pa[16];  // P^T as 16-bit A fragments (the accumulator's columns 16 kk.. per k step)
    if (c == 0) {
      // P^T from S^T (element i: row r0 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (lane % 4)
      // + i % 2).
      if (n >= 1) named_sync(BAR_P_FREE, 256);  // consumer 1 has read step n - 1's P^T
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * (lane % 4);
        const float2 l2 = *reinterpret_cast<const float2*>(lse + col);
        const int2 qp2 = *reinterpret_cast<const int2*>(qpos + col);
        const int2 qs2 = *reinterpret_cast<const int2*>(qseg + col);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = 4 * j + 2 * half;
          const int kp = half ? kvp1 : kvp0, ks = half ? kvs1 : kvs0;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int qs = e ? qs2.y : qs2.x, qp = e ? qp2.y : qp2.x;
            bool keep = (qs == ks) & (qs != -1) & (not_causal | (kp <= qp));
            if constexpr (WIN) keep &= (qp - kp < p.window) & (!not_causal | (kp - qp < p.window));
            const float neg_lse2 = (e ? l2.y : l2.x) * -1.4426950408889634f;
            if constexpr (CAP) {
              const float th = tanh_of(acc[i + e] * p.scale_over_cap);
              acc[i + e] = exp2_of<FAST_EXP>(keep ? fmaf(th, p.cap_log2e, neg_lse2) : -INFINITY);
            } else {
              acc[i + e] = exp2_of<FAST_EXP>(keep ? fmaf(acc[i + e], sl2, neg_lse2) : -INFINITY);
            }
          }
          pt[(i / 2) * 128 + t] = make_float2(acc[i], acc[i + 1]);
          pa[i / 2] = pack2<HALF>(acc[i], acc[i + 1]);
        }
      }
      named_arrive(BAR_P_FULL, 256);
    } else {
      // dS^T = P^T (dP^T - delta) [(1 - tanh^2) with the soft cap], from consumer 0's P^T.
      uint32_t dsa[16];
      named_sync(BAR_P_FULL, 256);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * (lane % 4);
        const float2 d2 = *reinterpret_cast<const float2*>(delta + col);
        [[maybe_unused]] const float2 l2 = *reinterpret_cast<const float2*>(lse + col);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = 4 * j + 2 * half;
          const float2 pp = pt[(i / 2) * 128 + t];
          pa[i / 2] = pack2<HALF>(pp.x, pp.y);
          float g0 = pp.x, g1 = pp.y;
          if constexpr (CAP) {  // tanh = (log2 P + lse log2 e) / (cap log2 e); P = 0: dS = 0
            const float inv = 1.f / p.cap_log2e;
            float lg0, lg1;
            asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(lg0) : "f"(pp.x));
            asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(lg1) : "f"(pp.y));
            const float th0 = fmaf(l2.x, 1.4426950408889634f, lg0) * inv;
            const float th1 = fmaf(l2.y, 1.4426950408889634f, lg1) * inv;
            g0 = pp.x > 0.f ? pp.x * fmaf(-th0, th0, 1.f) : 0.f;
            g1 = pp.y > 0.f ? pp.y * fmaf(-th1, th1, 1.f) : 0.f;
          }
          dsa[i / 2] = pack2<HALF>(g0 * (acc[i] - d2.x), g1 * (acc[i + 1] - d2.y));
        }
      }
      if (n + 1 < steps) named_arrive(BAR_P_FREE, 256);
      // consumer 0's products have read step n - 1's dS^T
      if (n >= 1) named_sync(BAR_DS_FREE, 256);
      // dS^T [kv][q] by stmatrix (not transposed: memory rows are the accumulator's kv rows).
      // Register pair 4g + m is matrix m of x4 call g: kv rows 16 warp + 8 (m % 2) .., query
      // columns 8 (2g + m / 2) ..; lane l gives the address of row l % 8 of matrix l / 8.
      {
        const int m = lane / 8, k = lane % 8;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          const uint32_t addr = ds + sw128_offset(16 * warp + 8 * (m % 2) + k, 8 * (2 * g + m / 2));
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                       ::"r"(addr), "r"(dsa[4 * g]), "r"(dsa[4 * g + 1]), "r"(dsa[4 * g + 2]),
                       "r"(dsa[4 * g + 3])
                       : "memory");
        }
      }
      fence_async_smem();
      named_arrive(BAR_DS_FULL, 256);
    }
    // Both consumers run the same products from here (the role branches above hold no wgmma:
    // one in a divergent path makes ptxas serialize them all). dV_c += P^T dO[:, 128c:] (M = 64
    // kv, N = 128, K = 64 query rows; P^T from registers, dO MN-major).
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wgmma_64xN_rs<HALF, 128>(dv, a, desc_at(slot, (PIECES + 2 * c) * PIECE + kk * 2048, PIECE));
    }
    wg_commit();
    if (c == 0) named_sync(BAR_DS_FULL, 256);  // consumer 1's dS^T is written
    // dK_c += dS^T Q[:, 128c:] (dS^T from shared memory, K-major; Q MN-major).
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wgmma_64x128_ss<HALF, 0, 1>(dk, desc_at(ds, kk * 32, 16),
                                  desc_at(slot, 2 * c * PIECE + kk * 2048, PIECE), 1);
    }
    wg_commit();
    // dQ[:, 128c + 64j : + 64] = dS K[:, ...] for j = 0, 1 (M = 64 query rows, N = 64, K = 64 kv
    // rows; A = dS, the MN-major view of dS^T; B = K's column piece 2c + j, MN-major), each
    // reduce-added into dq_accum[b, head, 2c + j, q0 / 64] (red_add_part's order). Both parts
    // are in flight at once, each reduce-added as soon as it is done.
    {
      float dq0[32], dq1[32];
      const uint32_t k_piece = base + OFF_K + 2 * c * PIECE;
      wg_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wgmma_64x64_ss<HALF, 1, 1>(dq0, desc_at(ds, k * 2048, PIECE),
                                   desc_at(k_piece, k * 2048, PIECE), k > 0);
      wg_commit();
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wgmma_64x64_ss<HALF, 1, 1>(dq1, desc_at(ds, k * 2048, PIECE),
                                   desc_at(k_piece + PIECE, k * 2048, PIECE), k > 0);
      wg_commit();
      float* dst = p.dq_accum +
                   ((((static_cast<size_t>(b) * p.heads + head) * PIECES + 2 * c) * p.s_q) + q0) *
                       64;
      wg_wait<1>();
      if (t == 0) mbar_arrive(bar_empty + 8 * s);
      red_add_part(dst, dq0, t);
      wg_wait<0>();
      if (c == 0 && n + 1 < steps) named_arrive(BAR_DS_FREE, 256);
      dst += static_cast<size_t>(p.s_q) * 64;
      red_add_part(dst, dq1, t);
    }
  }

  // dK (scaled) and dV: rows r0 + 8 ((i / 2) % 2) of the tile, columns 128c + 8 (i / 4)
  // + 2 (lane % 4).
  const int done_tile = cta_tile(p), done_kv_head = cta_kv_head(p);
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const int row = done_tile * KV_TILE + r0 + 8 * ((i / 2) % 2);
    const int col = 128 * c + 8 * (i / 4) + 2 * (lane % 4);
    const size_t off =
        ((static_cast<size_t>(b) * p.s_kv + row) * p.kv_heads + done_kv_head) * HD + col;
    reinterpret_cast<uint32_t*>(p.dk)[off / 2] = pack2<HALF>(dk[i] * p.scale, dk[i + 1] * p.scale);
    reinterpret_cast<uint32_t*>(p.dv)[off / 2] = pack2<HALF>(dv[i], dv[i + 1]);
  }
}

// ---------------------------------------------------------------------------------------------
// MLA head dims (192 for Q / K, 128 for V / dO): head dim 256's layout with the products dealt
// by kind instead of by head-dim half
// ---------------------------------------------------------------------------------------------
// As at head dim 256, a CTA owns 64 kv rows, consumer 0 computes S^T = K Q^T and P^T (handed
// over in shared memory as float32 in fragment order), consumer 1 dP^T = V dO^T and dS^T.
// Consumer 1 stores dS twice: dS^T [kv][q] (stmatrix) and dS [q][kv] (stmatrix .trans), so that
// dK's and dQ's products read their A operand K-major alike. Then both consumers run the same
// instructions on different operands:
//   dV[:, 64c : 64c + 64] += P^T dO[:, 64c :]   (P^T from registers; dO's piece c)
//   acc[j] for j = 0, 1, 2 (64 columns each): consumer 0 dK[:, 64j :] += dS^T Q[:, 64j :] (kept
//     over the steps), consumer 1 dQ[:, 64j :] = dS K[:, 64j :] (fresh each step, reduce-added
//     into dq_accum from registers as each finishes).
// A wgmma on a path only one consumer takes makes ptxas serialize them all (C7520; a loop whose
// trip count depends on the consumer does too), so the first
// products have the same trip count: consumer 1's dP^T contracts over 128 columns, S^T
// over 192, and consumer 1 runs its last 4 k steps on a zero piece (the tensor cores' work per
// step grows from 52 to 56 wgmma k steps of 64 x 64 x 16).
// The P^T and dS^T element loops repeat head dim 256's: one shared device function gave the
// same PTX up to operand order but made ptxas spill in head dim 256's plain kernels.
namespace mla {
constexpr int DQK = 192, DV = 128;
constexpr int KV_TILE = 64;
constexpr int PIECE = 64 * 64 * 2;                   // [64 rows][64 cols] 16-bit, 128B swizzle
constexpr int QK_PIECES = DQK / 64, V_PIECES = DV / 64;
constexpr int OFF_K = 0;                             // K: 3 column pieces; V: 2
constexpr int OFF_V = OFF_K + QK_PIECES * PIECE;
constexpr int OFF_RING = OFF_V + V_PIECES * PIECE;   // per stage: Q pieces 0-2, dO pieces 3-4
constexpr int SLOT = (QK_PIECES + V_PIECES) * PIECE;
constexpr int OFF_PT = OFF_RING + STAGES * SLOT;     // P^T float32 [64 x 64], fragment order
constexpr int OFF_DST = OFF_PT + 64 * 64 * 4;        // dS^T [64 kv][64 q], 128B swizzle
constexpr int OFF_DSN = OFF_DST + PIECE;             // dS [64 q][64 kv], 128B swizzle
constexpr int OFF_ZERO = OFF_DSN + PIECE;            // a zero piece (consumer 1's padding steps)
constexpr int OFF_IDS = OFF_ZERO + PIECE;
constexpr int OFF_BAR = OFF_IDS + STAGES * IDS_SLOT;
constexpr int SMEM_BYTES = OFF_BAR + 8 * (2 * STAGES + 1) + 1024;  // + alignment slack
static_assert(SMEM_BYTES <= 227 * 1024, "MLA: shared memory over the 227 KiB limit");
constexpr int K_STEPS = DQK / 16;                    // S^T's k16 steps; dP^T has DV / 16 real ones
// Named barriers as at head dim 256; ZERO_READY: consumer 1's threads have zeroed the piece
constexpr int BAR_P_FULL = 4, BAR_P_FREE = 5, BAR_DS_FULL = 6, BAR_DS_FREE = 7, BAR_ZERO = 8;
}  // namespace mla

template <int F, bool HALF>
__global__ void __launch_bounds__(THREADS, 1)
    backward_mla_kernel(const __grid_constant__ Params p) {
  constexpr int KV_TILE = mla::KV_TILE, PIECE = mla::PIECE;
  constexpr int QK_PIECES = mla::QK_PIECES, V_PIECES = mla::V_PIECES;
  constexpr int OFF_K = mla::OFF_K, OFF_V = mla::OFF_V, OFF_RING = mla::OFF_RING;
  constexpr int SLOT = mla::SLOT, OFF_PT = mla::OFF_PT, OFF_IDS = mla::OFF_IDS;
  constexpr int OFF_BAR = mla::OFF_BAR;
  constexpr int BAR_P_FULL = mla::BAR_P_FULL, BAR_P_FREE = mla::BAR_P_FREE;
  constexpr int BAR_DS_FULL = mla::BAR_DS_FULL, BAR_DS_FREE = mla::BAR_DS_FREE;
  constexpr bool FAST_EXP = F & EXP, CAP = F & SOFTCAP, WIN = F & WINDOW;
  constexpr bool SNAKE = !WIN;  // the group's odd heads walked downwards (snake_block)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t base = smem_u32(smem);
  const Ring ring{base + OFF_K, base + OFF_V, base + OFF_RING, SLOT, base + OFF_IDS,
                  base + OFF_BAR, base + OFF_BAR + 8 * STAGES, base + OFF_BAR + 16 * STAGES};
  const uint32_t bar_full = ring.full, bar_empty = ring.empty, bar_kv = ring.kv;

  // Head dims 256 and 192 launch the kv heads slowest (fused_backward.py's layout_for).
  const int tile = cta_tile(p), kv_head = cta_kv_head(p), b = blockIdx.z;
  const int group = p.heads / p.kv_heads;
  const int n_table = p.s_kv / 128;  // the mask's 128-row kv blocks: this tile's is tile / 2
  const int lo = p.lower[b * n_table + tile / 2], hi = p.upper[b * n_table + tile / 2];
  const int steps_per_head = hi - lo;
  const int steps = steps_per_head * group;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  init_ring_barriers(ring);

  if (wg == 0) {  // ------------------------------------------------------------ producer
    set_max_regs_dec<24>();
    if (t == 0) {
      produce<QK_PIECES, PIECE, PIECE, QK_PIECES, V_PIECES, Q_BLOCK, SNAKE, true>(
          p, ring, b * p.s_kv + tile * KV_TILE, kv_head, b, group, lo, steps_per_head, steps);
    }
    return;
  }

  // ------------------------------------------------------------------------------ consumers
  set_max_regs_inc<240>();
  const int c = wg - 1;
  const int warp = t / 32, lane = t % 32;
  const int r0 = 16 * warp + lane / 4;  // accumulator rows r0 and r0 + 8 (kv rows of S^T)
  const float sl2 = p.scale * 1.4426950408889634f;
  const bool not_causal = !p.causal;
  const int kv_tok0 = b * p.s_kv + tile * KV_TILE + r0;
  const int kvp0 = p.kv_pos[kv_tok0], kvs0 = p.kv_seg[kv_tok0];
  const int kvp1 = p.kv_pos[kv_tok0 + 8], kvs1 = p.kv_seg[kv_tok0 + 8];

  float dv[32], acc3[3][32];  // acc3: consumer 0's dK (kept), consumer 1's dQ parts (per step)
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    dv[i] = 0.f;
    acc3[0][i] = acc3[1][i] = acc3[2][i] = 0.f;
  }
  // pair i / 2 of thread t at i / 2 * 128 + t
  float2* pt = reinterpret_cast<float2*>(smem + OFF_PT);
  const uint32_t ds_t = base + mla::OFF_DST, ds_n = base + mla::OFF_DSN;
  const uint32_t zero = base + mla::OFF_ZERO;
  auto desc_at = [&](uint32_t addr, uint32_t off, uint32_t lbo) -> uint64_t {
    return desc_sw128(addr + off, lbo, 1024);
  };
  if (c == 1) {  // the zero piece, visible to the tensor cores (async proxy) before step 0
    uint4* z = reinterpret_cast<uint4*>(smem + mla::OFF_ZERO);
    for (int i = t; i < PIECE / 16; i += 128) z[i] = make_uint4(0, 0, 0, 0);
    fence_async_smem();
    named_sync(mla::BAR_ZERO, 128);
  }
  mbar_wait(bar_kv, 0);

  for (int n = 0; n < steps; ++n) {
    const int s = n % STAGES;
    // Read at each step, not held: the faster way for MLA's kernel (head dim 256's holds it).
    const int head = cta_kv_head(p) * group + n / steps_per_head;
    const int q0 = snake_block<SNAKE>(n, lo, steps_per_head) * Q_BLOCK;
    const uint32_t slot = base + OFF_RING + s * SLOT;
    const float* ids = reinterpret_cast<const float*>(smem + OFF_IDS + s * IDS_SLOT);
    const int* qpos = reinterpret_cast<const int*>(ids);
    const int* qseg = qpos + Q_BLOCK;
    const float* lse = ids + 2 * Q_BLOCK;
    const float* delta = ids + 3 * Q_BLOCK;
    mbar_wait(bar_full + 8 * s, (n / STAGES) & 1);

    // Consumer 0: S^T = K Q^T (K = 192); consumer 1: dP^T = V dO^T (K = 128, then 4 k steps on
    // the zero piece). M = 64 kv rows, N = 64 query rows.
    float acc[32];
    {
      const uint32_t a_src = base + (c == 0 ? OFF_K : OFF_V);
      const uint32_t b_src = slot + (c == 0 ? 0 : QK_PIECES * PIECE);
      wg_fence();
#pragma unroll
      for (int k = 0; k < mla::K_STEPS; ++k) {
        const uint32_t off = (k / 4) * PIECE + (k % 4) * 32;
        const bool pad = c == 1 && k >= 4 * V_PIECES;
        const uint32_t a = pad ? zero + (k % 4) * 32 : a_src + off;
        const uint32_t bb = pad ? zero + (k % 4) * 32 : b_src + off;
        wgmma_64x64_ss<HALF, 0, 0>(acc, desc_sw128(a, 16, 1024), desc_sw128(bb, 16, 1024), k > 0);
      }
      wg_commit();
      wg_wait<0>();
    }

    uint32_t pa[16];  // P^T as 16-bit A fragments
    if (c == 0) {
      if (n >= 1) named_sync(BAR_P_FREE, 256);  // consumer 1 has read step n - 1's P^T
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * (lane % 4);
        const float2 l2 = *reinterpret_cast<const float2*>(lse + col);
        const int2 qp2 = *reinterpret_cast<const int2*>(qpos + col);
        const int2 qs2 = *reinterpret_cast<const int2*>(qseg + col);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = 4 * j + 2 * half;
          const int kp = half ? kvp1 : kvp0, ks = half ? kvs1 : kvs0;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int qs = e ? qs2.y : qs2.x, qp = e ? qp2.y : qp2.x;
            bool keep = (qs == ks) & (qs != -1) & (not_causal | (kp <= qp));
            if constexpr (WIN) keep &= (qp - kp < p.window) & (!not_causal | (kp - qp < p.window));
            const float neg_lse2 = (e ? l2.y : l2.x) * -1.4426950408889634f;
            if constexpr (CAP) {
              const float th = tanh_of(acc[i + e] * p.scale_over_cap);
              acc[i + e] = exp2_of<FAST_EXP>(keep ? fmaf(th, p.cap_log2e, neg_lse2) : -INFINITY);
            } else {
              acc[i + e] = exp2_of<FAST_EXP>(keep ? fmaf(acc[i + e], sl2, neg_lse2) : -INFINITY);
            }
          }
          pt[(i / 2) * 128 + t] = make_float2(acc[i], acc[i + 1]);
          pa[i / 2] = pack2<HALF>(acc[i], acc[i + 1]);
        }
      }
      named_arrive(BAR_P_FULL, 256);
    } else {
      uint32_t dsa[16];
      named_sync(BAR_P_FULL, 256);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * (lane % 4);
        const float2 d2 = *reinterpret_cast<const float2*>(delta + col);
        [[maybe_unused]] const float2 l2 = *reinterpret_cast<const float2*>(lse + col);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = 4 * j + 2 * half;
          const float2 pp = pt[(i / 2) * 128 + t];
          pa[i / 2] = pack2<HALF>(pp.x, pp.y);
          float g0 = pp.x, g1 = pp.y;
          if constexpr (CAP) {  // tanh = (log2 P + lse log2 e) / (cap log2 e); P = 0: dS = 0
            const float inv = 1.f / p.cap_log2e;
            float lg0, lg1;
            asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(lg0) : "f"(pp.x));
            asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(lg1) : "f"(pp.y));
            const float th0 = fmaf(l2.x, 1.4426950408889634f, lg0) * inv;
            const float th1 = fmaf(l2.y, 1.4426950408889634f, lg1) * inv;
            g0 = pp.x > 0.f ? pp.x * fmaf(-th0, th0, 1.f) : 0.f;
            g1 = pp.y > 0.f ? pp.y * fmaf(-th1, th1, 1.f) : 0.f;
          }
          dsa[i / 2] = pack2<HALF>(g0 * (acc[i] - d2.x), g1 * (acc[i + 1] - d2.y));
        }
      }
      if (n + 1 < steps) named_arrive(BAR_P_FREE, 256);
      // consumer 0's products have read step n - 1's dS^T
      if (n >= 1) named_sync(BAR_DS_FREE, 256);
      // Register pair 4g + m is matrix m of x4 call g: kv rows R = 16 warp + 8 (m % 2) .., query
      // columns C = 8 (2g + m / 2) ..; lane l gives the address of row l % 8 of matrix l / 8:
      // dS^T's row R + l % 8 (plain), dS's row C + l % 8 (.trans, the 8 kv values of column).
      {
        const int m = lane / 8, k = lane % 8;
        const int row_kv = 16 * warp + 8 * (m % 2);
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          const int col_q = 8 * (2 * g + m / 2);
          const uint32_t at = ds_t + sw128_offset(row_kv + k, col_q);
          const uint32_t an = ds_n + sw128_offset(col_q + k, row_kv);
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                       ::"r"(at), "r"(dsa[4 * g]), "r"(dsa[4 * g + 1]), "r"(dsa[4 * g + 2]),
                       "r"(dsa[4 * g + 3])
                       : "memory");
          asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                       ::"r"(an), "r"(dsa[4 * g]), "r"(dsa[4 * g + 1]), "r"(dsa[4 * g + 2]),
                       "r"(dsa[4 * g + 3])
                       : "memory");
        }
      }
      fence_async_smem();
      named_arrive(BAR_DS_FULL, 256);
    }
    // Both consumers: dV[:, 64c :] += P^T dO[:, 64c :] (M = 64 kv, N = 64, K = 64 query rows).
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wgmma_64xN_rs<HALF, 64>(dv, a, desc_at(slot, (QK_PIECES + c) * PIECE + kk * 2048, PIECE));
    }
    wg_commit();
    if (c == 0) named_sync(BAR_DS_FULL, 256);  // consumer 1's dS^T / dS are written
    // acc3[j] (+)= A B_j, K = 64 (kv rows for dQ, query rows for dK), both operands' layouts
    // alike: A K-major (dS^T for consumer 0, dS for consumer 1), B MN-major (Q's piece j from
    // the slot for consumer 0, K's piece j for consumer 1).
    {
      const uint32_t a_src = c == 0 ? ds_t : ds_n;
      const uint32_t b_src = c == 0 ? slot : base + OFF_K;
      const int keep_acc = c == 0;
#pragma unroll
      for (int j = 0; j < 3; ++j) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma_64x64_ss<HALF, 0, 1>(acc3[j], desc_at(a_src, kk * 32, 16),
                                     desc_at(b_src, j * PIECE + kk * 2048, PIECE),
                                     keep_acc | (kk > 0));
        }
        wg_commit();
      }
    }
    // Consumer 1 reduce-adds each dQ part as it finishes: dq_accum[b, head, j, q0 / 64], in
    // red_add_part's order. The slot (Q, dO) is free once dV (consumer 1) / dK (consumer 0) are
    // done.
    float* dst = p.dq_accum +
                 ((((static_cast<size_t>(b) * p.heads + head) * QK_PIECES) * p.s_q) + q0) * 64;
    const size_t part = static_cast<size_t>(p.s_q) * 64;
    wg_wait<2>();
    if (c == 1) {
      if (t == 0) mbar_arrive(bar_empty + 8 * s);
      red_add_part(dst, acc3[0], t);
    }
    wg_wait<1>();
    if (c == 1) red_add_part(dst + part, acc3[1], t);
    wg_wait<0>();
    if (c == 0) {
      if (t == 0) mbar_arrive(bar_empty + 8 * s);
      if (n + 1 < steps) named_arrive(BAR_DS_FREE, 256);
    } else {
      red_add_part(dst + 2 * part, acc3[2], t);
    }
  }

  // dK (scaled; consumer 0, 3 pieces) and dV (piece c): rows r0 + 8 ((i / 2) % 2) of the tile,
  // columns 64 piece + 8 (i / 4) + 2 (lane % 4).
  const int done_tile = cta_tile(p), done_kv_head = cta_kv_head(p);
  const size_t kv_row = static_cast<size_t>(b) * p.s_kv + done_tile * KV_TILE;
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const int row = r0 + 8 * ((i / 2) % 2);
    const int col = 8 * (i / 4) + 2 * (lane % 4);
    const size_t tok = (kv_row + row) * p.kv_heads + done_kv_head;
    reinterpret_cast<uint32_t*>(p.dv)[(tok * mla::DV + 64 * c + col) / 2] =
        pack2<HALF>(dv[i], dv[i + 1]);
    if (c == 0) {
#pragma unroll
      for (int j = 0; j < 3; ++j)
        reinterpret_cast<uint32_t*>(p.dk)[(tok * mla::DQK + 64 * j + col) / 2] =
            pack2<HALF>(acc3[j][i] * p.scale, acc3[j][i + 1] * p.scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: tensor maps and the FFI handler
// ---------------------------------------------------------------------------------------------
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiled encode_fn() {
  static EncodeTiled fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    // The 12.0 ABI of the symbol, whatever the runtime's version (the image's driver is 13.0,
    // this runtime 13.5).
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiled>(ptr);
  });
  return fn;
}

// A [rows, heads, hd] 16-bit tensor (bf16, or fp16 when half) as a 3-D map (d, head, row)
// with a (64, 1, box_rows) box. Returns 0 on success, -1 without the driver entry point, else
// the CUresult.
static int make_map(CUtensorMap* map, const void* data, int64_t rows, int64_t heads,
                    uint32_t box_rows, bool half, int64_t hd) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(hd), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(hd) * 2,
                                 static_cast<cuuint64_t>(heads) * hd * 2};
  const cuuint32_t box[3] = {64, 1, box_rows};
  const cuuint32_t elem[3] = {1, 1, 1};
  EncodeTiled fn = encode_fn();
  if (!fn) return -1;
  return static_cast<int>(fn(map, half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                  : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(data),
                             dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
}

// The feature sets built: v7 (fused_backward.py's VARIANTS), alone and with the soft cap and / or the window, and with the mask
// in the loop (MASK_IN_LOOP, alone and with the window), each for bf16 and fp16, at head dims
// 128 and 64; the head dim 256 and MLA kernels (their own layouts, "wide") the first four
// without DECOUPLE (40 kernels; ptxas takes about a second each).
#define KVAX_SM90_V7 (STM | FRAG | EXP | DECOUPLE_BIT)
#define KVAX_SM90_VARIANTS                                                                     \
  KVAX_SM90_V7, KVAX_SM90_V7 | SOFTCAP, KVAX_SM90_V7 | WINDOW, KVAX_SM90_V7 | SOFTCAP | WINDOW, \
      KVAX_SM90_V7 | MASK_IN_LOOP, KVAX_SM90_V7 | MASK_IN_LOOP | WINDOW
#define KVAX_SM90_V7_WIDE (STM | FRAG | EXP)
#define KVAX_SM90_VARIANTS_WIDE                                                                \
  KVAX_SM90_V7_WIDE, KVAX_SM90_V7_WIDE | SOFTCAP, KVAX_SM90_V7_WIDE | WINDOW,                  \
      KVAX_SM90_V7_WIDE | SOFTCAP | WINDOW

// The dynamic shared-memory limit is a per-device attribute of each kernel: set once per device
// and variant (a process driving several GPUs calls the handler from one thread per device;
// set for the first device only, the others' launches fail).
constexpr int MAX_DEVICES = 64;

template <int F, bool HALF, int HD>
static cudaError_t launch_one(int device, const dim3& grid, const Params& p, cudaStream_t stream) {
  static std::mutex mu;  // one per instantiation
  static bool attr_set[MAX_DEVICES] = {};
  // Head dim 256 and MLA's 192 / 128 (HD = 192) have their own kernels and shared-memory plans.
  constexpr auto kernel = [] {
    if constexpr (HD == 256) {
      return backward_d256_kernel<F, HALF>;
    } else if constexpr (HD == 192) {
      return backward_mla_kernel<F, HALF>;
    } else {
      return fused_backward_kernel<F, HALF, HD>;
    }
  }();
  constexpr int smem_bytes = [] {
    if constexpr (HD == 256) {
      return d256::SMEM_BYTES;
    } else if constexpr (HD == 192) {
      return mla::SMEM_BYTES;
    } else {
      return Plan<HD>::SMEM_BYTES;
    }
  }();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!attr_set[device]) {
      const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
      if (err != cudaSuccess) return err;
      attr_set[device] = true;
    }
  }
  kernel<<<grid, THREADS, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <bool HALF, int HD, int... Fs>
static bool launch(int variant, int device, const dim3& grid, const Params& p,
                   cudaStream_t stream, cudaError_t* err) {
  return ((variant == Fs ? (*err = launch_one<Fs, HALF, HD>(device, grid, p, stream), true)
                         : false) ||
          ...);
}

static ffi::Error FusedBackwardImpl(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> lse,
    ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> q_seg,
    ffi::Buffer<ffi::S32> kv_pos, ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> lower,
    ffi::Buffer<ffi::S32> upper, ffi::Buffer<ffi::S32> full_lower,
    ffi::Buffer<ffi::S32> full_upper, ffi::Buffer<ffi::S32> order, float scale, int32_t causal,
    int32_t variant, float soft_cap, int32_t window, ffi::Result<ffi::AnyBuffer> dk,
    ffi::Result<ffi::AnyBuffer> dv,
    ffi::ResultBuffer<ffi::F32> dq_accum) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto od = d_out.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || od.size() != 4 || kd[3] != qd[3] ||
      vd[3] != od[3] || !((qd[3] == vd[3] && (qd[3] == 64 || qd[3] == 128 || qd[3] == 256)) ||
                          (qd[3] == 192 && vd[3] == 128)))
    return ffi::Error::InvalidArgument(
        "q, k, v, d_out: expected [B, S, heads, D], head dims (q / k, v / d_out) (64, 64), "
        "(128, 128), (256, 256) or (192, 128)");
  const int64_t hd = qd[3], hd_v = vd[3];
  const auto ad = dq_accum->dimensions();
  if (ad.size() != 5 || ad[0] != qd[0] || ad[1] != qd[2] || ad[2] != hd / 64 ||
      ad[3] * 64 != qd[1] || ad[4] != 64 * 64)
    return ffi::Error::InvalidArgument("dq_accum: expected [B, H, head dim / 64, Sq / 64, 4096]");
  const int64_t b = qd[0], sq = qd[1], h = qd[2], skv = kd[1], kh = kd[2];
  if (kd[0] != b || sq % KV_TILE || skv % KV_TILE || h % kh)
    return ffi::Error::InvalidArgument(
        "expected one batch size, Sq and Skv multiples of 128, and query heads a multiple of "
        "kv heads");
  const ffi::DataType type = q.element_type();
  if ((type != ffi::DataType::BF16 && type != ffi::DataType::F16) || k.element_type() != type ||
      v.element_type() != type || d_out.element_type() != type || dk->element_type() != type ||
      dv->element_type() != type)
    return ffi::Error::InvalidArgument(
        "q, k, v, d_out, dk, dv: expected one type, bfloat16 or float16");
  const bool half = type == ffi::DataType::F16;
  if (((variant & SOFTCAP) != 0) != (soft_cap > 0.f) || ((variant & WINDOW) != 0) != (window > 0))
    return ffi::Error::InvalidArgument("variant: its SOFTCAP / WINDOW bits must match soft_cap > 0 "
                                       "and window > 0");
  Params p{};
  // kv rows per CTA
  const uint32_t kv_tile = hd == 256 ? d256::KV_TILE : (hd == 192 ? mla::KV_TILE : KV_TILE);
  const auto order_d = order.dimensions();
  if (order_d.size() != 2 || order_d[0] != b || order_d[1] != kh * (skv / kv_tile))
    return ffi::Error::InvalidArgument(
        "order: expected [B, kv heads * Skv / kv tile] (fused_backward.launch_order)");
  if (skv / kv_tile > (1 << ORDER_TILE_BITS) || kh > (1 << (31 - ORDER_TILE_BITS)))
    return ffi::Error::InvalidArgument(
        "order: its entries code (kv head, tile) in 32 bits: expected at most 2^20 kv tiles and "
        "2^11 kv heads");
  const int rc[4] = {make_map(&p.tm_q, q.untyped_data(), b * sq, h, Q_BLOCK, half, hd),
                     make_map(&p.tm_do, d_out.untyped_data(), b * sq, h, Q_BLOCK, half, hd_v),
                     make_map(&p.tm_k, k.untyped_data(), b * skv, kh, kv_tile, half, hd),
                     make_map(&p.tm_v, v.untyped_data(), b * skv, kh, kv_tile, half, hd_v)};
  for (int i = 0; i < 4; ++i)
    if (rc[i] != 0)
      return ffi::Error::Internal(
          std::string("cuTensorMapEncodeTiled (q, d_out, k, v)[") + std::to_string(i) +
          "]: " + (rc[i] == -1 ? "no driver entry point" : "CUresult " + std::to_string(rc[i])));
  p.q_pos = q_pos.typed_data();
  p.q_seg = q_seg.typed_data();
  p.kv_pos = kv_pos.typed_data();
  p.kv_seg = kv_seg.typed_data();
  p.lse = lse.typed_data();
  p.delta = delta.typed_data();
  p.lower = lower.typed_data();
  p.upper = upper.typed_data();
  p.full_lower = full_lower.typed_data();
  p.full_upper = full_upper.typed_data();
  p.order = order.typed_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dq_accum = dq_accum->typed_data();
  p.s_q = static_cast<int>(sq);
  p.s_kv = static_cast<int>(skv);
  p.heads = static_cast<int>(h);
  p.kv_heads = static_cast<int>(kh);
  p.scale = scale;
  p.causal = causal;
  p.window = window;
  p.cap_log2e = soft_cap * 1.4426950408889634f;
  p.scale_over_cap = soft_cap > 0.f ? scale / soft_cap : 0.f;
  // The runtime API below (the attribute, the memset, the launch) acts on the calling thread's
  // current device: it must be the stream's (XLA makes it so; checked, not assumed).
  int device = -1, stream_device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || cudaStreamGetDevice(stream, &stream_device) !=
      cudaSuccess)
    return ffi::Error::Internal(std::string("cudaGetDevice / cudaStreamGetDevice: ") +
                                cudaGetErrorString(cudaGetLastError()));
  if (device != stream_device || device < 0 || device >= MAX_DEVICES)
    return ffi::Error::Internal("the current device (" + std::to_string(device) +
                                ") is not the stream's (" + std::to_string(stream_device) + ")");
  cudaError_t err = cudaMemsetAsync(p.dq_accum, 0, dq_accum->size_bytes(), stream);
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  // One CTA per (kv head, kv tile) of each batch row, in `order`'s sequence: the host chooses
  // which pairs are in flight together (fused_backward.py's launch_order).
  const dim3 grid(static_cast<unsigned>(kh * (skv / kv_tile)), 1, static_cast<unsigned>(b));
  bool launched;
  if (hd == 128 && half)
    launched = launch<true, 128, KVAX_SM90_VARIANTS>(variant, device, grid, p, stream, &err);
  else if (hd == 128)
    launched = launch<false, 128, KVAX_SM90_VARIANTS>(variant, device, grid, p, stream, &err);
  else if (hd == 64 && half)
    launched = launch<true, 64, KVAX_SM90_VARIANTS>(variant, device, grid, p, stream, &err);
  else if (hd == 64)
    launched = launch<false, 64, KVAX_SM90_VARIANTS>(variant, device, grid, p, stream, &err);
  else if (hd == 256 && half)
    launched = launch<true, 256, KVAX_SM90_VARIANTS_WIDE>(variant, device, grid, p, stream, &err);
  else if (hd == 256)
    launched = launch<false, 256, KVAX_SM90_VARIANTS_WIDE>(variant, device, grid, p, stream, &err);
  else if (half)
    launched = launch<true, 192, KVAX_SM90_VARIANTS_WIDE>(variant, device, grid, p, stream, &err);
  else
    launched = launch<false, 192, KVAX_SM90_VARIANTS_WIDE>(variant, device, grid, p, stream, &err);
  if (!launched)
    return ffi::Error::InvalidArgument("variant: not one of the feature sets built "
                                       "(fused_backward.py VARIANTS)");
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// dq from dq_accum: dq [B, Sq, H, D] (q's type) = scale * dq_accum, each 64 x 64 part moved from
// its staging order to row-major, and 0 on the rows whose lse is +inf (nothing to attend, or the
// padding rows): one pass over dq_accum, where the separate transpose, scale, cast and select of
// XLA's fusion moved the same bytes at about half the bandwidth. Block i of a part holds
// accumulator run i (8 floats): FRAG (head dims 64 / 128) stages run (a0, a1, a2, a3) (sizes 8, 2,
// 4, 8, a0 slowest) at row 16 a2 + 8 a1 + a3, columns 8 a0 .. 8 a0 + 7, contiguous; the wide
// kernels' vector order stages element (c0, c1, c2, c3, c4, c5) (sizes 8, 4, 8, 4, 2, 2) at row
// 16 c1 + 8 c4 + c2, column 8 c0 + 2 c3 + c5 (fused_backward.py unpermute_*_order).
constexpr int DQ_THREADS = 256;

template <bool HALF, bool VECTOR_ORDER>
__global__ void __launch_bounds__(DQ_THREADS)
    dq_from_accum_kernel(const float* __restrict__ accum, const float* __restrict__ lse,
                         void* __restrict__ dq, int s_q, int heads, int parts, float scale) {
  const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, blocks = s_q / 64;
  // Thread order: the 8 column groups fastest, then the rows, so that 8 lanes write a row's 64
  // columns of a part (128 contiguous bytes) and, in FRAG, a warp's 4 rows of one column group
  // read 4 neighbouring runs (128 contiguous bytes).
  for (int i = threadIdx.x; i < parts * 512; i += DQ_THREADS) {
    const int part = i / 512, g = i % 8, row = (i / 8) % 64;
    const float* src = accum + ((((int64_t)b * heads + h) * parts + part) * blocks + blk) * 4096;
    float x[8];
    if constexpr (VECTOR_ORDER) {
      // Row 16 c1 + 8 c4 + c2, columns 8 g + 2 c3 + c5: pairs (c5) contiguous.
      const int c1 = row / 16, c4 = (row / 8) % 2, c2 = row % 8;
#pragma unroll
      for (int c3 = 0; c3 < 4; ++c3) {
        const float2 v = *reinterpret_cast<const float2*>(
            src + ((((g * 4 + c1) * 8 + c2) * 4 + c3) * 2 + c4) * 2);
        x[2 * c3] = v.x;
        x[2 * c3 + 1] = v.y;
      }
    } else {
      const int a2 = row / 16, a1 = (row / 8) % 2, a3 = row % 8;
      const float4* run =
          reinterpret_cast<const float4*>(src + (((g * 2 + a1) * 4 + a2) * 8 + a3) * 8);
      const float4 v0 = run[0], v1 = run[1];
      x[0] = v0.x, x[1] = v0.y, x[2] = v0.z, x[3] = v0.w;
      x[4] = v1.x, x[5] = v1.y, x[6] = v1.z, x[7] = v1.w;
    }
    const int s = blk * 64 + row;
    const float row_lse = lse[((int64_t)b * heads + h) * s_q + s];
    uint4 out = make_uint4(0, 0, 0, 0);  // +inf lse: exactly 0, even where dS K held 0 * NaN
    if (!(isinf(row_lse) && row_lse > 0.f)) {
      out.x = pack2<HALF>(x[0] * scale, x[1] * scale);
      out.y = pack2<HALF>(x[2] * scale, x[3] * scale);
      out.z = pack2<HALF>(x[4] * scale, x[5] * scale);
      out.w = pack2<HALF>(x[6] * scale, x[7] * scale);
    }
    uint16_t* dst = static_cast<uint16_t*>(dq) +
                    (((int64_t)b * s_q + s) * heads + h) * (parts * 64) + part * 64 + g * 8;
    *reinterpret_cast<uint4*>(dst) = out;
  }
}

static ffi::Error DqFromAccumImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> dq_accum,
                                  ffi::Buffer<ffi::F32> lse, float scale, int32_t vector_order,
                                  ffi::Result<ffi::AnyBuffer> dq) {
  const auto ad = dq_accum.dimensions(), ld = lse.dimensions(), dd = dq->dimensions();
  if (ad.size() != 5 || ad[4] != 64 * 64)
    return ffi::Error::InvalidArgument("dq_accum: expected [B, H, head dim / 64, Sq / 64, 4096]");
  const int64_t b = ad[0], h = ad[1], parts = ad[2], sq = ad[3] * 64;
  if (ld.size() != 3 || ld[0] != b || ld[1] != h || ld[2] != sq)
    return ffi::Error::InvalidArgument("lse: expected [B, H, Sq] (dq_accum's B, H and Sq)");
  if (dd.size() != 4 || dd[0] != b || dd[1] != sq || dd[2] != h || dd[3] != parts * 64)
    return ffi::Error::InvalidArgument("dq: expected [B, Sq, H, head dim] (dq_accum's)");
  const ffi::DataType type = dq->element_type();
  if (type != ffi::DataType::BF16 && type != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("dq: expected bfloat16 or float16");
  if (b == 0 || h == 0 || sq == 0) return ffi::Error::Success();
  const dim3 grid(static_cast<unsigned>(sq / 64), static_cast<unsigned>(h),
                  static_cast<unsigned>(b));
  const bool half = type == ffi::DataType::F16;
  const int args_sq = static_cast<int>(sq), args_h = static_cast<int>(h);
  const int args_parts = static_cast<int>(parts);
  // The instantiation for the output type and staging order.
  void (*const kernel)(const float*, const float*, void*, int, int, int, float) =
      half ? (vector_order ? dq_from_accum_kernel<true, true> : dq_from_accum_kernel<true, false>)
           : (vector_order ? dq_from_accum_kernel<false, true> : dq_from_accum_kernel<false, false>);
  kernel<<<grid, DQ_THREADS, 0, stream>>>(dq_accum.typed_data(), lse.typed_data(),
                                          dq->untyped_data(), args_sq, args_h, args_parts, scale);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace kvax_sm90

// The interface this file implements: the handler's arguments and the variants' feature bits.
// fused_backward.py refuses a library that reports another (built from an older source).
extern "C" int KvaxSm90AbiVersion() { return 16; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvaxSm90FusedBackward, kvax_sm90::FusedBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // q (bf16 or f16)
                                  .Arg<ffi::AnyBuffer>()           // k
                                  .Arg<ffi::AnyBuffer>()           // v
                                  .Arg<ffi::AnyBuffer>()           // d_out
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()    // delta
                                  .Arg<ffi::Buffer<ffi::S32>>()    // q_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()    // q_seg
                                  .Arg<ffi::Buffer<ffi::S32>>()    // kv_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()    // kv_seg
                                  .Arg<ffi::Buffer<ffi::S32>>()    // lower
                                  .Arg<ffi::Buffer<ffi::S32>>()    // upper
                                  .Arg<ffi::Buffer<ffi::S32>>()    // full_lower
                                  .Arg<ffi::Buffer<ffi::S32>>()    // full_upper
                                  .Arg<ffi::Buffer<ffi::S32>>()    // order
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("variant")
                                  .Attr<float>("soft_cap")         // 0: none
                                  .Attr<int32_t>("window")         // 0: none
                                  .Ret<ffi::AnyBuffer>()           // dk (q's type)
                                  .Ret<ffi::AnyBuffer>()           // dv
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dq_accum

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvaxSm90DqFromAccum, kvax_sm90::DqFromAccumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dq_accum
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse [B, H, Sq]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("vector_order")  // 0: FRAG, 1: the wide kernels'
                                  .Ret<ffi::AnyBuffer>());        // dq [B, Sq, H, D]
