"""The row-interleaved (R8) FP8 GEMV (kernels/cpu_kernels.cpp fp8_matmul_r8): every E4M3 code widened exactly,
agreement with the reference on odd shapes, AVX2 and AVX-512 bit for bit, a row alone and in a batch bit for bit,
and FP8_DYNAMIC layers keeping the reference's per-token activation quantize-dequantize bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from qtoolkit.kernels import dispatch
from qtoolkit.kernels import scheme as S
from qtoolkit.kernels.cpu_build import cpu_kernels, engine_ops
from qtoolkit.kernels.reference import quantize_activations, quantize_weight, reference_linear

from qtoolkit.model.quant_linear import make_linear

pytestmark = pytest.mark.skipif(cpu_kernels() is None or engine_ops() is None, reason="AVX2 extension unavailable")

NONE = torch.empty(0, dtype=torch.int8)
# every byte but E4M3's two NaNs (0x7F, 0xFF)
CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def _isas() -> tuple[int, ...]:
    return (0, 1) if cpu_kernels().fp8_r8_isa() == 1 else (0,)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _repack(w8: torch.Tensor, scales: torch.Tensor):
    return cpu_kernels().fp8_repack_r8(w8.view(torch.uint8).contiguous(), scales.reshape(-1).float().contiguous())


def test_every_code_is_widened_exactly():
    """Each finite E4M3 code as a weight, read through a one-hot activation row: the kernel's value is the code's
    own value times the row scale, exactly, at either ISA."""
    ext = cpu_kernels()
    n = CODES.numel() // 2  # 127 rows of 2 codes: a padded last group of 8
    w = CODES.reshape(n, 2)
    k = 4  # one 4-element unit per row, the last two elements zero
    w4 = torch.zeros(n, k, dtype=torch.uint8)
    w4[:, :2] = w
    scales = torch.full((n,), 0.5)
    ws, s, z = _repack(w4, scales)
    want = w4.view(torch.float8_e4m3fn).float() * 0.5
    for isa in _isas():
        y = ext.fp8_matmul_r8(torch.eye(k), ws, s, z, k, isa)  # y[j, r] = w[r, j] * scale
        assert torch.equal(y.t(), want)


@pytest.mark.parametrize("n,k", [(1, 4), (3, 12), (45, 640), (8, 20), (13, 1540), (960, 576), (576, 1536)])
def test_r8_matches_reference_on_odd_shapes(n, k):
    ext = cpu_kernels()
    g = torch.Generator().manual_seed(n * k)
    w8 = (torch.randn(n, k, generator=g) * 0.05).to(torch.float8_e4m3fn)
    scales = torch.rand(n, generator=g) + 0.5
    ws, s, z = _repack(w8, scales)
    assert ws.shape == (n, k) and s.numel() == (n + 7) // 8 * 8
    dense = w8.float().double() * scales.double()[:, None]
    for m in (1, 2, 3, 5, 24):
        x = torch.randn(m, k, generator=g)
        ys = [ext.fp8_matmul_r8(x, ws, s, z, k, isa) for isa in _isas()]
        assert ys[0].shape == (m, n)
        assert _rel(ys[0], x.double() @ dense.t()) < 1e-6
        for y in ys[1:]:
            assert torch.equal(y, ys[0])  # AVX2 == AVX-512
        for i in (0, m - 1):  # a row alone gives its bits in the batch
            assert torch.equal(ext.fp8_matmul_r8(x[i:i + 1].contiguous(), ws, s, z, k, -1), ys[0][i:i + 1])


def test_every_code_as_weight_and_activation():
    """Activations whose per-token FP8 quantization is exact (each row is E4M3 codes times a power of two) against
    weights spanning every code: the kernel's sums match float64's to fp32 rounding."""
    ext = cpu_kernels()
    vals = CODES.view(torch.float8_e4m3fn).float()  # 254 values including +-448 and the subnormals
    k = 256
    x = torch.zeros(2, k)
    x[0, :vals.numel()] = vals * 2.0 ** -4
    x[1, :vals.numel()] = vals.flip(0)
    w = torch.zeros(9, k, dtype=torch.uint8)
    for r in range(9):
        w[r, :CODES.numel()] = CODES.roll(17 * r)
    scales = torch.linspace(0.25, 2.0, 9)
    ws, s, z = _repack(w, scales)
    ref = x.double() @ (w.view(torch.float8_e4m3fn).float().double() * scales.double()[:, None]).t()
    for isa in _isas():
        assert _rel(ext.fp8_matmul_r8(x, ws, s, z, k, isa), ref) < 1e-6
    # those rows survive the per-token quantize-dequantize unchanged, so FP8_DYNAMIC's layer sees them as given
    torch.testing.assert_close(engine_ops().fake_quant_tokens(x, True), x, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-weight"])
@pytest.mark.parametrize("n,k", [(45, 640), (7, 20), (576, 576)])
def test_fp8_layers_bind_r8_and_keep_the_reference_activations(scheme, n, k):
    """An FP8 layer binds the R8 GEMV; a dynamic layer runs it behind the per-token quantize-dequantize, whose
    bits are the reference's (kernels/reference.py quantize_activations) -- the GEMV sees exactly them."""
    sch = S.fp8_dynamic() if scheme == "fp8-dynamic" else S.fp8_weight_only()
    torch.manual_seed(k)
    t = quantize_weight(torch.randn(n, k) * 0.05, sch)
    lin = make_linear(t, sch)
    assert lin.bound_gemv.code == dispatch.GEMV_FP8_R8
    ws, s, z, group = lin.gemv_args
    for m in (1, 3, dispatch.FP8_GEMV_MAX_M):
        x = torch.randn(m, k) * 3
        y = lin(x)
        if scheme == "fp8-dynamic":
            q, scale = quantize_activations(x, "float")
            x_ref = q.float() * scale
            assert torch.equal(engine_ops().fake_quant_tokens(x, True), x_ref)
        else:
            x_ref = x
        assert torch.equal(y, cpu_kernels().fp8_matmul_r8(x_ref, ws, s, z, group, -1))
        assert _rel(y, reference_linear(x, t, sch, None)) < 1e-5


