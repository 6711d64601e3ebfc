"""The one dispatch point of every Linear: CUDA tensors go to Triton, CPU tensors to the fastest CPU path.

Every choice between paths, and every threshold it rests on, lives here; kernels/cpu.py, int4_matmul.py and
fp8_matmul.py only run the path they are given.

`quant_linear(x, layer)` reads a prepared layer (qtoolkit/model/quant_linear.py builds it):
  kind      "int4" (qweight: checkpoint-packed int32 [N, K/8]), "int8" (qweight: int8 [N, K], any int <= 8 bit
            unpacked once at load), or "fp8" (qweight: float8_e4m3fn [N, K])
  scales    fp32 [N, K/group_size]; zeros: int8 like scales, or empty (symmetric)
  act       None (weight-only) or "int"/"float": dynamic per-token activation quantization (W8A8, FP8_DYNAMIC)
  bias      tensor or None
  bound_gemv  the CPU GEMV bound at load (bind_cpu_gemv), or None; cpu_gemv, gemv_args, gemv_max_m: its fn,
            args and max_rows as plain attributes
The output has x's dtype and shape [..., N].

CPU thresholds, measured on an AVX2 EPYC (`qtool bench kernels --threads 1`, weights streamed from DRAM):
- M <= the GEMV limit: the AVX2 kernels read the packed weight once and dequantize in registers (INT4 M=1 runs
  at 3.5x dense fp32 on 4096x4096). Above it (prefill, big batches) the GEMV's per-row integer work grows with M,
  while dequantizing a block of rows into a cache-sized fp32 buffer and running MKL sgemm on it amortizes over
  the rows (INT4 at M=64 they tie; at M=256 the blocked path wins).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cpu
from .cpu_build import engine_ops
from .reference import quantize_activations

# Largest batch (rows of x) that goes through the register-dequant GEMV kernels; above it blocked dequant + sgemm.
# INT4 does less integer work per weight than INT8 (two nibbles per byte, one FMA per 32 weights), so its
# crossover with the blocked path comes later (M ~ 64 vs ~ 24 for INT8 on 4096x4096).
GEMV_MAX_M = 16
INT4_GEMV_MAX_M = 32
# FP8 widens each weight chunk once for 8 rows of x: on 30 x SmolLM2's projections from DRAM its GEMV beats fp32
# by 1.25x at M = 16 and 1.1x at 24; from 32 rows the blocked path is faster.
FP8_GEMV_MAX_M = 24
# Dense fp32 layers: the AVX2 GEMV of cpu_engine_ops.cpp reads each weight row once for all rows of x; on a
# decoder's worth of fp32 layers streamed from DRAM it beats MKL's W @ x^T up to 16 rows and loses from 32. bf16
# weights widen in registers and win up to 32 rows (torch's bf16 matmul has no native bf16 compute on AVX2);
# above that they are widened block by block.
DENSE_GEMV_MAX_M = 16
BF16_GEMV_MAX_M = 32
# Between the GEMV and this many rows, MKL runs W @ x^T faster than x @ W^T (1.1-1.3x at M = 16-32 on N >= 960,
# K = 576); for prefill-sized M the usual order is faster.
SGEMM_TRANSPOSED_MAX_M = 64
# Triton: up to this many rows a step is memory-bound (decode) and takes the small-tile, split-K configs; above
# it the large square tiles of the compute-bound prefill.
TRITON_DECODE_MAX_M = 32


# Kernel codes of the fused decode loop (kernels/cpu_decode.cpp): the kernel a Linear takes for a few rows.
GEMV_DENSE, GEMV_INT4, GEMV_INT8, GEMV_FP8, GEMV_INT4_R8, GEMV_INT8_R8, GEMV_FP8_R8 = 0, 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class BoundGemv:
    """A Linear's CPU GEMV bound at load: fn(x, *args) for up to max_rows rows; code: its GEMV_* kernel code."""

    fn: Callable
    args: tuple
    max_rows: int
    code: int


