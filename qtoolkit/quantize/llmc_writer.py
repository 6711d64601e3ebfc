"""A qtoolkit recipe written as an llm-compressor recipe file (what `qtool quantize --print-recipe` prints).

Presets are resolved into explicit config groups, qtoolkit's own fields travel under the `qtoolkit:` key that
llm-compressor's parser skips, so `llmc_reader` reads the file back into the same recipe.
"""

from __future__ import annotations

from typing import Any

import yaml

from ..errors import RecipeError
from .llmc_reader import META_KEY, MODIFIERS
from .recipe import Recipe


def to_llmc(r: Recipe) -> dict[str, Any]:
    """The llm-compressor recipe a qtoolkit recipe stands for: presets resolved into explicit config groups (what
    `_build_modifier` hands to `oneshot`), qtoolkit's own fields under `qtoolkit:`."""
    q = r.quantization
    if q.modifier not in MODIFIERS:
        raise RecipeError(f"{r.source}: recipe {r.name} uses {q.modifier} (transformers' bitsandbytes), which "
                          f"llm-compressor has no modifier for: --print-recipe covers {' and '.join(MODIFIERS)}")
    resolved, head = r.resolved_scheme(), r.resolved_head()
    group: dict[str, Any] = {"targets": list(q.targets), "weights": _clean(resolved["weights"])}
    if resolved["input_activations"]:
        group["input_activations"] = _clean(resolved["input_activations"])
    groups = {"group_0": group}
    if head:
        groups["group_head"] = {"targets": ["lm_head"], "weights": _clean(head["weights"])}
    args: dict[str, Any] = {"config_groups": groups, "ignore": q.body_ignore()}
    args.update({k: getattr(q, k) for k in ("dampening_frac", "block_size") if getattr(q, k) is not None})
    if q.kv_cache_scheme is not None:
        args["kv_cache_scheme"] = q.kv_cache_scheme.model_dump()
    meta: dict[str, Any] = {"name": r.name, "description": r.description, "precision": r.precision}
    if r.calibration is not None:
        meta["calibration"] = r.calibration.model_dump()
    if r.gates is not None:
        meta["gates"] = r.gates
    return {META_KEY: meta, "quant_stage": {"quant_modifiers": {q.modifier: args}}}


def dump_llmc(r: Recipe) -> str:
    header = (f"# llm-compressor recipe for qtoolkit recipe {r.name}: pass it to oneshot(recipe=...) or to\n"
              "# `qtool quantize --recipe`; llm-compressor skips the `qtoolkit:` key.\n")
    return header + yaml.safe_dump(to_llmc(r), sort_keys=False, default_flow_style=None, width=100)


def _clean(d: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if d is None else {k: v for k, v in d.items() if v is not None}
