// A toolchain probe, not a kernel of the plugin: can a CUDA C++ kernel built on the CPU machine
// (nvcc from PyPI, XLA FFI headers from the jaxlib wheel) run inside a jitted JAX function on the
// GPU image (a CUDA 13.5 build under its 580 driver, jaxlib 0.11.2's FFI ABI)? The kernel adds
// one to a float32 buffer; register splits are studied offline (benchmarks/ptxas_splits.py).
#include <cstdint>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

__global__ void __launch_bounds__(256) add_one(const float* x, float* y, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] + 1.0f;
}

static ffi::Error AddOneImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x,
                             ffi::ResultBuffer<ffi::F32> y) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t blocks = (n + 255) / 256;
  add_one<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(x.typed_data(), y->typed_data(), n);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvaxProbeAddOne, AddOneImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
