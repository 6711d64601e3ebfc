"""The one torch reference for every quantized format: quantize a weight, dequantize checkpoint tensors.

`quantize_weight` writes exactly the tensors compressed-tensors writes for a min/max (RTN) quantization
(tests compare bit-for-bit against its compressors), and `dequantize` is what every kernel is checked against.

Packing (compressed-tensors `pack_to_int32`): values are offset to unsigned (q + 2**(bits-1)) and packed densely,
element i at bit i*bits of the row; for 4 and 8 bits that is 32/bits whole elements per int32 word, lowest
element in the lowest bits. Asymmetric zero points are packed the same way but along dim 0.
"""

from __future__ import annotations

import math

import torch

from .scheme import QuantSchemeError, Scheme, parse_scheme


def pack_int32(q: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack signed ints in [-2**(bits-1), 2**(bits-1)) densely into int32 along `dim` (0 or 1)."""
    v = q.to(torch.int64) + (1 << (bits - 1))
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    padded = math.ceil(cols / 32) * 32
    v = torch.nn.functional.pad(v, (0, padded - cols))
    bit_pos = torch.arange(padded, dtype=torch.int64) * bits
    word, shift = bit_pos // 32, bit_pos % 32
    out = torch.zeros(rows, padded * bits // 32 + 1, dtype=torch.int64)
    out.index_add_(1, word, v << shift)  # low part of each element
    spill = shift + bits - 32
    over = spill > 0
    if over.any():  # elements straddling a word boundary (bits not dividing 32)
        out.index_add_(1, word[over] + 1, v[:, over] >> (bits - spill[over]))
    words = math.ceil(cols * bits / 32)
    out = (out[:, :words] & 0xFFFFFFFF)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.t().contiguous() if dim == 0 else out


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: int8 values with `length` elements along `dim`."""
    p = packed.t() if dim == 0 else packed
    p = p.to(torch.int64) & 0xFFFFFFFF
    bit_pos = torch.arange(length, dtype=torch.int64) * bits
    word, shift = bit_pos // 32, bit_pos % 32
    p = torch.nn.functional.pad(p, (0, 1))
    lo = p[:, word] >> shift
    hi = p[:, word + 1] << (32 - shift)  # bits that spilled into the next word (masked off when none)
    v = (lo | hi) & ((1 << bits) - 1)
    out = (v - (1 << (bits - 1))).to(torch.int8)
    return out.t().contiguous() if dim == 0 else out


def _reduce_min_max(w: torch.Tensor, s: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    if s.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if s.strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    n, k = w.shape
    if k % s.group_size:
        raise QuantSchemeError(f"in_features {k} is not a multiple of group_size {s.group_size}: "
                               "pick a group size that divides it (e.g. 32)")
    g = w.reshape(n, k // s.group_size, s.group_size)
    return g.amin(dim=2), g.amax(dim=2)


def _expand(t: torch.Tensor, s: Scheme, shape: torch.Size) -> torch.Tensor:
    """Broadcast a per-tensor/channel/group parameter to the full weight shape."""
    if s.strategy == "group":
        return t.repeat_interleave(s.group_size, dim=1)[:, : shape[1]]
    return t.reshape(-1, 1) if t.numel() > 1 else t.reshape(1, 1)


def quantize_weight(w: torch.Tensor, scheme: dict | Scheme) -> dict[str, torch.Tensor]:
    """RTN (min/max) quantization of a [N, K] weight into the checkpoint tensors for `scheme`."""
    s = parse_scheme(scheme)
    w = w.detach()
    lo, hi = _reduce_min_max(w, s)
    lo, hi = torch.clamp(lo, max=0), torch.clamp(hi, min=0)  # zero must stay representable
    qmin, qmax = s.qrange()
    if s.symmetric:
        scale = torch.maximum(lo.abs(), hi.abs()) / ((qmax - qmin) / 2)
        zp = None
    else:
        scale = (hi - lo) / (qmax - qmin)
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    if not s.symmetric:
        zp = torch.round(torch.clamp(qmin - lo / scale, qmin, qmax)).to(torch.int8)
    scaled = w / _expand(scale, s, w.shape)
    if zp is not None:
        scaled = scaled + _expand(zp, s, w.shape).to(w.dtype)
    scaled = torch.clamp(scaled, qmin, qmax)
    out: dict[str, torch.Tensor] = {}
    if s.weight_type == "float":
        out["weight"] = scaled.to(torch.float8_e4m3fn)
    else:
        q = torch.round(scaled).to(torch.int8)
        if s.packed:
            out["weight_packed"] = pack_int32(q, s.bits)
            out["weight_shape"] = torch.tensor(list(w.shape))
        else:
            out["weight"] = q
    out["weight_scale"] = scale
    if zp is not None:
        out["weight_zero_point"] = pack_int32(zp, s.bits, dim=0) if s.packed and s.strategy != "tensor" else zp
    return out


def unpacked_int_weight(tensors: dict[str, torch.Tensor], scheme: dict | Scheme) -> tuple[torch.Tensor,
                                                                                          torch.Tensor | None]:
    """The int8 weight [N, K] and unpacked int8 zero point (or None) of an int checkpoint layer."""
    s = parse_scheme(scheme)
    if s.packed:
        n, k = (int(v) for v in tensors["weight_shape"].tolist())
        q = unpack_int32(tensors["weight_packed"], s.bits, k)
    else:
        q = tensors["weight"]
        n = q.shape[0]
    zp = tensors.get("weight_zero_point")
    if zp is not None and s.packed and s.strategy != "tensor":
        zp = unpack_int32(zp, s.bits, n, dim=0)
    return q, zp


def dequantize(tensors: dict[str, torch.Tensor], scheme: dict | Scheme) -> torch.Tensor:
    """fp32 [N, K] weight of one checkpoint layer (scheme None-free; dense layers need no reference)."""
    s = parse_scheme(scheme)
    scale = tensors["weight_scale"].float()
    if s.weight_type == "float":
        w = tensors["weight"].float()
        zp = None
    else:
        q, zp = unpacked_int_weight(tensors, s)
        w = q.float()
    if zp is not None:
        w = w - _expand(zp, s, w.shape).float()
    return w * _expand(scale, s, w.shape)


def quantize_activations(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token quantization of activations [M, K]: (q, scale [M, 1]).

    `kind` "int" gives int8 (scale = absmax / 127.5, as compressed-tensors computes it), "float" gives FP8 E4M3
    (scale = absmax / 448). Done in torch on purpose: fp32->fp8 inside a Triton kernel is unreliable.
    """
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    if kind == "float":
        scale = torch.clamp(amax / 448.0, min=torch.finfo(torch.float32).eps)
        return torch.clamp(x.float() / scale, -448.0, 448.0).to(torch.float8_e4m3fn), scale
    scale = torch.clamp(amax / 127.5, min=torch.finfo(torch.float32).eps)
    return torch.clamp(torch.round(x.float() / scale), -128, 127).to(torch.int8), scale


def reference_linear(x: torch.Tensor, tensors: dict[str, torch.Tensor], scheme: dict | Scheme,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) in fp32, activations quantized first when the scheme says so."""
    s = parse_scheme(scheme)
    w = dequantize(tensors, s)
    xf = x.float()
    if s.act_type is not None and s.act_dynamic:
        q, xs = quantize_activations(xf.reshape(-1, xf.shape[-1]), s.act_type)
        xf = (q.float() * xs).reshape(xf.shape)
    y = xf @ w.t()
    return y + bias.float() if bias is not None else y
