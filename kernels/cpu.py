"""CPU dequant-matmul paths: the AVX2 kernels of cpu_kernels.cpp (register-dequant GEMV, for few rows of x) and
blocked dequantization + MKL sgemm (for many), with torch wherever the AVX2 build is missing.

kernels/dispatch.py chooses the path (`gemv=`) and holds the thresholds. Dequantizing the whole matrix at once
instead of by blocks costs a 67 MB allocation per call on 4096x4096 and is 1.6x slower than the blocked path.
Every function takes 2-D fp32 activations and returns fp32 [M, N].
"""

from __future__ import annotations

import threading

import torch

from .cpu_build import cpu_kernels, engine_ops
from .reference import unpack_int32

# The prefill path of the C++ build (fused_dequant_sgemm in cpu_kernels.cpp) runs a layer in one parallel region:
# each thread dequantizes FUSED_BLOCK_BYTES of weight rows into its own buffer and multiplies them by all of x with
# a one-thread sgemm, so the block is read back from the core's L2 and a layer is one fork/join. On the default
# model's 120 Linears (1 thread, the shared machine loaded, fp32's x @ W^T over each): FP8 at 256 rows 1.02x
# (dequantizing the whole layer first, then one sgemm: 0.99x; 256 KiB blocks 0.98x, 128 KiB 0.84x), INT8 at 256
# rows 1.01-1.15x, at 1,024 rows 0.98x (whole layer 0.96x, 512 KiB blocks 0.91x, 4 MiB 0.94x); at 2 threads under
# that load FP8 at 256 rows took 0.6-0.7 s where fp32's threaded sgemm took 0.9-2.3 s.
FUSED_BLOCK_BYTES = 1 << 20
# Without the C++ build (or for bf16 weights) a layer is dequantized whole into one reused fp32 buffer and
# multiplied as x @ W^T, fp32's own sgemm call: on the default model's 3072 x 576 gate_up at 256 rows that took
# 67 ms where dequantizing 4 MiB blocks and multiplying each as W_block @ x^T took 110 (fp32's own x @ W^T: 74). The
# buffer is as large as the largest layer, 7 MiB on the default model; layers above FULL_DEQUANT_BYTES (a 7B
# model's MLP) go by blocks of BLOCK_BYTES, which stay in the L3 between being written and read by sgemm.
FULL_DEQUANT_BYTES = 128 << 20
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
    return _into(_dequantize_int8_torch(unpack_int32(packed, 4, k), scales, zeros, group), out)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [N, K] from an int8 weight with group scales [N, K/group] (into `out`, a reused buffer, when given)."""
    ext = cpu_kernels()
    if ext is not None and not q.is_cuda and q.is_contiguous():
        return ext.int8_dequantize(q, scales.float().contiguous(), _no_zeros(zeros), group, out)
    return _into(_dequantize_int8_torch(q, scales, zeros, group), out)


def _dequantize_int8_torch(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                           group: int) -> torch.Tensor:
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
    """A per-thread fp32 buffer reused across calls: a fresh multi-MB block for every dequantized block of every
    layer pays its page faults on each call (~40% of the FP8 prefill matmul time)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable both inside and outside inference mode
            buf = _scratch.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def blocked_dequant_matmul(x: torch.Tensor, n: int, dequant_rows) -> torch.Tensor:
    """x @ W^T with W dequantized into a reused buffer, whole (up to FULL_DEQUANT_BYTES) or a block of rows at a
    time (dequant_rows(r0, r1, out) -> fp32 [r1 - r0, K] written into `out`)."""
    k = x.shape[1]
    rows = n if 4 * n * k <= FULL_DEQUANT_BYTES else min(n, max(16, BLOCK_BYTES // (4 * k)))
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
                group: int, *, gemv: bool) -> torch.Tensor:
    ext = cpu_kernels()
    k = packed.shape[1] * 8
    if ext is not None and int4_fast_ok(k, group):
        if gemv:
            return ext.int4_matmul(x, packed, scales, _no_zeros(zeros), group)
        return ext.int4_dequant_matmul(x, packed, scales, _no_zeros(zeros), group, FUSED_BLOCK_BYTES)
    return blocked_dequant_matmul(x, packed.shape[0], lambda r0, r1, out: dequantize_int4(
        packed[r0:r1], scales[r0:r1], _rows(zeros, r0, r1), group, out))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group: int, *, gemv: bool) -> torch.Tensor:
    ext = cpu_kernels()
    if gemv and ext is not None and int8_fast_ok(q.shape[1], group):
        return ext.int8_matmul(x, q, scales, _no_zeros(zeros), group)
    if ext is not None and q.is_contiguous():
        return ext.int8_dequant_matmul(x, q, scales.float().contiguous(), _no_zeros(zeros), group, FUSED_BLOCK_BYTES)
    return blocked_dequant_matmul(x, q.shape[0], lambda r0, r1, out: dequantize_int8(
        q[r0:r1], scales[r0:r1], _rows(zeros, r0, r1), group, out))


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, *, gemv: bool) -> torch.Tensor:
    ext = cpu_kernels()
    if ext is not None and w.shape[1] % 16 == 0:
        if gemv:
            return ext.fp8_matmul(x, w.view(torch.uint8), scales.reshape(-1))
        return ext.fp8_dequant_matmul(x, w.view(torch.uint8), scales.reshape(-1).float().contiguous(),
                                      FUSED_BLOCK_BYTES)
    return blocked_dequant_matmul(x, w.shape[0], lambda r0, r1, out: dequantize_fp8(w[r0:r1], scales[r0:r1], out))


def dense_fast_ok(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % 8 == 0
            and engine_ops() is not None)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x [M, K] @ weight [N, K]^T (fp32 or bf16, dense_fast_ok) in the CPU GEMV: each weight row read once (fp32 weights
    take AVX-512 rows where the CPU allows them, see kernels/cpu_isa.h)."""
    return engine_ops().dense_gemv(x, weight)


def widened_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x @ bf16 weight^T with the weight widened to fp32 a block of rows at a time (sgemm on each block)."""
    return blocked_dequant_matmul(x.contiguous(), weight.shape[0], lambda r0, r1, out: _into(weight[r0:r1], out))
