"""bench_attention.py with backend="hopper"'s CUDA library loaded from a given file: an
experimental build of fused_backward.cu (python -m kvax_plugin.attention.kernels.cuda_sm90.build
--source X.cu --out X.so) timed in its own process against the default build.

    python -m benchmarks.tools.bench_with_library X.so --seq 16384 --impls hopper ...
"""

from __future__ import annotations

import sys

from benchmarks import bench_attention
from kvax_plugin.attention.kernels.cuda_sm90 import fused_backward


def main() -> None:
  fused_backward.load(sys.argv[1])  # later loads (the backend's own) return this library
  sys.argv = [sys.argv[0]] + sys.argv[2:]
  bench_attention.main()


if __name__ == "__main__":
  main()
