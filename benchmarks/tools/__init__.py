"""Maintainer tools: kernel profiling, Nsight Compute and ptxas summaries, launch-order models.
They import kernel internals, so they follow the kernels' code, not a stable API."""
