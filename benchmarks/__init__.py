"""Benchmarks: `python -m benchmarks.run --preset quick|full` regenerates the README's tables.
The programs beside it (bench_attention, maxtext_e2e, bench_context_parallel, cpu_fwd_bwd, ...)
also run on their own; benchmarks/tools/ holds the maintainers' profiling helpers."""
