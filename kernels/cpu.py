"""CPU dequant-matmul paths: the AVX2 kernels of cpu_kernels.cpp where they win, torch everywhere else.

Measured on this AVX2 EPYC with 2 threads (`qtool bench kernels`, see the report JSON for figures):
- M <= GEMV_MAX_M: the AVX2 kernels read the packed weight once and dequantize in registers, so they run
  near DRAM bandwidth; at decode sizes they beat dense fp32/bf16 (which read 8x/4x more bytes) and aten's
  `_weight_int4pack_mm_for_cpu` (compute-bound on AVX2, needs bf16 activations).
- M > GEMV_MAX_M (prefill, big batches): the per-row integer work grows with M while one dequantize into a
  transient fp32 matrix followed by MKL sgemm is amortized over the rows, so that wins.
Every function takes 2-D fp32 activations and returns fp32 [M, N].
"""

from __future__ import annotations

import torch

from .cpu_build import cpu_kernels
from .reference import unpack_int32

# Largest batch (rows of x) that goes through the register-dequant GEMV kernels; above it dequantize + sgemm.
# At M=16 the INT4 kernel is still ~1.5-2x faster than dequant+sgemm on the 4096-class shapes; at M=32 they meet.
GEMV_MAX_M = 16


def _no_zeros(zeros: torch.Tensor | None) -> torch.Tensor:
    return zeros if zeros is not None and zeros.numel() else torch.empty(0, dtype=torch.int8)


def int4_fast_ok(k: int, group: int) -> bool:
    """Whether the AVX2 INT4 kernel can read this shape (64-element chunks, 32-element activation blocks)."""
    return k % 64 == 0 and (group == 32 or group % 64 == 0) and k % group == 0


def int8_fast_ok(k: int, group: int) -> bool:
    return k % 32 == 0 and group % 32 == 0 and k % group == 0


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group: int) -> torch.Tensor:
    """fp32 [N, K] from the checkpoint's 4-bit packed layout."""
    ext = cpu_kernels()
    k = packed.shape[1] * 8
    if ext is not None and int4_fast_ok(k, group):
        return ext.int4_dequantize(packed, scales, _no_zeros(zeros), group)
    return dequantize_int8(unpack_int32(packed, 4, k), scales, zeros, group)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group: int) -> torch.Tensor:
    """fp32 [N, K] from an int8 weight with group scales [N, K/group]."""
    n, k = q.shape
    w = q.float().reshape(n, k // group, group)
    if zeros is not None and zeros.numel():
        w = w - zeros.float().unsqueeze(-1)
    return (w * scales.unsqueeze(-1)).reshape(n, k)


def dequantize_fp8(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from an FP8 E4M3 weight and per-row scales [N, 1]."""
    ext = cpu_kernels()
    if ext is not None and w.shape[1] % 16 == 0:
        return ext.fp8_dequantize(w.view(torch.uint8), scales.reshape(-1))
    return w.float() * scales.reshape(-1, 1)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group: int) -> torch.Tensor:
    ext = cpu_kernels()
    k = packed.shape[1] * 8
    if ext is not None and x.shape[0] <= GEMV_MAX_M and int4_fast_ok(k, group):
        return ext.int4_matmul(x, packed, scales, _no_zeros(zeros), group)
    return x @ dequantize_int4(packed, scales, zeros, group).t()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group: int) -> torch.Tensor:
    ext = cpu_kernels()
    if ext is not None and x.shape[0] <= GEMV_MAX_M and int8_fast_ok(q.shape[1], group):
        return ext.int8_matmul(x, q, scales, _no_zeros(zeros), group)
    return x @ dequantize_int8(q, scales, zeros, group).t()


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    ext = cpu_kernels()
    if ext is not None and x.shape[0] <= GEMV_MAX_M and w.shape[1] % 16 == 0:
        return ext.fp8_matmul(x, w.view(torch.uint8), scales.reshape(-1))
    return x @ dequantize_fp8(w, scales).t()
