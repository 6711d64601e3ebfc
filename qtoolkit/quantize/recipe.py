"""Quantization recipes: YAML in llm-compressor's vocabulary, validated by a schema.

A recipe names a modifier (`QuantizationModifier` = round-to-nearest, `GPTQModifier`, or the `BitsAndBytes` peer),
a compressed-tensors scheme preset (W4A16, FP8_DYNAMIC, ...) with optional overrides of its `weights` /
`input_activations` arguments, `targets` and `ignore`. Every error names the recipe file, the line and the fix.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import RecipeError
from ..provenance import text_sha256
from ..yaml_safe import read_yaml_text, safe_compose
from .llmc_reader import is_llmc_recipe
from .llmc_reader import to_internal as llmc_to_internal

# recipes/ installs as the package `qtoolkit.recipes` (also in editable installs): find it through importlib.
RECIPE_DIR = Path(str(importlib.resources.files("qtoolkit.recipes")))

# Bit widths a scheme may use: integer grids (2/3 for canary "known-bad" recipes) and FP8 E4M3.
INT_BITS = (2, 3, 4, 8)
FLOAT_BITS = (8,)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ArgsOverride(_Strict):
    """A subset of compressed-tensors QuantizationArgs; unset fields keep the preset's value."""

    num_bits: int | None = None
    type: Literal["int", "float"] | None = None
    strategy: Literal["tensor", "channel", "group", "token"] | None = None
    group_size: int | None = Field(default=None, gt=0)
    symmetric: bool | None = None
    dynamic: bool | None = None
    scale_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    observer: str | None = None
    actorder: Literal["group", "weight", "static"] | None = None


class BnbOptions(_Strict):
    quant_type: Literal["nf4", "fp4"] = "nf4"
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    double_quant: bool = True


def _preset(v: str | None) -> str | None:
    if v is None:
        return v

    if v.upper() not in PRESET_SCHEMES:
        raise ValueError(f"unknown scheme {v!r}; use one of {', '.join(sorted(PRESET_SCHEMES))}")
    return v.upper()


class HeadSection(_Strict):
    """The output projection (`lm_head`) on a grid of its own, as GGUF files keep a Q4 model's output tensor in
    Q6_K/Q8_0: in a small model it is the largest matrix (a tied 49152x576 head is 35% of SmolLM2-135M) and the
    one every token's logits come from. A tied embedding is untied: the lookup table stays in full precision."""

    scheme: str | None = None  # a preset, or None when `weights` spells the arguments out (llm-compressor files)
    weights: ArgsOverride | None = None

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str | None) -> str | None:
        return _preset(v)


class KVCacheScheme(_Strict):
    """llm-compressor's `kv_cache_scheme`: 8-bit K and V with static scales calibrated on the recipe's calibration
    data, written as `self_attn.k_scale` / `v_scale` with the scheme in the checkpoint's quantization_config, where
    vLLM (`--kv-cache-dtype fp8`) and qtoolkit's engine (`--kv-cache-dtype fp8|int8`) read them."""

    num_bits: Literal[8] = 8
    type: Literal["float", "int"] = "float"
    strategy: Literal["tensor", "attn_head"] = "tensor"
    dynamic: Literal[False] = False  # scales are calibrated: a dynamic cache needs no recipe (the engine's default)
    symmetric: Literal[True] = True


class QuantizationSection(_Strict):
    modifier: Literal["QuantizationModifier", "GPTQModifier", "BitsAndBytes"]
    scheme: str | None = None
    weights: ArgsOverride | None = None
    input_activations: ArgsOverride | None = None
    targets: list[str] = Field(default_factory=lambda: ["Linear"])
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    # GPTQ knobs (llm-compressor names)
    dampening_frac: float | None = Field(default=None, gt=0, lt=1)
    block_size: int | None = Field(default=None, gt=0)
    bnb: BnbOptions | None = None
    head: HeadSection | None = None  # quantize lm_head too, with its own scheme (it overrides `ignore` for it)
    kv_cache_scheme: KVCacheScheme | None = None  # calibrated 8-bit KV cache scales (needs `calibration`)

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str | None) -> str | None:
        return _preset(v)

    def body_ignore(self) -> list[str]:
        """`ignore` for the main group: with a `head` section, lm_head is quantized by its own group."""
        return [x for x in self.ignore if not (self.head and x == "lm_head")]


class CalibrationSection(_Strict):
    dataset: Literal["code", "summarization", "mixed"] = "mixed"
    num_samples: int = Field(default=64, gt=0, le=4096)
    max_seq_length: int = Field(default=512, ge=16, le=8192)
    seed: int = 0


