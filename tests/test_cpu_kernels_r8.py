"""The row-interleaved (R8) CPU GEMV kernels (kernels/cpu_kernels.cpp): agreement with the shared reference and
with the checkpoint-layout kernels, AVX2 and AVX-512 VNNI bit for bit, and the instruction set picked at run
time from what the CPU, the OS and ATEN_CPU_CAPABILITY allow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qtoolkit.kernels import dispatch
from qtoolkit.kernels import scheme as S
from qtoolkit.kernels.cpu_build import cpu_kernels
from qtoolkit.kernels.reference import quantize_weight, reference_linear

from qtoolkit.model.quant_linear import make_linear

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="AVX2 extension unavailable here")

INT4 = {"g32-asym": S.w4a16(32, symmetric=False), "g32": S.w4a16(32), "g64-asym": S.w4a16(64, symmetric=False),
        "g128": S.w4a16(128), "channel": S.config_group("pack-quantized", num_bits=4, strategy="channel")}
INT8 = {"channel": S.config_group("pack-quantized", num_bits=8, strategy="channel"), "g64": S.w8a16(64),
        "g32-asym": S.config_group("pack-quantized", num_bits=8, strategy="group", group_size=32,
                                   symmetric=False)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _vnni() -> bool:
    return cpu_kernels().r8_isa() == 1


def _layer(scheme, n: int, k: int, seed: int = 0):
    torch.manual_seed(seed)
    t = quantize_weight(torch.randn(n, k) * 0.05, scheme)
    return t, make_linear(t, scheme)


# every scheme on K = 640 with odd N (the last group of 8 rows padded), the default model's shapes, tiny ones
SHAPES4 = [(name, 45, 640) for name in INT4] + [("g32-asym", 960, 576), ("g32", 576, 1536), ("g64-asym", 8, 256),
                                               ("channel", 3, 1536)]


@pytest.mark.parametrize("name,n,k", SHAPES4)
def test_int4_r8_matches_reference_and_checkpoint_kernel(name, n, k):
    ext = cpu_kernels()
    t, lin = _layer(INT4[name], n, k)
    assert lin.bound_gemv.code == dispatch.GEMV_INT4_R8
    w, s, z, group = lin.gemv_args
    for m in (1, 2, 3, 7, 32):  # the 4/2/1-row tails and the GEMV limit
        x = torch.randn(m, k)
        y = ext.int4_matmul_r8(x, w, s, z, group, 0)
        assert y.shape == (m, n)
        # int8 activation blocks: ~0.5 % from the reference; the same integer dots as the checkpoint-layout kernel,
        # summed in another float order
        assert _rel(y, reference_linear(x, t, INT4[name], None)) < 0.02
        old = ext.int4_matmul(x, lin.qweight, lin.scales, lin.zeros, group)
        assert _rel(y, old) < 1e-5
        if _vnni():
            assert torch.equal(ext.int4_matmul_r8(x, w, s, z, group, 1), y)


@pytest.mark.parametrize("name", list(INT8))
@pytest.mark.parametrize("n,k", [(45, 576), (100, 256)])  # K = 576: the default model's LM head
def test_int8_r8_matches_reference_and_checkpoint_kernel(name, n, k):
    ext = cpu_kernels()
    t, lin = _layer(INT8[name], n, k)
    assert lin.bound_gemv.code == dispatch.GEMV_INT8_R8
    w, s, z, group = lin.gemv_args
    for m in (1, 5, 16):
        x = torch.randn(m, k)
        x[0, :32] = 0  # an all-zero activation block (scale 0)
        y = ext.int8_matmul_r8(x, w, s, z, group, 0)
        assert _rel(y, reference_linear(x, t, INT8[name], None)) < 0.02
        assert _rel(y, ext.int8_matmul(x, lin.qweight, lin.scales, lin.zeros, group)) < 1e-5
        if _vnni():
            assert torch.equal(ext.int8_matmul_r8(x, w, s, z, group, 1), y)


def test_int8_r8_extreme_weights():
    """-128 and 127 weights against +-127 activations: |w| * sign-carried x must not overflow anywhere."""
    ext = cpu_kernels()
    q = torch.full((16, 256), -128, dtype=torch.int8)
    q[8:] = 127
    scales = torch.ones(16, 1)
    w, s, z = ext.int8_repack_r8(q, scales, torch.empty(0, dtype=torch.int8), 256)
    x = torch.ones(1, 256)
    for isa in (0, 1) if _vnni() else (0,):
        y = ext.int8_matmul_r8(x, w, s, z, 256, isa)
        torch.testing.assert_close(y, x @ q.float().t(), rtol=1e-6, atol=0)


def test_int4_r8_extreme_nibbles():
    """All-15 nibbles against +-127 activations: a block's int16 partial sums stay within range."""
    ext = cpu_kernels()
    packed = torch.full((8, 256 // 8), -1, dtype=torch.int32)  # every nibble 15
    scales = torch.ones(8, 256 // 32)
    w, s, z = ext.int4_repack_r8(packed, scales, torch.empty(0, dtype=torch.int8), 32)
    x = torch.ones(2, 256)
    x[1] = -1
    for isa in (0, 1) if _vnni() else (0,):
        y = ext.int4_matmul_r8(x, w, s, z, 32, isa)
        torch.testing.assert_close(y, torch.tensor([[7.0 * 256] * 8, [-7.0 * 256] * 8]), rtol=1e-6, atol=0)


def test_r8_kernels_refuse_mismatched_inputs():
    ext = cpu_kernels()
    _, lin = _layer(INT4["g32"], 16, 256)
    w, s, z, group = lin.gemv_args
    with pytest.raises(RuntimeError, match="K"):
        ext.int4_matmul_r8(torch.randn(1, 512), w, s, z, group, -1)
    with pytest.raises(RuntimeError, match="repack"):
        ext.int4_matmul_r8(torch.randn(1, 256), w, s[:1], z, group, -1)
    if not _vnni():
        with pytest.raises(RuntimeError, match="ISA"):
            ext.int4_matmul_r8(torch.randn(1, 256), w, s, z, group, 1)


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@pytest.mark.parametrize("cap", [None, "avx2", "AVX512"])
def test_isa_is_chosen_at_run_time(cap):
    """VNNI only where the CPU and OS report it (Linux drops the avx512 flags when the OS does not save the zmm
    state) and ATEN_CPU_CAPABILITY does not hold torch to AVX2; the extension is the same build either way."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if cap:
        env["ATEN_CPU_CAPABILITY"] = cap
    probe = "from qtoolkit.kernels.cpu_build import cpu_kernels; print(cpu_kernels().r8_isa())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo")
    vnni = {"avx512_vnni", "avx512vl", "avx512bw"} <= flags
    assert out.stdout.split() == ["1" if vnni and cap != "avx2" else "0"]


def test_a_b_switch_binds_the_checkpoint_layout_kernel(monkeypatch):
    t, lin = _layer(INT4["g32-asym"], 45, 576)
    x = torch.randn(3, 576)
    monkeypatch.setenv("QTOOLKIT_CPU_R8", "0")
    old = make_linear(t, INT4["g32-asym"])
    assert old.bound_gemv.code == dispatch.GEMV_INT4 and old.gemv_args[0] is old.qweight
    assert _rel(lin(x), old(x)) < 1e-5


def test_bf16_exact_scales_are_stored_as_bf16_and_give_the_same_bits():
    """A checkpoint's bf16 scales, widened at load, are repacked as bf16 (half the scale bytes a decode step
    streams); the kernel widens them exactly, so the output equals the fp32-scale kernel's bit for bit."""
    ext = cpu_kernels()
    _, lin = _layer(INT4["g32-asym"], 45, 640)
    assert lin.gemv_args[1].dtype == torch.float32  # quantize_weight's scales are not all bf16 values
    w, s, z = ext.int4_repack_r8(lin.qweight, lin.scales.bfloat16().float(), lin.zeros, 32)
    assert s.dtype == torch.bfloat16
    for isa in (0, 1) if _vnni() else (0,):
        for m in (1, 3, 32):
            x = torch.randn(m, 640)
            assert torch.equal(ext.int4_matmul_r8(x, w, s, z, 32, isa), ext.int4_matmul_r8(x, w, s.float(), z, 32, isa))
