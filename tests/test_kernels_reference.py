"""The shared torch reference against compressed-tensors' own packing, qparams and compressors."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from qtoolkit.kernels import scheme as S
from qtoolkit.kernels.reference import (
    dequantize,
    pack_int32,
    quantize_activations,
    quantize_weight,
    reference_linear,
    unpack_int32,
)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_matches_compressed_tensors(bits, dim):
    torch.manual_seed(bits)
    q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (7, 45), dtype=torch.int8)
    ours = pack_int32(q, bits, dim)
    assert torch.equal(ours, pack_to_int32(q, bits, packed_dim=dim))
    assert torch.equal(unpack_int32(ours, bits, q.shape[dim], dim), q)
    assert torch.equal(unpack_from_int32(ours, bits, q.shape, packed_dim=dim), q)


def _ct_compress(w: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """What compressed-tensors writes: its own min/max qparams, then its compressor for the format."""
    args = QuantizationArgs(**{k: v for k, v in group["weights"].items() if v is not None})
    if args.strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zp = calculate_qparams(lo, hi, args)
    acts = group.get("input_activations")
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=QuantizationArgs(**acts) if acts else None)
    state = {"weight": w, "weight_scale": scale}
    if not args.symmetric:
        state["weight_zero_point"] = zp
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    return compressor.compress(state, scheme), compressor, scheme


SCHEMES = {
    "w4a16-g32": S.w4a16(32), "w4a16-g64-asym": S.w4a16(64, symmetric=False), "w4a16-g128": S.w4a16(128),
    "w8a16-g64": S.w8a16(64), "w8a16-channel": S.config_group("pack-quantized", num_bits=8, strategy="channel"),
    "int3-channel": S.config_group("pack-quantized", num_bits=3, strategy="channel"),
    "w4-channel-asym": S.config_group("pack-quantized", num_bits=4, strategy="channel", symmetric=False),
    "w8a8": S.w8a8_int(), "fp8-dynamic": S.fp8_dynamic(), "fp8-weight": S.fp8_weight_only(),
    "fp8-tensor": S.config_group("naive-quantized", num_bits=8, type="float", strategy="tensor"),
}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantize_weight_matches_compressed_tensors(name):
    group = SCHEMES[name]
    torch.manual_seed(0)
    w = torch.randn(33, 256) * 0.05
    w[3, 7] = 0.9  # an outlier so groups differ in range
    ours = quantize_weight(w, group)
    theirs, compressor, scheme = _ct_compress(w, group)
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        assert ours[key].dtype == t.dtype, key
        assert torch.equal(ours[key].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else ours[key],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), key
    back = compressor.decompress(dict(ours), scheme)["weight"]
    torch.testing.assert_close(dequantize(ours, group), back.float(), rtol=0, atol=0)
    # and the dequantized weight really is close to w (catches a wrong but self-consistent reference)
    err = (dequantize(ours, group) - w).abs().max() / w.abs().max()
    assert err < (0.3 if "int3" in name else 0.1)


def test_int4_nibble_order():
    """Nibble order the kernels rely on: element 2b in the low nibble of byte b, stored as q + 8."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 1.0, -1.0
    t = quantize_weight(w, S.w4a16(32))
    first = t["weight_packed"].view(torch.uint8)[0, 0].item()
    assert first & 0x0F == 7 + 8 and first >> 4 == -7 + 8


def test_activation_quantization_is_per_token():
    x = torch.tensor([[1.0, -2.0, 0.5], [100.0, 1.0, -50.0]])
    q, s = quantize_activations(x, "int")
    assert q.dtype == torch.int8 and s.shape == (2, 1)
    torch.testing.assert_close(q.float() * s, x, atol=float(s.max()), rtol=0)
    qf, sf = quantize_activations(x, "float")
    assert qf.dtype == torch.float8_e4m3fn and torch.allclose(sf.squeeze(), x.abs().amax(1) / 448)
    y = reference_linear(x, quantize_weight(torch.eye(3), S.fp8_dynamic()), S.fp8_dynamic())
    torch.testing.assert_close(y, x, rtol=0.07, atol=0)  # fp8 rounding of the activations only


def test_bad_schemes_are_user_errors():
    with pytest.raises(S.QuantSchemeError):
        S.parse_scheme({"format": "marlin-24", "weights": {"num_bits": 4}})
    with pytest.raises(S.QuantSchemeError):
        quantize_weight(torch.randn(4, 48), S.w4a16(32))