class Recipe(_Strict):
    version: Literal[1] = 1
    name: str
    description: str = ""
    # Precision the model is loaded in for quantization. compressed-tensors stores int scales in this dtype,
    # so bfloat16 (how models are released) keeps INT4 g32 at ~0.28x of bf16 bytes; float32 scales cost 0.31x.
    precision: Literal["bfloat16", "float32"] = "bfloat16"
    quantization: QuantizationSection
    calibration: CalibrationSection | None = None
    # Sign-off gates travel with the recipe; their schema lives with the sign-off policy.
    gates: dict[str, Any] | None = None

    # filled in by load_recipe, not part of the YAML
    source: str = Field(default="<memory>", exclude=True)
    sha256: str = Field(default="", exclude=True)
    lines: dict[tuple, int] = Field(default_factory=dict, exclude=True)

    def line_of(self, *loc: str | int) -> str:
        """`file:line` of a key path, for error messages (falls back to the closest parent)."""
        while loc and loc not in self.lines:
            loc = loc[:-1]
        line = self.lines.get(loc)
        return f"{self.source}:{line}" if line else self.source

    @property
    def method(self) -> str:
        return {"QuantizationModifier": "rtn", "GPTQModifier": "gptq", "BitsAndBytes": "bnb"}[
            self.quantization.modifier]

    def weight_args(self) -> dict[str, Any]:
        return self.resolved_scheme().get("weights") or {}

    def resolved_scheme(self) -> dict[str, Any]:
        """Preset merged with overrides, as plain QuantizationArgs dicts ({'weights':..., 'input_activations':...})."""
        return _resolve(self.quantization)

    def resolved_head(self) -> dict[str, Any] | None:
        """The `head` section's scheme, resolved like the main one; None when lm_head is not quantized."""
        return _resolve(self.quantization.head) if self.quantization.head else None


def _resolve(q: QuantizationSection | HeadSection) -> dict[str, Any]:
    out: dict[str, Any] = {"weights": None, "input_activations": None}
    if q.scheme:
        for key, args in PRESET_SCHEMES[q.scheme].items():
            if key in out and args is not None:
                out[key] = args.model_dump(include={"num_bits", "type", "strategy", "group_size",
                                                    "symmetric", "dynamic", "observer", "actorder"})
    for key in ("weights", "input_activations"):
        override = getattr(q, key, None)
        if override is None and key in q.model_fields_set:
            out[key] = None  # an explicit `null` removes the preset's arguments (e.g. weight-only FP8)
        elif override is not None:
            base = dict(out[key] or {})
            base.update(override.model_dump(exclude_none=True))
            if base.get("strategy") != "group":
                base["group_size"] = None  # presets carry a group size that other strategies must drop
            out[key] = base
    return out


def _line_map(node: yaml.Node, path: tuple = ()) -> dict[tuple, int]:
    """Map each key path of a composed YAML document to its 1-based line."""
    lines = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            sub = (*path, k.value)
            lines[sub] = k.start_mark.line + 1
            lines.update({p: ln for p, ln in _line_map(v, sub).items() if p != sub})
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            lines.update(_line_map(v, (*path, i)))
    return lines


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def find_recipe(spec: str | os.PathLike) -> Path:
    """A path, or a name in recipes/ (`int4-rtn` -> recipes/int4-rtn.yaml)."""
    p = Path(spec)
    if p.suffix in (".yaml", ".yml") or os.sep in str(spec):
        if not p.is_file():
            raise RecipeError(f"recipe file {p} not found: pass a path to a YAML recipe or one of: "
                              f"{', '.join(list_recipes())}")
        return p
    named = RECIPE_DIR / f"{spec}.yaml"
    if not named.is_file():
        raise RecipeError(f"unknown recipe {str(spec)!r}: use one of {', '.join(list_recipes())} or a YAML path")
    return named


def parse_recipe(text: str, source: str = "<memory>") -> Recipe:
    data, node = safe_compose(text, source, RecipeError)  # size-capped, aliases refused: nothing can blow up
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a YAML mapping with `name` and `quantization` keys")
    lines = _line_map(node) if node is not None else {}
    if is_llmc_recipe(data):  # llm-compressor's own `*_stage: *_modifiers:` layout, validated by llm-compressor
        data, lines = llmc_to_internal(data, lines, source)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err["loc"])
        where = f"{source}:{_closest_line(lines, loc)}"
        field = ".".join(str(p) for p in loc) or "recipe"
        if err["type"] == "extra_forbidden":
            raise RecipeError(f"{where}: unknown key {field!r}: remove it or check its spelling") from None
        if err["type"] == "missing":
            raise RecipeError(f"{where}: missing required key {field!r}: add it") from None
        raise RecipeError(f"{where}: {field}: {err['msg']}") from None
    recipe.source, recipe.sha256, recipe.lines = source, text_sha256(text), lines
    _check_consistency(recipe)
    return recipe