def test_ab_switch_and_bad_inputs(monkeypatch):
    ext = cpu_kernels()
    sch = S.fp8_weight_only()
    t = quantize_weight(torch.randn(16, 64) * 0.05, sch)
    monkeypatch.setenv("QTOOLKIT_CPU_R8", "0")
    assert make_linear(t, sch).bound_gemv is None  # the checkpoint-layout kernel, for A/B measurements
    monkeypatch.delenv("QTOOLKIT_CPU_R8")
    ws, s, z, group = make_linear(t, sch).gemv_args
    with pytest.raises(RuntimeError, match="K"):
        ext.fp8_matmul_r8(torch.randn(1, 128), ws, s, z, group, -1)
    with pytest.raises(RuntimeError, match="scales"):
        ext.fp8_matmul_r8(torch.randn(1, 64), ws, s[:8], z, group, -1)
    with pytest.raises(RuntimeError, match="K % 4"):
        ext.fp8_repack_r8(torch.zeros(8, 6, dtype=torch.uint8), torch.ones(8))
    if ext.fp8_r8_isa() == 0:
        with pytest.raises(RuntimeError, match="ISA"):
            ext.fp8_matmul_r8(torch.randn(1, 64), ws, s, z, group, 1)


def test_isa_follows_aten_cpu_capability():
    """ATEN_CPU_CAPABILITY=avx2 holds the FP8 GEMV to its AVX2 rows, as it holds torch's own kernels."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    probe = "from qtoolkit.kernels.cpu_build import cpu_kernels; print(cpu_kernels().fp8_r8_isa())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0"]
