"""Quantized KV cache values: FP8 E4M3 or INT8 keys and values, one fp32 scale per (token, KV head).

A scale per token and head depends on that token's own K/V only, so a sequence's cache holds the same bytes
whatever batch it ran in, and a prefix block written by one request is exactly what another would have written.
A checkpoint's calibrated scales (compressed-tensors' `self_attn.k_scale` / `v_scale`, per tensor or per head)
replace the dynamic ones: every slot then carries the static scale, so one attention path reads both.

These are the torch operations; kernels/cpu_engine_ops.cpp (rope_and_cache_quant, paged_attention_quant)
performs the same ones in the same order (division by the scale, E4M3 saturation at 448, round-half-even to
[-127, 127]), so both paths write identical bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
QMAX = {"fp8": 448.0, "int8": 127.0}
STORAGE = {"fp8": torch.uint8, "int8": torch.int8}  # fp8 bytes live as uint8: CPU index_copy_ lacks float8
SCALE_BYTES = 4  # one fp32 scale per (token, KV head)
_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class StaticKVScales:
    """Calibrated scales of one layer: fp32 [num_kv_heads] each (a per-tensor scale is broadcast), for a cache of
    `kind` (fp8 or int8: the scheme they were calibrated for)."""

    k: torch.Tensor
    v: torch.Tensor
    kind: str


def quantize(x: torch.Tensor, kind: str, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, Hk, D] -> (values [T, Hk, D] in STORAGE[kind], scales [T, Hk] fp32); `static` [Hk] fixes the scales."""
    xf = x.float()
    if static is None:
        scale = (xf.abs().amax(dim=-1) / QMAX[kind]).clamp_(min=_EPS)
    else:
        scale = static.float().expand(x.shape[0], -1).contiguous()
    y = xf / scale.unsqueeze(-1)
    if kind == "fp8":
        return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8), scale
    return y.round_().clamp_(-127.0, 127.0).to(torch.int8), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] and scales [...] back to `dtype`."""
    raw = values.view(torch.float8_e4m3fn) if kind == "fp8" else values
    return (raw.float() * scales.unsqueeze(-1)).to(dtype)
