"""CPU dequant-matmul paths: the AVX2 kernels of cpu_kernels.cpp where they win, torch everywhere else.

Measured on this AVX2 EPYC (`qtool bench kernels --threads 1`, 4096x4096, weights streamed from DRAM):
- M <= the GEMV limit: the AVX2 kernels read the packed weight once and dequantize in registers. INT4 M=1 runs
  at 3.5x dense fp32 and 3.8x bf16 (~60% of the bandwidth of one thread), and 3-6x both up to M=16; aten's
  `_weight_int4pack_mm_for_cpu` reaches only 1.1x fp32 at M=1 (compute-bound on AVX2, bf16 activations).
- above it (prefill, big batches) the GEMV's per-row integer work grows with M, while dequantizing a block of
  rows into a cache-sized fp32 buffer and running MKL sgemm on it amortizes over the rows. INT4 at M=32:
  GEMV 36 ms vs blocked 63 ms; at M=64 they tie (100 vs 106); at M=256 blocked wins (267 ms, fp32 296 ms).
  Dequantizing the whole matrix at once instead costs a 67 MB allocation per call and was 1.6x slower.
Every function takes 2-D fp32 activations and returns fp32 [M, N].
"""

from __future__ import annotations

import threading

import torch

from .cpu_build import cpu_kernels, engine_ops
from .reference import unpack_int32

# Largest batch (rows of x) that goes through the register-dequant GEMV kernels; above it blocked dequant + sgemm.
# INT4 does less integer work per weight than INT8/FP8 (two nibbles per byte, one FMA per 32 weights), so its
# crossover with the blocked path comes later (M ~ 64 vs ~ 24 for INT8/FP8 on 4096x4096).
GEMV_MAX_M = 16
INT4_GEMV_MAX_M = 32
# FP8 widens each weight chunk once for 8 rows of x: on 30 x SmolLM2's projections from DRAM its GEMV beats fp32
# by 1.25x at M = 16 and 1.1x at 24; from 32 rows the blocked path (0.93-1.03x fp32 at 32-64) is faster.
FP8_GEMV_MAX_M = 24
# Dense layers (fp32 activations, measured on 576x576 to 49152x576): the AVX2 GEMV of cpu_engine_ops.cpp reads
# each weight row once for all rows of x, at ~27 GB/s for the fp32 lm_head vs MKL's ~13 at M=1. On a decoder's
# worth of fp32 layers streamed from DRAM (30 x SmolLM2's four projections) it beats MKL's W @ x^T by 1.6-1.7x at
# 8-12 rows and 1.07x at 16, ties at 24 and loses at 32. bf16 weights widen in registers and win up to 32 rows
# (torch's bf16 matmul has no native bf16 compute on AVX2 and runs 2-4x slower); above that they are widened
# block by block.
DENSE_GEMV_MAX_M = 16
BF16_GEMV_MAX_M = 32
# Between the GEMV and this many rows, MKL runs W @ x^T faster than x @ W^T (1.1-1.3x at M = 16-32 on N >= 960,
# K = 576); for prefill-sized M the usual order is faster (1.2-1.5x at M = 1024).
SGEMM_TRANSPOSED_MAX_M = 64
# Rows dequantized per block in the prefill path: ~4 MiB of fp32 weights stays in the 32 MiB L3 between being
# written and being read by sgemm, and is wide enough for MKL's tiles (1 MiB blocks measured ~10% slower).
BLOCK_BYTES = 4 << 20


def _no_zeros(zeros: torch.Tensor | None) -> torch.Tensor:
    return zeros if zeros is not None and zeros.numel() else torch.empty(0, dtype=torch.int8)


def int4_fast_ok(k: int, group: int) -> bool:
    """Whether the AVX2 INT4 kernel can read this shape (64-element chunks, 32-element activation blocks)."""
    return k % 64 == 0 and (group == 32 or group % 64 == 0) and k % group == 0


