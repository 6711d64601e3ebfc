"""Quantized Linear modules on CPU: every format and path against the shared reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from qtoolkit.kernels import cpu, dispatch
from qtoolkit.kernels import scheme as S
from qtoolkit.kernels.cpu_build import cpu_kernels
from qtoolkit.kernels.reference import dequantize, quantize_weight, reference_linear

from qtoolkit.model.quant_linear import ConcatLinear, DenseLinear, QuantLinear, fuse_linears, make_linear

SCHEMES = {
    "w4a16-g32": S.w4a16(32), "w4a16-g64-asym": S.w4a16(64, symmetric=False), "w4a16-g128": S.w4a16(128),
    "w4a16-g32-asym": S.w4a16(32, symmetric=False),
    "w4-channel": S.config_group("pack-quantized", num_bits=4, strategy="channel"),
    "w8a16-channel": S.config_group("pack-quantized", num_bits=8, strategy="channel"),
    "w8a16-g64": S.w8a16(64), "int3-channel": S.config_group("pack-quantized", num_bits=3, strategy="channel"),
    "w8a8": S.w8a8_int(), "fp8-dynamic": S.fp8_dynamic(), "fp8-weight": S.fp8_weight_only(),
}
N, K = 45, 256  # odd N; K a multiple of every group size


def _layer(name: str, bias: bool, seed: int = 0, n: int = N):
    torch.manual_seed(seed)
    w = torch.randn(n, K) * 0.05
    b = torch.randn(n) if bias else None
    t = quantize_weight(w, SCHEMES[name])
    return w, t, b, make_linear(t, SCHEMES[name], b)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(params=["ext", "torch"])
def cpu_path(request, monkeypatch):
    """Run each test through the AVX2 extension and through the torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr(cpu, "cpu_kernels", lambda: None)
    elif cpu_kernels() is None:
        pytest.skip("AVX2 extension unavailable here")
    return request.param


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("m", [1, 3, 13, 24, 33])  # the kernels' 8/4/2/1-row tails; the blocked path
def test_matches_reference(name, m, cpu_path):
    w, t, b, lin = _layer(name, bias=m % 2 == 1)
    x = torch.randn(m, K)
    y = lin(x)
    ref = reference_linear(x, t, SCHEMES[name], b)
    assert y.shape == (m, N) and y.dtype == torch.float32
    # The GEMV kernels quantize activations to int8 per 32-block (~0.5% error); the other paths are fp32-exact.
    gemv_max = dispatch.INT4_GEMV_MAX_M if lin.kind == "int4" else dispatch.GEMV_MAX_M
    tol = 0.02 if cpu_path == "ext" and m <= gemv_max and lin.kind != "fp8" else 1e-5
    assert _rel(y, ref) < tol
    # the layer computes the quantized weight, not the original one: the weight's quantization error is visible.
    # (Not for 8-bit weights through the GEMV kernel: their error is as small as the activation rounding's.)
    dense = x @ w.t() + (b if b is not None else 0)
    if lin.kind != "int8" or tol < 0.01:
        assert _rel(ref, dense) > 10 * _rel(y, ref) or _rel(y, ref) < 1e-5


@pytest.mark.parametrize("name", ["w4a16-g32", "w4a16-g32-asym"])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_group32_kernel_on_model_shapes(name, m):
    """K = 576 (the default model's hidden size): 18 scale blocks, so the offset term's vector loop has a tail;
    7 rows: the two-row kernel plus a single-row tail."""
    if cpu_kernels() is None:
        pytest.skip("AVX2 extension unavailable here")
    torch.manual_seed(m)
    w = torch.randn(7, 576) * 0.05
    t = quantize_weight(w, SCHEMES[name])
    x = torch.randn(m, 576)
    assert _rel(make_linear(t, SCHEMES[name])(x), reference_linear(x, t, SCHEMES[name], None)) < 0.02


def test_blocked_prefill_path(monkeypatch):
    """Prefill dequantizes a block of rows at a time; force several blocks on a small layer."""
    monkeypatch.setattr(cpu, "BLOCK_BYTES", 16 * 4 * K)
    for name in ("w4a16-g64-asym", "w8a16-g64", "fp8-dynamic"):
        _, t, b, lin = _layer(name, bias=True)
        x = torch.randn(40, K)
        assert _rel(lin(x), reference_linear(x, t, SCHEMES[name], b)) < 1e-5


def test_bf16_in_bf16_out_and_3d_input():
    _, t, b, lin = _layer("w4a16-g32", bias=True)
    x = torch.randn(2, 5, K)
    y = lin(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, N)
    assert _rel(y, reference_linear(x.reshape(10, K), t, SCHEMES["w4a16-g32"], b).reshape(2, 5, N)) < 0.03


