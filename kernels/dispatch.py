"""The one dispatch point of every Linear: CUDA tensors go to Triton, CPU tensors to the fastest CPU path.

`quant_linear(x, layer)` reads a prepared layer (qtoolkit/model/quant_linear.py builds it):
  kind      "int4" (qweight: checkpoint-packed int32 [N, K/8]), "int8" (qweight: int8 [N, K], any int <= 8 bit
            unpacked once at load), or "fp8" (qweight: float8_e4m3fn [N, K])
  scales    fp32 [N, K/group_size]; zeros: int8 like scales, or empty (symmetric)
  act       None (weight-only) or "int"/"float": dynamic per-token activation quantization (W8A8, FP8_DYNAMIC)
  bias      tensor or None
The output has x's dtype and shape [..., N].
"""

from __future__ import annotations

import torch

from . import cpu
from .cpu_build import engine_ops
from .reference import quantize_activations


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Unquantized layers: fp32 activations take the CPU paths of kernels/cpu.py (fp32 or bf16 weights);
    anything else runs in the weight's dtype through torch. The output has x's dtype."""
    if not x.is_cuda and x.dtype == torch.float32 and cpu.dense_fast_ok(weight):
        shape = x.shape
        y = cpu.dense_linear(x.reshape(-1, shape[-1]), weight)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])
    y = torch.nn.functional.linear(x.to(weight.dtype), weight, bias)
    return y.to(x.dtype)


def _fake_quant_tokens(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token quantize-dequantize: the reference semantics of dynamic activation schemes (one AVX2-build op
    on CPU, bit-identical to the torch ops it replaces)."""
    ops = engine_ops() if not x.is_cuda and x.dtype == torch.float32 and x.dim() == 2 else None
    if ops is not None:
        return ops.fake_quant_tokens(x, kind == "float")
    q, scale = quantize_activations(x, kind)
    return q.float() * scale


def _cpu(x2: torch.Tensor, layer) -> torch.Tensor:
    x2 = x2.float().contiguous()
    if layer.act is not None:
        x2 = _fake_quant_tokens(x2, layer.act)
    zeros = layer.zeros if layer.zeros.numel() else None
    if layer.kind == "int4":
        return cpu.int4_linear(x2, layer.qweight, layer.scales, zeros, layer.group_size)
    if layer.kind == "int8":
        return cpu.int8_linear(x2, layer.qweight, layer.scales, zeros, layer.group_size)
    return cpu.fp8_linear(x2, layer.qweight, layer.scales)


def _cuda(x2: torch.Tensor, layer) -> torch.Tensor:
    zeros = layer.zeros if layer.zeros.numel() else None
    if layer.kind == "fp8":
        from .fp8_matmul import fp8_linear

        if layer.act == "float":  # FP8 x FP8 on the tensor cores; activations quantized in torch (see reference)
            xq, xs = quantize_activations(x2, "float")
            return fp8_linear(xq, layer.qweight, layer.scales, x_scale=xs, out_dtype=x2.dtype)
        return fp8_linear(x2, layer.qweight, layer.scales, out_dtype=x2.dtype)
    from .int4_matmul import int_linear, supported

    if not supported(layer.in_features, layer.group_size):  # odd group sizes: dequantize, then cuBLAS
        w = layer.dequantized_weight().to(x2.device, x2.dtype)
        return x2 @ w.t()
    if layer.act is not None:
        x2 = _fake_quant_tokens(x2, layer.act).to(x2.dtype)
    return int_linear(x2, layer.qweight, layer.scales, zeros, layer.group_size, packed=layer.kind == "int4")


def quant_linear(x: torch.Tensor, layer) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    y = _cuda(x2, layer) if x.is_cuda else _cpu(x2, layer)
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])
