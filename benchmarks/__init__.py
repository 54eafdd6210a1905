"""Benchmarks: `python -m benchmarks.run --preset quick|full` measures the README's tables and
`python -m benchmarks.readme_table <results.json>` writes the speed table into the README;
`python -m benchmarks.gate --base <commit>` compares a tree's speed with a commit's
(docs/benchmarks.md). The modules of the command: cases, timing, impls, fa3, bench_attention,
results, run. The programs beside it (maxtext_e2e, bench_context_parallel, cpu_fwd_bwd, ...)
also run on their own; benchmarks/tools/ holds the maintainers' profiling helpers."""