def bind_cpu_gemv(layer) -> BoundGemv | None:
    """The CPU GEMV of an INT4, INT8 or FP8 layer and its arguments, bound once at load: a decode step makes ~120
    of these calls, and finding them per call (buffer lookups through nn.Module.__getattr__) costs ~10 us each.
    The kernels read a row-interleaved copy of the weight (R8, kernels/cpu_kernels.cpp) made here once: the
    checkpoint layout stays the module's buffer (prefill, GPU, saving), so these weights take twice their bytes
    in host memory; a decode step reads only the copy. A layer that quantizes its activations per token (FP8
    dynamic, INT8 W8A8) gets the GEMV behind the same quantize-dequantize the other paths run, so the bound call
    gives the reference semantics' activations. QTOOLKIT_CPU_R8=0 binds the kernels on the checkpoint layout
    instead (for A/B measurements; weight-only INT4 only, as before the R8 copies)."""
    ext = cpu.cpu_kernels()  # looked up through kernels.cpu, where the torch-fallback tests switch it off
    if ext is None or layer.qweight.is_cuda or (layer.act is not None and engine_ops() is None):
        return None
    r8 = os.environ.get("QTOOLKIT_CPU_R8", "1") != "0"
    args = (layer.qweight, layer.scales, layer.zeros, layer.group_size)
    bound = None
    if layer.kind == "int4" and cpu.int4_fast_ok(layer.in_features, layer.group_size):
        if not r8:
            bound = BoundGemv(ext.int4_matmul, args, INT4_GEMV_MAX_M, GEMV_INT4)
        else:
            bound = BoundGemv(ext.int4_matmul_r8, (*ext.int4_repack_r8(*args), layer.group_size), INT4_GEMV_MAX_M,
                              GEMV_INT4_R8)
    elif layer.kind == "int8" and cpu.int8_fast_ok(layer.in_features, layer.group_size) and r8:
        bound = BoundGemv(ext.int8_matmul_r8, (*ext.int8_repack_r8(*args), layer.group_size), GEMV_MAX_M,
                          GEMV_INT8_R8)
    elif layer.kind == "fp8" and layer.in_features % 4 == 0 and layer.group_size == layer.in_features and r8:
        repacked = ext.fp8_repack_r8(layer.qweight.view(torch.uint8), layer.scales.reshape(-1))
        bound = BoundGemv(ext.fp8_matmul_r8, (*repacked, layer.in_features), FP8_GEMV_MAX_M, GEMV_FP8_R8)
    if bound is None or layer.act is None:
        return bound
    if layer.kind == "int4":  # no INT4 scheme quantizes activations; keep the general path if one ever does
        return None
    return BoundGemv(_after_fake_quant(bound.fn, layer.act == "float"), bound.args, bound.max_rows, bound.code)


def _after_fake_quant(gemv: Callable, fp8: bool) -> Callable:
    """gemv behind the per-token activation quantize-dequantize (the one engine op _fake_quant_tokens runs)."""
    fake_quant = engine_ops().fake_quant_tokens

    def run(x: torch.Tensor, *args) -> torch.Tensor:
        return gemv(fake_quant(x, fp8), *args)

    return run


@dataclass(frozen=True)
class GemvSpec:
    """How the fused decode loop runs one Linear for up to `max_rows` rows: exactly the kernel calls (and their
    arguments) that dense_linear / quant_linear make for that many fp32 rows on a CPU: the per-token activation
    quantize-dequantize when `act` >= 0 (0 int8, 1 FP8), the GEMV, then `+ bias`."""

    kind: int
    weight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int
    bias: torch.Tensor | None
    max_rows: int
    act: int = -1


def gemv_spec(layer) -> GemvSpec | None:
    """The GEMV a Linear of qtoolkit/model/quant_linear.py takes for few fp32 rows on a CPU, or None when its
    few-row path is not one AVX2 GEMV (a concatenation, a CUDA weight, an odd shape, no AVX2 build)."""
    none = torch.empty(0)
    kind = getattr(layer, "kind", None)
    bias = getattr(layer, "bias", None)
    bias = None if bias is None else bias.float()
    if kind is None:  # DenseLinear (ConcatLinear has no `weight`)
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_cuda or not cpu.dense_fast_ok(weight):
            return None
        rows = DENSE_GEMV_MAX_M if weight.dtype == torch.float32 else BF16_GEMV_MAX_M
        return GemvSpec(GEMV_DENSE, weight, none, none, 0, bias, rows)
    if layer.qweight.is_cuda or cpu.cpu_kernels() is None or (layer.act is not None and engine_ops() is None):
        return None
    act = -1 if layer.act is None else int(layer.act == "float")
    bound = getattr(layer, "bound_gemv", None)
    if bound is not None:  # the GEMV bind_cpu_gemv bound at load
        w, s, z, group = bound.args
        return GemvSpec(bound.code, w, s, z, group, bias, bound.max_rows, act)
    if kind == "int4" and cpu.int4_fast_ok(layer.in_features, layer.group_size):
        return GemvSpec(GEMV_INT4, layer.qweight, layer.scales, layer.zeros, layer.group_size, bias,
                        INT4_GEMV_MAX_M, act)
    if kind == "int8" and cpu.int8_fast_ok(layer.in_features, layer.group_size):
        return GemvSpec(GEMV_INT8, layer.qweight, layer.scales, layer.zeros, layer.group_size, bias, GEMV_MAX_M,
                        act)
    if kind == "fp8" and layer.in_features % 16 == 0:
        return GemvSpec(GEMV_FP8, layer.qweight.view(torch.uint8), layer.scales.reshape(-1), none, 0, bias,
                        FP8_GEMV_MAX_M, act)
    return None


def cpu_dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x [M, K] @ weight [N, K]^T (fp32 or bf16 weight, cpu.dense_fast_ok) -> fp32 [M, N]."""
    m = x.shape[0]
    if weight.dtype == torch.float32:
        if m <= DENSE_GEMV_MAX_M:
            return cpu.dense_gemv(x, weight)
        if m <= SGEMM_TRANSPOSED_MAX_M:  # W @ x^T blocks better in MKL than x @ W^T for a few dozen rows
            return torch.mm(weight, x.t()).t().contiguous()
        return x @ weight.t()
    if m <= BF16_GEMV_MAX_M:
        return cpu.dense_gemv(x, weight)
    return cpu.widened_matmul(x, weight)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Unquantized layers: fp32 activations take the CPU paths (fp32 or bf16 weights); anything else runs in the
    weight's dtype through torch. The output has x's dtype."""
    if not x.is_cuda and x.dtype == torch.float32 and cpu.dense_fast_ok(weight):
        shape = x.shape
        y = cpu_dense(x.reshape(-1, shape[-1]), weight)
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


