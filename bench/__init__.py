"""Benchmarks: each prints machine-readable JSON; figures are recorded in docs/BENCHMARKS.md."""
