"""Benchmark suite: python -m bench --help (see README, "Benchmarks")."""