@pytest.mark.parametrize("name", ["w4a16-g32", "w4a16-g64-asym", "w8a16-g64", "fp8-weight", "int3-channel"])
def test_dequantized_weight_and_bytes(name):
    _, t, _, lin = _layer(name, bias=False)
    assert torch.equal(lin.dequantized_weight(), dequantize(t, SCHEMES[name]))
    expect = {"w4a16-g32": N * K // 2 + N * K // 32 * 4, "w4a16-g64-asym": N * K // 2 + N * K // 64 * 5,
              "w8a16-g64": N * K + N * K // 64 * 4, "fp8-weight": N * K + N * 4, "int3-channel": N * K + N * 4}
    assert lin.weight_bytes() == expect[name]
    assert lin.qweight.dtype != torch.float32  # weights stay packed in memory


@pytest.mark.parametrize("names", [["w4a16-g32"] * 3, ["w4a16-g64-asym"] * 2, ["fp8-dynamic"] * 2,
                                   ["w8a8"] * 2, ["w4a16-g32", "fp8-weight"], ["dense", "dense"]])
def test_fuse_linears(names):
    mods = []
    for i, name in enumerate(names):
        if name == "dense":
            torch.manual_seed(i)
            mods.append(DenseLinear(torch.randn(N + i, K), torch.randn(N + i) if i else None))
        else:
            mods.append(_layer(name, bias=i == 1, seed=i, n=N + 2 * i)[3])
    fused = fuse_linears(mods)
    expected_type = ConcatLinear if len(set(names)) > 1 else type(mods[0])
    assert type(fused) is expected_type
    for m in (1, 4, 20):
        x = torch.randn(m, K)
        ref = torch.cat([mod(x) for mod in mods], dim=-1)
        torch.testing.assert_close(fused(x), ref, rtol=1e-5, atol=1e-5)
    assert fused.weight_bytes() == sum(mod.weight_bytes() for mod in mods)
    assert fused.out_features == sum(mod.out_features for mod in mods)


def test_dense_and_errors():
    w = torch.randn(7, 16)
    lin = make_linear({"weight": w}, None, torch.ones(7))
    x = torch.randn(2, 16)
    torch.testing.assert_close(lin(x), x @ w.t() + 1)
    assert isinstance(lin, DenseLinear) and lin.weight_bytes() == w.nbytes
    static = S.config_group("float-quantized", num_bits=8, type="float", strategy="channel",
                            activations={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})
    with pytest.raises(S.QuantSchemeError, match="static"):
        make_linear(quantize_weight(w, static), static)
    t = quantize_weight(torch.randn(8, 64), S.w4a16(32))
    t["weight_scale"] = t["weight_scale"][:, :1]
    with pytest.raises(S.QuantSchemeError, match="weight_scale"):
        make_linear(t, S.w4a16(32))


def test_int4_layout_is_the_checkpoint_layout():
    _, t, _, lin = _layer("w4a16-g32", bias=False)
    assert isinstance(lin, QuantLinear) and lin.kind == "int4"
    assert torch.equal(lin.qweight, t["weight_packed"])


def test_blocked_path_buffer_works_in_and_out_of_inference_mode(monkeypatch):
    """The prefill path reuses one dequant buffer: the engine runs under inference mode, evals and tests do not."""
    monkeypatch.setattr(cpu._scratch, "buf", None, raising=False)
    w = torch.randn(40, 64)
    x = torch.randn(33, 64)  # past every GEMV limit: blocked dequant + sgemm
    for mode in (True, False, True):
        with torch.inference_mode(mode):
            y = dispatch.cpu_dense(x, w.bfloat16())
        torch.testing.assert_close(y, x @ w.bfloat16().float().t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["w4a16-g32", "w8a16-g64", "fp8-dynamic"])
@pytest.mark.parametrize("m", [1, 40])  # the bound AVX2 GEMV (int4) and the general path
def test_every_quantized_forward_goes_through_the_dispatch_point(name, m, monkeypatch):
    _, _, _, lin = _layer(name, bias=True)
    calls = []
    real = dispatch.quant_linear

    def counted(x, layer):
        calls.append(layer)
        return real(x, layer)

    monkeypatch.setattr(dispatch, "quant_linear", counted)
    lin(torch.randn(m, K))
    fuse_linears([lin, _layer(name, bias=False, seed=1)[3]])(torch.randn(m, K))
    assert len(calls) == 2 and calls[0] is lin


def test_path_thresholds_live_only_in_the_dispatch_module():
    root = Path(__file__).resolve().parent.parent
    defined = [f"{p.relative_to(root)}: {line.strip()}" for p in [*(root / "kernels").glob("*.py"),
                                                                   *(root / "qtoolkit" / "model").glob("*.py")]
               for line in p.read_text().splitlines() if re.match(r"[A-Z0-9_]*_MAX_M\s*=", line)]
    assert defined and all(d.startswith("kernels/dispatch.py") for d in defined), defined
