"""The machine ceilings a roofline is drawn against, measured one way everywhere (`qtool diagnose`, `qtool bench
kernels`): DRAM read bandwidth and fp32 GEMM throughput, each the best of a few timed runs after a warm-up."""

from __future__ import annotations

import time

import torch


def _best_time(fn, repeat: int) -> float:
    fn()  # warm-up: faults the pages in, picks the GEMM kernel
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(size_mb: int = 512, repeat: int = 5) -> float:
    """DRAM read bandwidth in GB/s: torch.sum over a buffer far larger than the caches."""
    x = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
    return x.nbytes / _best_time(x.sum, repeat) / 1e9


def measure_gemm_flops(n: int = 1024, repeat: int = 5) -> float:
    """fp32 GEMM throughput in GFLOP/s (the compute ceiling prefill runs against)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best_time(lambda: a @ b, repeat) / 1e9
