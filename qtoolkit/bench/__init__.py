"""Benchmarks: the same traffic sent to systems side by side, in interleaved rounds, and batch-1 decode."""
