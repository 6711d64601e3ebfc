"""Compiled Triton kernels on a CUDA GPU (kernels/gpu_check.sh runs these); skipped without one."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from qtoolkit.kernels import scheme as S  # noqa: E402
from qtoolkit.kernels.reference import quantize_weight, reference_linear  # noqa: E402

from qtoolkit.model.quant_linear import fuse_linears, make_linear  # noqa: E402

SCHEMES = {"w4-g32": S.w4a16(32), "w4-g64-asym": S.w4a16(64, symmetric=False), "w4-g128": S.w4a16(128),
           "w8-channel": S.config_group("pack-quantized", num_bits=8, strategy="channel"), "w8a8": S.w8a8_int(),
           "fp8-weight": S.fp8_weight_only(), "fp8-dynamic": S.fp8_dynamic()}


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("m", [1, 3, 16, 33, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_kernels_match_reference(name, m, dtype):
    torch.manual_seed(m)
    n, k = 4099, 1024  # odd N: partial tiles
    t = quantize_weight(torch.randn(n, k) * 0.02, SCHEMES[name])
    bias = torch.randn(n) * 0.1 if m % 2 else None
    layer = make_linear(t, SCHEMES[name], bias).cuda()
    x = torch.randn(m, k)
    y = layer(x.to("cuda", dtype))
    assert y.is_cuda and y.dtype == dtype and y.shape == (m, n)
    ref = reference_linear(x.to(dtype).float(), t, SCHEMES[name], bias)
    rel = float((y.float().cpu() - ref).norm() / ref.norm())
    assert rel < (2e-2 if dtype != torch.float32 else 1e-3), rel


def test_fused_module_on_gpu():
    mods = [make_linear(quantize_weight(torch.randn(n, 512), S.w4a16(32)), S.w4a16(32)) for n in (576, 192)]
    fused = fuse_linears(mods).cuda()
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    ref = torch.cat([m.cuda()(x) for m in mods], dim=-1)
    torch.testing.assert_close(fused(x), ref, rtol=2e-2, atol=2e-2)
