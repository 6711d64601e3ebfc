"""The prefill path of quantized Linears (kernels/cpu.py): the C++ dequantizers give the torch reference's bits,
the fused dequantize-and-multiply kernel (one parallel region, blocks of rows) gives x @ W^T of those bits, and
without the C++ build a whole layer dequantized into the reused buffer gives the blocked path's result."""

from __future__ import annotations

import pytest
import torch
from qtoolkit.kernels import cpu
from qtoolkit.kernels.cpu_build import cpu_kernels
from qtoolkit.kernels.reference import pack_int32, unpack_int32

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="AVX2 extension unavailable here")


@pytest.mark.parametrize(("n", "k", "group", "asym"), [(45, 576, 576, False), (7, 96, 32, True), (3, 40, 8, True),
                                                      (5, 21, 7, False), (960, 576, 64, True)])
def test_int8_dequantize_is_the_torch_ops_bit_for_bit(n, k, group, asym):
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // group, generator=g) / 100
    zeros = torch.randint(-8, 8, (n, k // group), dtype=torch.int8, generator=g) if asym else None
    ref = cpu._dequantize_int8_torch(q, scales, zeros, group)
    assert torch.equal(cpu.dequantize_int8(q, scales, zeros, group), ref)
    buf = torch.empty(n * k + 5)
    assert torch.equal(cpu.dequantize_int8(q, scales, zeros, group, buf), ref)


@pytest.mark.parametrize(("group", "asym"), [(32, True), (64, False), (128, True)])
def test_int4_dequantize_is_the_torch_ops_bit_for_bit(group, asym):
    g = torch.Generator().manual_seed(group)
    n, k = 13, 640
    nibbles = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    packed = pack_int32(nibbles - 8, 4)  # the checkpoint's offset-by-8 words
    scales = torch.rand(n, k // group, generator=g)
    zeros = torch.randint(-8, 8, (n, k // group), dtype=torch.int8, generator=g) if asym else None
    ref = cpu._dequantize_int8_torch(unpack_int32(packed, 4, k), scales, zeros, group)
    assert torch.equal(cpu.dequantize_int4(packed, scales, zeros, group), ref)


def test_whole_layer_and_blocked_prefill_agree(monkeypatch):
    g = torch.Generator().manual_seed(0)
    n, k = 300, 64
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, 1, generator=g)
    x = torch.randn(40, k, generator=g)
    fused = cpu.int8_linear(x, q, scales, None, k, gemv=False)
    monkeypatch.setattr(cpu, "cpu_kernels", lambda: None)  # the path without the C++ build
    whole = cpu.int8_linear(x, q, scales, None, k, gemv=False)
    torch.testing.assert_close(whole, fused, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(cpu, "FULL_DEQUANT_BYTES", 0)
    monkeypatch.setattr(cpu, "BLOCK_BYTES", 64 * 4 * 16)  # 16-row blocks
    blocked = cpu.int8_linear(x, q, scales, None, k, gemv=False)
    torch.testing.assert_close(whole, blocked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, x @ (q.float() * scales).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("m", "n", "k"), [(17, 45, 256), (300, 96, 576), (40, 7, 20)])
def test_w8a8_prefill_multiplies_int8_by_int8_with_the_reference_activations(m, n, k, monkeypatch):
    """A W8A8 layer's prefill quantizes activations per token as the reference does and sums int8 products exactly
    (torch._int_mm); only the final scaling rounds, so it sits within fp32 rounding of the reference."""
    from qtoolkit.kernels import dispatch
    from qtoolkit.kernels import scheme as S
    from qtoolkit.kernels.reference import quantize_weight, reference_linear

    from qtoolkit.model.quant_linear import make_linear

    g = torch.Generator().manual_seed(m)
    t = quantize_weight(torch.randn(n, k, generator=g) * 0.05, S.w8a8_int())
    lin = make_linear(t, S.w8a8_int())
    assert dispatch.int8_int8_ok(lin)
    calls = []
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.dtype) or torch.ops.aten._int_mm(a, b))
    ops = dispatch.engine_ops()

    class Counting:  # the AVX2 build's path: one int8 x int8 GEMM op over blocks of the weight's rows
        def __getattr__(self, name):
            if name == "int8_int8_matmul":
                return lambda q, *a: calls.append(q.dtype) or ops.int8_int8_matmul(q, *a)
            return getattr(ops, name)

    monkeypatch.setattr(dispatch, "engine_ops", Counting)
    x = torch.randn(m, k, generator=g) * 2
    y = lin(x)
    assert calls == [torch.int8]
    ref = reference_linear(x, t, S.w8a8_int(), None)
    assert float((y - ref).norm() / ref.norm()) < 1e-6


def _fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0  # E4M3's NaN codes: no checkpoint holds them
    return codes.view(torch.float8_e4m3fn), torch.rand(n, 1, generator=g) / 10


@pytest.mark.parametrize(("m", "n", "k", "block"), [(256, 960, 576, 512 << 10), (33, 45, 64, 1), (1, 8, 16, 1 << 20),
                                                    (100, 3072, 128, 4096), (0, 16, 32, 4096)])
@pytest.mark.parametrize("threads", [1, 3])
def test_fused_dequant_matmul_is_x_times_the_dequantized_weight(m, n, k, block, threads):
    """Every kind's fused prefill kernel against x @ W^T with W from the dequantizers (the torch reference's bits),
    for blocks of one row group up to the whole layer, thread counts that split N unevenly, and an empty x."""
    ext = cpu_kernels()
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g)
    group = 32 if k % 64 == 0 else k
    nibbles = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    packed = pack_int32(nibbles - 8, 4)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // group, generator=g) / 50
    zeros = torch.randint(-8, 8, (n, k // group), dtype=torch.int8, generator=g)
    w8, s8 = _fp8_weight(n, k, g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = {"int8": ext.int8_dequant_matmul(x, q, scales, zeros, group, block),
               "fp8": ext.fp8_dequant_matmul(x, w8.view(torch.uint8), s8.reshape(-1), block)}
        if k % 64 == 0:
            got["int4"] = ext.int4_dequant_matmul(x, packed, scales, zeros, group, block)
    finally:
        torch.set_num_threads(before)
    want = {"int8": x @ cpu.dequantize_int8(q, scales, zeros, group).t(),
            "fp8": x @ (w8.float() * s8).t(), "int4": x @ cpu.dequantize_int4(packed, scales, zeros, group).t()}
    for kind, y in got.items():
        assert y.shape == (m, n)
        torch.testing.assert_close(y, want[kind], rtol=1e-5, atol=1e-4, msg=kind)


def test_prefill_linears_take_the_fused_kernel(monkeypatch):
    """Above the GEMV's rows every kind's Linear runs the fused kernel, once per call, with the same result as the
    path without the C++ build (whole-layer dequantization, then sgemm)."""
    from qtoolkit.kernels import cpu_build

    ext = cpu_kernels()
    g = torch.Generator().manual_seed(7)
    n, k, m = 96, 128, 64
    x = torch.randn(m, k, generator=g)
    w8, s8 = _fp8_weight(n, k, g)
    packed = pack_int32(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g) - 8, 4)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // 32, generator=g) / 50
    runs = {"int4": lambda: cpu.int4_linear(x, packed, scales, None, 32, gemv=False),
            "int8": lambda: cpu.int8_linear(x, q, scales, None, 32, gemv=False),
            "fp8": lambda: cpu.fp8_linear(x, w8, s8, gemv=False)}
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name):
            if name.endswith("_dequant_matmul"):
                calls.append(name)
            return getattr(ext, name)

    for kind, run in runs.items():
        monkeypatch.setattr(cpu, "cpu_kernels", Counting)
        fused = run()
        assert calls[-1] == f"{kind}_dequant_matmul"
        monkeypatch.setattr(cpu, "cpu_kernels", lambda: None)
        torch.testing.assert_close(fused, run(), rtol=1e-5, atol=1e-4, msg=kind)
    assert len(calls) == 3
    assert cpu_build.cpu_kernels() is ext


@pytest.mark.parametrize(("m", "k"), [(256, 576), (3, 21), (1, 8), (0, 16), (17, 1536)])
def test_w8a8_quantization_and_rescale_ops_are_the_torch_ops_bit_for_bit(m, k):
    """The W8A8 prefill's two engine ops against the torch ops they replace: per-token int8 quantization (an
    all-zero row, one huge column, ties at .5 included) and the int32 sums' rescale."""
    from qtoolkit.kernels.cpu_build import engine_ops
    from qtoolkit.kernels.reference import quantize_activations

    ops = engine_ops()
    g = torch.Generator().manual_seed(m * k + 1)
    x = torch.randn(m, k, generator=g) * 3
    if m:
        x[:, 0] *= 50
        x[0] = 0
    if m > 1:
        x[1] = torch.arange(k, dtype=torch.float32) - k / 2  # whole and half steps of the scale
    q, sx = ops.quantize_tokens_int8(x)
    want_q, want_sx = quantize_activations(x, "int")
    assert torch.equal(q, want_q) and torch.equal(sx, want_sx)
    acc = torch.randint(-(2**22), 2**22, (m, k), dtype=torch.int32, generator=g)
    sw = torch.rand(k, generator=g)
    assert torch.equal(ops.int8_rescale(acc, sx, sw), acc.float() * sx * sw.reshape(1, -1))


@pytest.mark.parametrize(("m", "n", "k"), [(256, 960, 576), (5, 3, 32), (0, 16, 32), (40, 100, 1536)])
@pytest.mark.parametrize("threads", [1, 3])
def test_w8a8_gemm_by_row_blocks_is_int_mm_then_the_rescale_bit_for_bit(m, n, k, threads):
    from qtoolkit.kernels.cpu_build import engine_ops

    ops = engine_ops()
    g = torch.Generator().manual_seed(m + n + k)
    q = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    sx, sw = torch.rand(m, 1, generator=g), torch.rand(n, generator=g)
    want = (q.int() @ w.int().t()).float() * sx * sw.reshape(1, -1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.int8_int8_matmul(q, sx, w, sw)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
