"""Triton kernels under TRITON_INTERPRET=1 (CPU CI) against the shared reference, and their tile shapes.

The interpreter must be on before triton itself is imported (its own tl.* helpers are jit functions), and other
test modules import triton first (compressed-tensors does). So in a normal session this module runs itself in a
subprocess with TRITON_INTERPRET=1, and only there are the kernel tests collected; nothing else is affected.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from qtoolkit.kernels import dispatch  # noqa: E402
from qtoolkit.kernels import scheme as S  # noqa: E402
from qtoolkit.kernels.reference import quantize_activations, quantize_weight, reference_linear  # noqa: E402

from qtoolkit.model.quant_linear import make_linear  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")


@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter subprocess")
def test_interpreter_suite_in_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1", QTOOLKIT_QUIET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@pytest.fixture(scope="module")
def kernels():
    from qtoolkit.kernels import fp8_matmul, int4_matmul

    assert int4_matmul.INTERPRET
    return int4_matmul, fp8_matmul


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@interpreted
def test_tl_dot_block_dims_at_least_16(kernels):
    """tl.dot needs M, N, K tiles >= 16 on real GPUs; the interpreter would silently accept smaller ones."""
    int4_matmul, _ = kernels
    configs = int4_matmul.DECODE_CONFIGS + int4_matmul.PREFILL_CONFIGS + [int4_matmul.INTERPRET_CONFIG]
    for cfg in configs:
        for dim in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            assert cfg.kwargs[dim] >= 16 and cfg.kwargs[dim] & (cfg.kwargs[dim] - 1) == 0, (cfg, dim)
        assert cfg.kwargs["BLOCK_K"] % 8 == 0  # whole packed int32 words per tile row
    assert any(c.kwargs["BLOCK_M"] == 16 for c in int4_matmul.DECODE_CONFIGS)  # decode doesn't pad M to 64
    assert min(c.kwargs["BLOCK_M"] for c in int4_matmul.PREFILL_CONFIGS) >= 64


CASES = [  # (scheme name, group config, M, N, K, bias)
    ("w4-g32", S.w4a16(32), 1, 37, 128, False), ("w4-g64-asym", S.w4a16(64, symmetric=False), 3, 33, 256, True),
    ("w4-g128", S.w4a16(128), 16, 21, 256, False), ("w4-g32-asym", S.w4a16(32, symmetric=False), 33, 19, 64, True),
    ("w4-channel", S.config_group("pack-quantized", num_bits=4, strategy="channel"), 3, 17, 96, False),
    ("w8-g64", S.w8a16(64), 3, 23, 128, True), ("w8a8", S.w8a8_int(), 16, 23, 64, False),
    ("fp8-weight", S.fp8_weight_only(), 1, 37, 128, True), ("fp8-dynamic", S.fp8_dynamic(), 3, 33, 96, False),
    ("fp8-dynamic-33", S.fp8_dynamic(), 33, 17, 64, True),
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gpu_dispatch_path_matches_reference(kernels, case):
    """dispatch's CUDA branch, run on CPU tensors through the interpreter."""
    _, group, m, n, k, with_bias = case
    torch.manual_seed(m * n)
    t = quantize_weight(torch.randn(n, k) * 0.05, group)
    bias = torch.randn(n) if with_bias else None
    layer = make_linear(t, group, bias)
    x = torch.randn(m, k)
    y = dispatch._cuda(x, layer) + (bias if bias is not None else 0)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _rel(y, reference_linear(x, t, group, bias)) < 1e-5


@interpreted
def test_fp8_kernel_with_fp8_activations_and_16bit_output(kernels):
    _, fp8_matmul = kernels
    torch.manual_seed(0)
    group = S.fp8_dynamic()
    t = quantize_weight(torch.randn(29, 64), group)
    x = torch.randn(5, 64)
    xq, xs = quantize_activations(x, "float")
    y = fp8_matmul.fp8_linear(xq, t["weight"], t["weight_scale"], x_scale=xs, decode=True)
    assert y.dtype == torch.bfloat16
    assert _rel(y, reference_linear(x, t, group)) < 1e-2  # bf16 output rounding


@interpreted
def test_int_kernel_fp16_activations(kernels):
    """16-bit activations go through the interpreter's fp32 dot (its bf16/fp16 dot is unreliable)."""
    int4_matmul, _ = kernels
    torch.manual_seed(1)
    group = S.w4a16(32)
    t = quantize_weight(torch.randn(40, 128), group)
    x = torch.randn(2, 128).half()
    y = int4_matmul.int_linear(x, t["weight_packed"], t["weight_scale"], None, 32, decode=True)
    assert y.dtype == torch.float16
    assert _rel(y, reference_linear(x.float(), t, group)) < 2e-3


@interpreted
@pytest.mark.parametrize("bk,group,asym", [(128, 32, False), (64, 32, True), (128, 64, True), (32, 128, True)])
def test_int_kernel_tiles_spanning_groups(kernels, bk, group, asym):
    """Tiles holding several groups (scales broadcast per group) and tiles inside one group."""
    int4_matmul, _ = kernels
    torch.manual_seed(bk + group)
    grp = S.w4a16(group, symmetric=not asym)
    t = quantize_weight(torch.randn(19, 384), grp)
    layer = make_linear(t, grp)
    x = torch.randn(5, 384)
    cfg = int4_matmul._cfg(16, 16, bk, 2, 1, 1)
    zeros = layer.zeros if asym else None
    y = int4_matmul.int_linear(x, layer.qweight, layer.scales, zeros, group, config=cfg, decode=True)
    assert _rel(y, reference_linear(x, t, grp)) < 1e-5


@interpreted
def test_m_bucket_groups_decode_sizes(kernels):
    int4_matmul, _ = kernels
    assert [int4_matmul.m_bucket(m) for m in (1, 2, 3, 16, 17, 33)] == [1, 2, 4, 16, 32, 64]
