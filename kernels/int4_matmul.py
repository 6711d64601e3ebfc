"""Triton dequant-matmul for int weights: y = x @ dequant(W)^T, W INT4 packed (or int8), group-wise scales.

Reads the checkpoint's pack-quantized layout directly: int32 words [N, K/8], element k of a row in bits
4*(k % 8) of word k // 8, stored as q + 8. No repack: the layout is already K-contiguous per output row, which is
what a [BLOCK_K, BLOCK_N] tile load wants, and keeping it means GPU memory equals the checkpoint size.
Unpacked int8 weights [N, K] (INT8 and the odd widths) go through the same kernel with PACKED=False.
Zero points (asymmetric) arrive unpacked as int8 [N, K/group], like the scales.

Decode (M <= TRITON_DECODE_MAX_M of kernels/dispatch.py) is memory-bound: small BLOCK_M (16, the tl.dot
minimum) and split-K so a 4096-wide layer still fills ~130 SMs. Prefill (M >= 256) is compute-bound: big square
tiles. tl.dot needs every block dim >= 16; the interpreter does not check that, tests/test_kernels_triton.py does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _cfg(bm: int, bn: int, bk: int, split_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k},
                         num_warps=warps, num_stages=stages)


DECODE_CONFIGS = [
    _cfg(16, 32, 128, 1, 4, 4), _cfg(16, 64, 128, 1, 4, 4), _cfg(16, 32, 256, 1, 4, 3),
    _cfg(16, 64, 64, 2, 4, 4), _cfg(16, 32, 128, 2, 4, 4), _cfg(16, 64, 128, 4, 4, 3),
    _cfg(32, 64, 64, 1, 4, 4), _cfg(32, 32, 128, 2, 4, 4),
]
PREFILL_CONFIGS = [
    _cfg(128, 128, 32, 1, 8, 3), _cfg(128, 128, 64, 1, 8, 3), _cfg(128, 64, 64, 1, 4, 4),
    _cfg(64, 128, 64, 1, 4, 4), _cfg(64, 64, 64, 1, 4, 4), _cfg(256, 128, 32, 1, 8, 3),
]
# The one config the interpreter runs (autotuning under the interpreter would time every config on the CPU).
INTERPRET_CONFIG = _cfg(16, 32, 32, 2, 1, 1)


@triton.jit
def tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile: row and column offsets and their bounds masks."""
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def store_tile(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, SPLIT_K: tl.constexpr):
    """Write a tile of the fp32 output; split-K programs add their partial sums into the zeroed buffer."""
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    ymask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=ymask)


def launch(kernel, tuned_decode, tuned_prefill, args: tuple, flags: dict, m: int, n: int,
           config: triton.Config | None, decode: bool) -> None:
    """Run a matmul kernel: one pinned config (tests, the interpreter) or the autotuned decode / prefill family."""
    if INTERPRET or config is not None:
        c = (config or INTERPRET_CONFIG).kwargs
        kernel[(triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]), c["SPLIT_K"])](*args, **flags, **c)
        return
    tuned = tuned_decode if decode else tuned_prefill

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    tuned[grid](*args, **flags)


@triton.jit
def _int_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                       M_BUCKET, GROUP: tl.constexpr, PACKED: tl.constexpr, HAS_ZP: tl.constexpr,
                       DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_k = tl.program_id(1)
    offs_m, offs_n, mask_m, mask_n = tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # K is a multiple of the group size (and of 8 when packed), so a tile either covers whole groups
        # (BLOCK_K >= GROUP) or sits inside one; masks on K only matter for the tail tile.
        if PACKED:  # load each int32 word once, split it into its 8 nibbles in registers
            offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_w[:, None],
                            mask=(offs_w[:, None] < K // 8) & mask_n[None, :], other=0)
            shifts = tl.arange(0, 8) * 4
            q = (words[:, None, :] >> shifts[None, :, None]) & 0xF
            q = tl.reshape(q, (BLOCK_K, BLOCK_N)) - 8
        else:
            q = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                        mask=mask_k[:, None] & mask_n[None, :], other=0).to(tl.int32)
        if BLOCK_K >= GROUP:  # BLOCK_K // GROUP scales per row of the tile, broadcast over their groups
            offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            gmask = (offs_g[:, None] < K // GROUP) & mask_n[None, :]
            sidx = offs_n[None, :] * stride_sn + offs_g[:, None]
            if HAS_ZP:
                zp = tl.load(z_ptr + sidx, mask=gmask, other=0).to(tl.int32)
                q = tl.reshape(tl.reshape(q, (BLOCK_K // GROUP, GROUP, BLOCK_N)) - zp[:, None, :],
                               (BLOCK_K, BLOCK_N))
            s = tl.load(s_ptr + sidx, mask=gmask, other=0.0)
            w = tl.reshape(tl.reshape(q.to(tl.float32), (BLOCK_K // GROUP, GROUP, BLOCK_N)) * s[:, None, :],
                           (BLOCK_K, BLOCK_N))
        else:  # the whole tile lies in one group: one scale per output column
            sidx = offs_n * stride_sn + k0 // GROUP
            if HAS_ZP:
                q = q - tl.load(z_ptr + sidx, mask=mask_n, other=0).to(tl.int32)[None, :]
            w = q.to(tl.float32) * tl.load(s_ptr + sidx, mask=mask_n, other=0.0)[None, :]
        if DOT_FP32:  # fp32 activations, and always under the interpreter (its bf16 dot is wrong)
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    store_tile(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, SPLIT_K)


_tuned_decode = triton.autotune(DECODE_CONFIGS, key=["M_BUCKET", "N", "K"], reset_to_zero=["y_ptr"])(
    _int_matmul_kernel)
_tuned_prefill = triton.autotune(PREFILL_CONFIGS, key=["M_BUCKET", "N", "K"], reset_to_zero=["y_ptr"])(
    _int_matmul_kernel)


def m_bucket(m: int) -> int:
    """Autotune key: one tuning per power-of-two batch size, not per exact M."""
    return 1 << max(0, (m - 1).bit_length())


def supported(k: int, group: int) -> bool:
    """Groups must nest with the power-of-two K tiles (32/64/128 do); per-channel (group == K) always works."""
    return group == k or (group >= 16 and group & (group - 1) == 0 and k % group == 0)


def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group: int, packed: bool = True, config: triton.Config | None = None, *,
               decode: bool) -> torch.Tensor:
    """y [M, N] (x's dtype) for x [M, K]; qweight int32 [N, K/8] when packed, else int8 [N, K].

    `config` pins one tile config instead of autotuning (tests; the interpreter always uses one). `decode` picks
    the decode configs over the prefill ones (kernels/dispatch.py decides, by its TRITON_DECODE_MAX_M).
    """
    m, k = x.shape
    if group == k:
        group = 1 << 30  # per-channel: every tile lies inside the one group
    n = qweight.shape[0]
    x = x.contiguous()
    # fp32 output buffer, zeroed: split-K configs accumulate into it with atomics
    y = torch.zeros((m, n), device=x.device, dtype=torch.float32)
    args = (x, qweight, scales, zeros if zeros is not None else scales, y, m, n, k, x.stride(0),
            qweight.stride(0), scales.stride(0), y.stride(0), m_bucket(m))
    flags = dict(GROUP=group, PACKED=packed, HAS_ZP=zeros is not None,
                 DOT_FP32=INTERPRET or x.dtype == torch.float32)
    launch(_int_matmul_kernel, _tuned_decode, _tuned_prefill, args, flags, m, n, config, decode)
    return y.to(x.dtype)
