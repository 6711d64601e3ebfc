"""Linear layers built from one layer's checkpoint tensors: dense, or quantized and kept packed in memory.

Layouts held in memory (chosen once at load, never dequantized to fp32 there):
- INT4 pack-quantized: the checkpoint's own int32 words [N, K/8] (8 nibbles per word, +8 offset), which the
  Triton kernel, the prefill path and saving read directly. On a CPU the decode GEMV reads a row-interleaved copy
  made once at load (kernels.dispatch.bind_cpu_gemv), so INT4 weights take twice their bytes in host memory.
  INT8 and FP8 layers likewise (with or without per-token activation quantization).
- other int widths (INT8 W8A16/W8A8, INT3/INT2): unpacked once to int8 [N, K]. For 8 bits that is the same byte
  count; for 2-3 bits it trades a little memory for one simple kernel (those schemes are canaries, not products).
- FP8 E4M3: the checkpoint's float8 [N, K].
Scales become fp32 [N, K/group] (per-channel and per-tensor as [N, 1]); zero points are unpacked to int8 like
the scales (they are 1/group of the weight). Every forward goes through kernels.dispatch.
"""

from __future__ import annotations

import torch
from qtoolkit.kernels import dispatch
from qtoolkit.kernels.cpu import dequantize_fp8, dequantize_int4, dequantize_int8
from qtoolkit.kernels.cpu_build import cpu_kernels
from qtoolkit.kernels.reference import unpack_int32
from qtoolkit.kernels.scheme import QuantSchemeError, Scheme, parse_scheme
from torch import nn


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("bias", None if bias is None else bias.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.dense_linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        return self.weight.nbytes

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float()


class QuantLinear(nn.Module):
    """A quantized Linear; the buffer names and attributes are the contract kernels.dispatch reads."""

    def __init__(self, kind: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 in_features: int, group_size: int, act: str | None, bias: torch.Tensor | None = None):
        super().__init__()
        self.kind, self.act = kind, act
        self.in_features, self.out_features = in_features, qweight.shape[0]
        self.group_size = group_size
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("zeros", torch.empty(0, dtype=torch.int8) if zeros is None
                             else zeros.to(torch.int8).contiguous())
        self.register_buffer("bias", None if bias is None else bias.contiguous())
        self._bind_gemv()

    def _bind_gemv(self) -> None:
        """The CPU INT4 GEMV and its tensor arguments as plain attributes, which kernels.dispatch reads without
        nn.Module's buffer lookups."""
        self.bound_gemv = bound = dispatch.bind_cpu_gemv(self)
        self.cpu_gemv, self.gemv_args, self.gemv_max_m = (bound.fn, bound.args, bound.max_rows) if bound else (
            None, (), 0)

    def _apply(self, fn, recurse=True):  # .to() / .cuda() replace the buffers: rebind
        out = super()._apply(fn, recurse)
        self._bind_gemv()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.quant_linear(x, self)

    def weight_bytes(self) -> int:
        """Bytes a decode step reads for this layer's rows: the copy the CPU GEMV was bound to when there is one
        (R8, its scales bf16 where that is exact; the padding rows of its last group of 8 not counted), else the
        checkpoint-layout buffers."""
        if self.bound_gemv is None:
            return self.qweight.nbytes + self.scales.nbytes + self.zeros.nbytes
        w, s, z = self.gemv_args[:3]
        groups = self.scales.numel()  # rows x groups per row
        return w.nbytes + groups * (s.element_size() + (z.element_size() if z.numel() else 0))

    def dequantized_weight(self) -> torch.Tensor:
        zeros = self.zeros.cpu() if self.zeros.numel() else None
        q, s = self.qweight.cpu(), self.scales.cpu()
        if self.kind == "int4":
            return dequantize_int4(q, s, zeros, self.group_size)
        if self.kind == "int8":
            return dequantize_int8(q, s, zeros, self.group_size)
        return dequantize_fp8(q, s)

    def extra_repr(self) -> str:
        return (f"{self.kind}, in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"act={self.act}, zeros={bool(self.zeros.numel())}, bias={self.bias is not None}")


class ConcatLinear(nn.Module):
    """Fallback fusion for layers that cannot share one weight (different schemes): run each, concatenate."""

    def __init__(self, mods: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(mods)
        self.in_features = mods[0].in_features
        self.out_features = sum(m.out_features for m in mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.parts], dim=-1)

    def weight_bytes(self) -> int:
        return sum(m.weight_bytes() for m in self.parts)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([m.dequantized_weight() for m in self.parts], dim=0)


def _per_row(t: torch.Tensor, n: int) -> torch.Tensor:
    """Scales/zeros as [N, G]: per-tensor [1] and per-channel [N] or [N, 1] become [N, 1]."""
    t = t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(-1, 1)
    return t.expand(n, t.shape[1]).contiguous() if t.shape[0] == 1 else t


def make_linear(tensors: dict[str, torch.Tensor], scheme: dict | Scheme | None,
                bias: torch.Tensor | None = None) -> nn.Module:
    """A Linear from one layer's checkpoint tensors (keys without the module prefix); scheme None = dense."""
    if scheme is None:
        return DenseLinear(tensors["weight"], bias)
    s = parse_scheme(scheme)
    cpu_kernels()  # build (or load) the AVX2 kernels at model load, not on the first request
    if s.act_type is not None and not s.act_dynamic:
        raise QuantSchemeError("static activation scales are not supported: quantize with FP8_DYNAMIC or W8A8 "
                               "(dynamic per-token activations) instead")
    if s.weight_type == "float":
        w = tensors["weight"]
        n, k = w.shape
        kind, qweight, zeros = "fp8", w, None
    elif s.packed:
        n, k = (int(v) for v in tensors["weight_shape"].tolist())
        packed = tensors["weight_packed"]
        if s.bits == 4 and k % 8 == 0:
            kind, qweight = "int4", packed
        else:
            kind, qweight = "int8", unpack_int32(packed, s.bits, k)
        zeros = tensors.get("weight_zero_point")
        if zeros is not None and s.strategy != "tensor":
            zeros = unpack_int32(zeros, s.bits, n, dim=0)
    else:
        qweight = tensors["weight"].to(torch.int8)
        n, k = qweight.shape
        kind, zeros = "int8", tensors.get("weight_zero_point")
    group = s.group_size if s.strategy == "group" else k
    scales = _per_row(tensors["weight_scale"], n)
    if zeros is not None:
        zeros = _per_row(zeros, n)
    if scales.shape != (n, k // group):
        raise QuantSchemeError(f"weight_scale has shape {tuple(scales.shape)}, expected {(n, k // group)}: "
                               "the checkpoint does not match its quantization_config")
    return QuantLinear(kind, qweight, scales, zeros, k, group, s.act_type, bias)


def _bias_or_zeros(m: nn.Module) -> torch.Tensor:
    b = m.bias
    if b is not None:
        return b
    ref = m.weight if isinstance(m, DenseLinear) else m.scales
    return torch.zeros(m.out_features, dtype=ref.dtype, device=ref.device)


def fuse_linears(mods: list[nn.Module]) -> nn.Module:
    """One module computing torch.cat([m(x) for m in mods], -1) with a single weight where formats allow."""
    if len(mods) == 1:
        return mods[0]
    first = mods[0]
    bias = None
    if any(m.bias is not None for m in mods):
        bias = torch.cat([_bias_or_zeros(m) for m in mods])
    if all(isinstance(m, DenseLinear) and m.weight.dtype == first.weight.dtype
           and m.in_features == first.in_features for m in mods):
        return DenseLinear(torch.cat([m.weight for m in mods]), bias)
    same = all(isinstance(m, QuantLinear) and (m.kind, m.group_size, m.act, m.in_features, m.qweight.dtype)
               == (first.kind, first.group_size, first.act, first.in_features, first.qweight.dtype)
               and bool(m.zeros.numel()) == bool(first.zeros.numel()) for m in mods)
    if not same:
        return ConcatLinear(mods)
    zeros = torch.cat([m.zeros for m in mods]) if first.zeros.numel() else None
    return QuantLinear(first.kind, torch.cat([m.qweight for m in mods]), torch.cat([m.scales for m in mods]),
                       zeros, first.in_features, first.group_size, first.act, bias)
