"""Benchmark suite: python -m bench --help (see docs/benchmarks.md)."""
