"""Benchmarks of paged-jax. Each module runs as ``python -m benchmarks.<name>`` and writes
its results (with machine and versions) to ``benchmarks/results/``."""