def _closest_line(lines: dict[tuple, int], loc: tuple) -> int:
    while loc and loc not in lines:
        loc = loc[:-1]
    return lines.get(loc, 1)


def load_recipe(spec: str | os.PathLike) -> Recipe:
    path = find_recipe(spec)
    return parse_recipe(read_yaml_text(path, RecipeError), source=str(path))


def _check_consistency(r: Recipe) -> None:
    """Checks that need several fields at once (the schema checks each field alone)."""
    q = r.quantization
    if q.modifier == "BitsAndBytes":
        if q.scheme or q.weights or q.input_activations or q.head or q.kv_cache_scheme:
            raise RecipeError(f"{r.line_of('quantization', 'modifier')}: BitsAndBytes takes `bnb:` options, "
                              "not `scheme`/`weights`/`head`/`kv_cache_scheme`: remove them")
        return
    if not q.scheme and not q.weights:
        raise RecipeError(f"{r.line_of('quantization')}: give a `scheme` (e.g. W4A16, FP8_DYNAMIC) or `weights`")
    head = r.resolved_head()
    if head:
        hw = head.get("weights") or {}
        if hw.get("type", "int") != "int" or hw.get("num_bits") not in (4, 8):
            raise RecipeError(f"{r.line_of('quantization', 'head')}: the head takes INT8 or INT4 weights "
                              "(e.g. scheme W8A16): use one of those")
    w = r.weight_args()
    bits, kind = w.get("num_bits"), w.get("type", "int")
    allowed = INT_BITS if kind == "int" else FLOAT_BITS
    if bits not in allowed:
        raise RecipeError(f"{r.line_of('quantization', 'weights', 'num_bits')}: {kind} weights with {bits} bits "
                          f"are not supported: use num_bits in {list(allowed)}")
    if w.get("strategy") == "group" and not w.get("group_size"):
        raise RecipeError(f"{r.line_of('quantization', 'weights')}: strategy `group` needs `group_size` (e.g. 32)")
    if w.get("strategy") != "group" and q.weights and q.weights.group_size:
        raise RecipeError(f"{r.line_of('quantization', 'weights', 'group_size')}: group_size needs "
                          "`strategy: group`")
    if q.kv_cache_scheme is not None and r.calibration is None:
        raise RecipeError(f"{r.line_of('quantization', 'kv_cache_scheme')}: kv_cache_scheme's scales are calibrated: "
                          "add a `calibration:` section (dataset, num_samples)")
    if q.modifier == "GPTQModifier" and r.calibration is None:
        raise RecipeError(f"{r.line_of('quantization', 'modifier')}: GPTQModifier needs a `calibration:` section "
                          "(dataset, num_samples)")
    if q.modifier != "GPTQModifier" and (q.dampening_frac or q.block_size):
        raise RecipeError(f"{r.line_of('quantization')}: dampening_frac/block_size are GPTQModifier options: "
                          "remove them or use modifier GPTQModifier")


def check_against_model(r: Recipe, linear_shapes: dict[str, tuple[int, int]]) -> None:
    """Model-dependent checks: each targeted Linear's input size must be divisible by the group size.

    `linear_shapes` maps module name -> (out_features, in_features) for the Linears the recipe targets.
    """
    w = r.weight_args()
    if not linear_shapes:
        raise RecipeError(f"{r.line_of('quantization', 'targets')}: the recipe's targets/ignore match no Linear "
                          "layer of this model: check `targets` and `ignore`")
    if w.get("strategy") != "group":
        return
    g = w["group_size"]
    bad = {name: k for name, (_, k) in linear_shapes.items() if k % g}
    if bad:
        name, k = next(iter(bad.items()))
        ks = sorted({k for _, k in linear_shapes.values()})
        fits = [c for c in (16, 32, 64, 128, 256) if all(x % c == 0 for x in ks)]
        raise RecipeError(
            f"{r.line_of('quantization', 'weights', 'group_size')}: group_size {g} does not divide in_features "
            f"{k} of {name} ({len(bad)} layers): use group_size {' or '.join(map(str, fits)) or 'that divides it'}"
        )
