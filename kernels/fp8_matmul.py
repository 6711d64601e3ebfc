"""Triton FP8 matmul: E4M3 weights [N, K] with per-channel scales, x either 16/32-bit (weight-only) or FP8 with
per-token scales (FP8_DYNAMIC; quantized in torch beforehand, since fp32->fp8 inside a kernel is unreliable).

Both scales factor out of the K sum, so the loop is a plain dot and the scales are applied once per tile.
FP8 x FP8 runs on the tensor cores where they take FP8 (sm_89+); elsewhere, and under the interpreter, the
operands are upcast (bf16 on GPU, fp32 in the interpreter, whose bf16 dot is wrong).
Configs follow int4_matmul.py: small BLOCK_M + split-K for decode, large tiles for prefill; all dims >= 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .int4_matmul import DECODE_CONFIGS, INTERPRET, PREFILL_CONFIGS, launch, m_bucket, store_tile, tile


@triton.jit
def _fp8_matmul_kernel(x_ptr, w_ptr, ws_ptr, xs_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, M_BUCKET,
                       ACT_FP8: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_FP32: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr):
    pid_k = tl.program_id(1)
    offs_m, offs_n, mask_m, mask_n = tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0)
        if NATIVE_FP8:
            acc = tl.dot(x, w, acc)
        elif DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
    acc = acc * tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if ACT_FP8:
        acc = acc * tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    store_tile(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, SPLIT_K)


_tuned_decode = triton.autotune(DECODE_CONFIGS, key=["M_BUCKET", "N", "K", "ACT_FP8"], reset_to_zero=["y_ptr"])(
    _fp8_matmul_kernel)
_tuned_prefill = triton.autotune(PREFILL_CONFIGS, key=["M_BUCKET", "N", "K", "ACT_FP8"],
                                 reset_to_zero=["y_ptr"])(_fp8_matmul_kernel)


def _native_fp8(device: torch.device) -> bool:
    return not INTERPRET and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, *, decode: bool) -> torch.Tensor:
    """y [M, N] = (x * x_scale) @ (w * w_scale)^T. x is FP8 exactly when x_scale (per token, [M] or [M, 1]) is given.

    `decode` picks the decode configs over the prefill ones (kernels/dispatch.py decides)."""
    m, k = x.shape
    n = w.shape[0]
    act_fp8 = x_scale is not None
    out_dtype = out_dtype or (torch.bfloat16 if act_fp8 else x.dtype)
    x = x.contiguous()
    ws = w_scale.reshape(-1).float().contiguous()
    xs = x_scale.reshape(-1).float().contiguous() if act_fp8 else ws
    y = torch.zeros((m, n), device=x.device, dtype=torch.float32)
    args = (x, w, ws, xs, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), m_bucket(m))
    flags = dict(ACT_FP8=act_fp8, NATIVE_FP8=act_fp8 and _native_fp8(x.device),
                 DOT_FP32=INTERPRET or (not act_fp8 and x.dtype == torch.float32))
    launch(_fp8_matmul_kernel, _tuned_decode, _tuned_prefill, args, flags, m, n, None, decode)
    return y.to(out_dtype)
