"""A compressed-tensors config group, read once into the few facts the kernels need.

The config group is the dict under `quantization_config.config_groups[...]` in a checkpoint's config.json
(keys `format`, `weights`, `input_activations`). Formats we accept and what they mean for the tensors:
- `pack-quantized`: int 1..8 bit weights packed densely into int32 (`weight_packed`, `weight_scale`,
  `weight_shape`, packed `weight_zero_point` when asymmetric).
- `int-quantized` / `naive-quantized` with int weights: int8 `weight` + `weight_scale` (+ int8 zero point).
- `float-quantized` / `naive-quantized` with float weights: FP8 E4M3 `weight` + `weight_scale`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compressed_tensors.quantization import QuantizationScheme
from pydantic import ValidationError

from qtoolkit.errors import QToolError


class QuantSchemeError(QToolError):
    """A checkpoint's quantization scheme is one the kernels cannot run."""


FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Scheme:
    format: str
    weight_type: str  # "int" or "float"
    bits: int
    strategy: str  # "tensor", "channel" or "group"
    group_size: int | None
    symmetric: bool
    # activation quantization applied at run time: None (weight-only), or ("int"|"float", strategy, dynamic)
    act_type: str | None = None
    act_strategy: str | None = None
    act_dynamic: bool = True

    @property
    def packed(self) -> bool:
        return self.format == "pack-quantized"

    def qrange(self) -> tuple[float, float]:
        if self.weight_type == "float":
            return -448.0, 448.0
        half = 2 ** (self.bits - 1)
        return float(-half), float(half - 1)


def _get(d: Any, key: str, default=None):
    if d is None:
        return default
    if isinstance(d, dict):
        return d.get(key, default)
    return getattr(d, key, default)


def parse_scheme(scheme: dict | Scheme, default_format: str | None = None) -> Scheme:
    """Validate a config group dict (or pass a parsed Scheme through) with compressed-tensors' own models.

    `default_format` is the checkpoint's global `quantization_config.format`: as in vLLM, a config group without
    its own `format` (what older llm-compressor versions write) falls back to it."""
    if isinstance(scheme, Scheme):
        return scheme
    fmt = _get(scheme, "format") or default_format
    weights = _get(scheme, "weights")
    if fmt not in FORMATS or weights is None:
        raise QuantSchemeError(f"quantization format {fmt!r} is not supported: use one of {', '.join(FORMATS)} "
                               "(re-quantize with a W4A16, W8A16, W8A8 or FP8 recipe)")
    try:  # compressed-tensors fills its defaults (strategy from group_size, symmetric...) as vLLM reads them
        cts = QuantizationScheme.model_validate({"targets": list(_get(scheme, "targets") or ["Linear"]),
                                                 "weights": weights,
                                                 "input_activations": _get(scheme, "input_activations")})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise QuantSchemeError(f"config group is not a valid compressed-tensors scheme ({where}: "
                               f"{err['msg'].splitlines()[0]}): fix the checkpoint's config.json") from None
    w = cts.weights
    wtype, bits, strategy, group = _value(w.type), int(w.num_bits), _value(w.strategy), w.group_size
    if strategy not in ("tensor", "channel", "group"):
        raise QuantSchemeError(f"weight strategy {strategy!r} is not supported: use tensor, channel or group")
    if strategy == "group" and not group:
        raise QuantSchemeError("group strategy without group_size: set weights.group_size in the recipe")
    if wtype == "float" and bits != 8:
        raise QuantSchemeError(f"float weights with {bits} bits are not supported: use FP8 (num_bits 8)")
    if wtype == "int" and not 1 <= bits <= 8:
        raise QuantSchemeError(f"int weights with {bits} bits are not supported: use 4 or 8 bits")
    if fmt == "pack-quantized" and wtype != "int":
        raise QuantSchemeError("pack-quantized needs int weights: fix the checkpoint's config.json")
    acts = cts.input_activations
    act_type = act_strategy = None
    act_dynamic = True
    if acts is not None:
        act_type, act_strategy, act_dynamic = _value(acts.type), _value(acts.strategy), bool(acts.dynamic)
        if act_strategy not in ("token", "tensor"):
            raise QuantSchemeError(f"activation strategy {act_strategy!r} is not supported: use token or tensor")
    return Scheme(format=fmt, weight_type=wtype, bits=bits, strategy=strategy,
                  group_size=int(group) if strategy == "group" else None,
                  symmetric=bool(w.symmetric), act_type=act_type,
                  act_strategy=act_strategy, act_dynamic=act_dynamic)


def _value(x: Any) -> str:
    """compressed-tensors' enums (QuantizationType, QuantizationStrategy) as their plain string values."""
    return str(getattr(x, "value", x))


def config_group(format: str, *, num_bits: int, type: str = "int", strategy: str = "group",
                 group_size: int | None = None, symmetric: bool = True,
                 activations: dict | None = None) -> dict:
    """A config group dict in compressed-tensors' vocabulary (tests and benchmarks build schemes with it)."""
    weights = {"num_bits": num_bits, "type": type, "strategy": strategy, "group_size": group_size,
               "symmetric": symmetric, "dynamic": False}
    return {"format": format, "weights": weights, "input_activations": activations, "targets": ["Linear"]}


# The schemes llm-compressor's presets produce, as config groups (for tests, benches and diagnostics).
def w4a16(group_size: int = 32, symmetric: bool = True) -> dict:
    return config_group("pack-quantized", num_bits=4, group_size=group_size, symmetric=symmetric)


def w8a16(group_size: int = 128) -> dict:
    return config_group("pack-quantized", num_bits=8, group_size=group_size)


def w8a8_int() -> dict:
    return config_group("int-quantized", num_bits=8, strategy="channel",
                        activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
                                     "symmetric": True})


def fp8_dynamic() -> dict:
    return config_group("float-quantized", num_bits=8, type="float", strategy="channel",
                        activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                     "symmetric": True})


def fp8_weight_only() -> dict:
    return config_group("naive-quantized", num_bits=8, type="float", strategy="channel")