def int8_fast_ok(k: int, group: int) -> bool:
    return k % 32 == 0 and group % 32 == 0 and k % group == 0


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [N, K] from the checkpoint's 4-bit packed layout (into `out`, a reused buffer, when given)."""
    ext = cpu_kernels()
    k = packed.shape[1] * 8
    if ext is not None and int4_fast_ok(k, group):
        return ext.int4_dequantize(packed, scales, _no_zeros(zeros), group, out)
    return _into(dequantize_int8(unpack_int32(packed, 4, k), scales, zeros, group), out)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group: int) -> torch.Tensor:
    """fp32 [N, K] from an int8 weight with group scales [N, K/group]."""
    n, k = q.shape
    w = q.float().reshape(n, k // group, group)
    if zeros is not None and zeros.numel():
        w = w - zeros.float().unsqueeze(-1)
    return (w * scales.unsqueeze(-1)).reshape(n, k)


def dequantize_fp8(w: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [N, K] from an FP8 E4M3 weight and per-row scales [N, 1] (into `out` when given)."""
    ext = cpu_kernels()
    if ext is not None and w.shape[1] % 16 == 0:
        return ext.fp8_dequantize(w.view(torch.uint8), scales.reshape(-1), out)
    return _into(w.float() * scales.reshape(-1, 1), out)


def _into(w: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return w if out is None else out.view(-1)[:w.numel()].view(w.shape).copy_(w)


_scratch = threading.local()


def _scratch_buffer(numel: int) -> torch.Tensor:
    """A per-thread fp32 buffer reused across calls: allocating a fresh multi-MB block for every dequantized
    block of every layer made the kernel pay page faults (~40% of the FP8 prefill matmul time)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable both inside and outside inference mode
            buf = _scratch.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def blocked_dequant_matmul(x: torch.Tensor, n: int, dequant_rows) -> torch.Tensor:
    """x @ W^T with W dequantized a block of rows at a time into a reused buffer (dequant_rows(r0, r1, out) ->
    fp32 [r1 - r0, K] written into `out`)."""
    k = x.shape[1]
    rows = min(n, max(16, BLOCK_BYTES // (4 * k)))
    buf = _scratch_buffer(rows * k)
    if rows == n:
        return x @ dequant_rows(0, n, buf).t()
    y_t = torch.empty(n, x.shape[0], dtype=torch.float32)
    x_t = x.t()
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        torch.mm(dequant_rows(r0, r1, buf), x_t, out=y_t[r0:r1])
    return y_t.t()


def _rows(t: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor | None:
    return t[r0:r1] if t is not None and t.numel() else None


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group: int) -> torch.Tensor:
    ext = cpu_kernels()
    k = packed.shape[1] * 8
    if ext is not None and x.shape[0] <= INT4_GEMV_MAX_M and int4_fast_ok(k, group):
        return ext.int4_matmul(x, packed, scales, _no_zeros(zeros), group)
    return blocked_dequant_matmul(x, packed.shape[0], lambda r0, r1, out: dequantize_int4(
        packed[r0:r1], scales[r0:r1], _rows(zeros, r0, r1), group, out))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group: int) -> torch.Tensor:
    ext = cpu_kernels()
    if ext is not None and x.shape[0] <= GEMV_MAX_M and int8_fast_ok(q.shape[1], group):
        return ext.int8_matmul(x, q, scales, _no_zeros(zeros), group)
    return blocked_dequant_matmul(x, q.shape[0], lambda r0, r1, out: _into(dequantize_int8(
        q[r0:r1], scales[r0:r1], _rows(zeros, r0, r1), group), out))


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    ext = cpu_kernels()
    if ext is not None and x.shape[0] <= FP8_GEMV_MAX_M and w.shape[1] % 16 == 0:
        return ext.fp8_matmul(x, w.view(torch.uint8), scales.reshape(-1))
    return blocked_dequant_matmul(x, w.shape[0], lambda r0, r1, out: dequantize_fp8(w[r0:r1], scales[r0:r1], out))


def dense_fast_ok(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % 8 == 0
            and engine_ops() is not None)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x [M, K] @ weight [N, K]^T (fp32 or bf16) -> fp32 [M, N]."""
    m = x.shape[0]
    if weight.dtype == torch.float32:
        if m <= DENSE_GEMV_MAX_M:
            return engine_ops().dense_gemv(x, weight)
        if m <= SGEMM_TRANSPOSED_MAX_M:  # W @ x^T blocks better in MKL than x @ W^T for a few dozen rows
            return torch.mm(weight, x.t()).t().contiguous()
        return x @ weight.t()
    if m <= BF16_GEMV_MAX_M:
        return engine_ops().dense_gemv(x, weight)
    return blocked_dequant_matmul(x.contiguous(), weight.shape[0], lambda r0, r1, out: _into(weight[r0:r1], out))
