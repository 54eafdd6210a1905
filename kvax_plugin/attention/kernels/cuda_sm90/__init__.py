"""A CUDA C++ attention backward for Hopper (sm_90a), called through XLA FFI: the 5-product fused
backward that the Pallas Mosaic GPU kernels could not fit in registers (fused_backward.cu says
what it covers). A leaf: kernels/hopper.py composes it with the Mosaic forward as
backend="hopper". Built on first use into a cache, or ahead of time on any machine with Python
and nvcc (build.py; no GPU needed); checked by benchmarks/cuda_backward_check.py and
tests/gpu/test_cuda_sm90_gpu.py."""
