"""A CUDA C++ attention backward for Hopper (sm_90a), called through XLA FFI: a design probe for
the 5-product backward that the Pallas Mosaic GPU kernels could not fit in registers
(fused_backward.cu says what it covers). Not a backend of kvax_plugin.flash_attention yet: it
is built on the CPU machine (build.sh) and exercised by benchmarks/cuda_backward_check.py and
tests/gpu/test_cuda_sm90_gpu.py."""