def int8_int8_ok(layer) -> bool:
    """W8A8 layers whose prefill multiplies int8 by int8 (torch._int_mm, oneDNN's VNNI GEMM on x86): symmetric
    per-channel weights, so one scale per output column and one per token factor out of the integer sums."""
    return (layer.kind == "int8" and layer.act == "int" and not layer.zeros.numel()
            and layer.group_size == layer.in_features and hasattr(torch, "_int_mm"))


def _int8_int8(x2: torch.Tensor, layer) -> torch.Tensor:
    """x quantized per token as the reference does (q, s_x), then (q @ W_q^T) * s_x * s_w: the reference's
    quantize-dequantize activations times the dequantized weight, with the sums exact in int32 instead of
    rounded in fp32 (on the default model's layers at 256-1024 rows, 2-4x fp32 sgemm's speed). Where the AVX2 build
    is there the quantization is one engine op and the GEMM plus rescale one parallel region (int8_int8_matmul,
    the torch ops' bits): on the default model's 120 Linears at 256 rows, 2 threads on the loaded 2-core machine,
    2.9-3.2 s against 5.3-5.4 s for _int_mm's own threading and a separate rescale (1 thread: 0.20-0.23 s vs
    0.21-0.28 s)."""
    ops = engine_ops()
    if ops is None:
        q, sx = quantize_activations(x2, "int")
        return torch._int_mm(q, layer.qweight.t()).float() * sx * layer.scales.reshape(1, -1)
    q, sx = ops.quantize_tokens_int8(x2)
    return ops.int8_int8_matmul(q, sx, layer.qweight.contiguous(), layer.scales.reshape(-1).float().contiguous())


def _cpu(x2: torch.Tensor, layer) -> torch.Tensor:
    x2 = x2.float().contiguous()
    m = x2.shape[0]
    if layer.cpu_gemv is not None and m <= layer.gemv_max_m:  # the bound GEMV (activations quantized inside)
        return layer.cpu_gemv(x2, *layer.gemv_args)
    if int8_int8_ok(layer):
        return _int8_int8(x2, layer)
    if layer.act is not None:
        x2 = _fake_quant_tokens(x2, layer.act)
    zeros = layer.zeros if layer.zeros.numel() else None
    if layer.kind == "int4":
        return cpu.int4_linear(x2, layer.qweight, layer.scales, zeros, layer.group_size, gemv=m <= INT4_GEMV_MAX_M)
    if layer.kind == "int8":
        return cpu.int8_linear(x2, layer.qweight, layer.scales, zeros, layer.group_size, gemv=m <= GEMV_MAX_M)
    return cpu.fp8_linear(x2, layer.qweight, layer.scales, gemv=m <= FP8_GEMV_MAX_M)


def _cuda(x2: torch.Tensor, layer) -> torch.Tensor:
    # the Triton kernels import triton, an optional dependency: only when a CUDA tensor arrives
    zeros = layer.zeros if layer.zeros.numel() else None
    decode = x2.shape[0] <= TRITON_DECODE_MAX_M
    if layer.kind == "fp8":
        from .fp8_matmul import fp8_linear

        if layer.act == "float":  # FP8 x FP8 on the tensor cores; activations quantized in torch (see reference)
            xq, xs = quantize_activations(x2, "float")
            return fp8_linear(xq, layer.qweight, layer.scales, x_scale=xs, out_dtype=x2.dtype, decode=decode)
        return fp8_linear(x2, layer.qweight, layer.scales, out_dtype=x2.dtype, decode=decode)
    from .int4_matmul import int_linear, supported

    if not supported(layer.in_features, layer.group_size):  # odd group sizes: dequantize, then cuBLAS
        w = layer.dequantized_weight().to(x2.device, x2.dtype)
        return x2 @ w.t()
    if layer.act is not None:
        x2 = _fake_quant_tokens(x2, layer.act).to(x2.dtype)
    return int_linear(x2, layer.qweight, layer.scales, zeros, layer.group_size, packed=layer.kind == "int4",
                      decode=decode)


def quant_linear(x: torch.Tensor, layer) -> torch.Tensor:
    gemv = layer.cpu_gemv  # plain attributes: the decode-step path below stays a few attribute reads
    if (gemv is not None and x.dim() == 2 and x.shape[0] <= layer.gemv_max_m and x.dtype == torch.float32
            and not x.is_cuda):
        y = gemv(x.contiguous(), *layer.gemv_args)
        return y if layer.bias is None else y + layer.bias.to(y.dtype)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    y = _cuda(x2, layer) if x.is_cuda else _cpu(x2, layer)
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])
