"""llm-compressor recipe files read as they are: validated by llm-compressor, mapped onto qtoolkit's schema.

llm-compressor's own format (what `oneshot(recipe=FILE)` reads) nests modifiers as
`<name>_stage: <group>_modifiers: <ModifierType>: {args}`. A file in that layout is first validated by
llm-compressor's own parser (`Recipe.from_dict`, the pydantic models of its modifiers), then mapped onto
qtoolkit's schema: one QuantizationModifier or GPTQModifier, its `scheme` (a preset name, or `{PRESET: targets}`)
or `config_groups` (one body group plus an optional group that targets exactly `lm_head`), `targets`, `ignore`
and GPTQ's `dampening_frac` / `block_size`. What qtoolkit keeps beside the modifier (name, precision,
calibration, gates) travels under a top-level `qtoolkit:` key, which llm-compressor's parser skips (it reads only
`*_stage` keys and `args`), so a recipe written by `llmc_writer` is both a valid `oneshot` recipe and a lossless
qtoolkit one. The reader hands `recipe.py` a plain dict and needs nothing from it.
"""

from __future__ import annotations

from typing import Any

from llmcompressor.recipe import Recipe as LlmcRecipe
from pydantic import ValidationError

from ..errors import RecipeError

MODIFIERS = ("QuantizationModifier", "GPTQModifier")
META_KEY = "qtoolkit"
META_FIELDS = ("name", "description", "precision", "calibration", "gates")
ARGS_FIELDS = ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic", "scale_dtype", "observer",
               "actorder")
MODIFIER_KEYS = {"config_groups", "scheme", "targets", "ignore", "dampening_frac", "block_size", "kv_cache_scheme",
                 "group", "index", "start", "end", "update"}
KV_FIELDS = ("num_bits", "type", "strategy", "dynamic", "symmetric")  # recipe.KVCacheScheme's fields
GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
# what llm-compressor derives itself and writes into the recipe.yaml it saves beside a checkpoint
DERIVED_KEYS = {"requires_calibration_data", "zp_dtype"}
# llm-compressor 0.14's own defaults, which its recipe.yaml spells out: asking for them asks for nothing
LLMC_DEFAULTS = {"actorder": "static", "batched_quantization": "auto", "offload_hessians": False}


def _unset(v: Any, key: str | None = None) -> bool:
    """A value that asks for nothing (llm-compressor writes every field, unset ones as null / {} / false)."""
    return v is None or v is False or v == {} or v == [] or (key in LLMC_DEFAULTS and LLMC_DEFAULTS[key] == v)


def is_llmc_recipe(data: Any) -> bool:
    """True for llm-compressor's layout: some top-level `*_stage` mapping and no qtoolkit `quantization` key."""
    return isinstance(data, dict) and "quantization" not in data and any(
        isinstance(k, str) and k.endswith("_stage") and isinstance(v, dict) for k, v in data.items())


def _fail(lines: dict[tuple, int], source: str, path: tuple, msg: str) -> RecipeError:
    loc = path
    while loc and loc not in lines:
        loc = loc[:-1]
    return RecipeError(f"{source}:{lines.get(loc, 1)}: {msg}")


def _validate_with_llmcompressor(data: dict, lines: dict[tuple, int], source: str) -> None:
    """llm-compressor's parser and modifier models judge the file first, so what passes here is what `oneshot`
    accepts; its errors are turned into one line at the offending key."""
    for stage, groups, mtype, args in _modifiers(data):
        if not isinstance(args, dict):
            raise _fail(lines, source, (stage, groups, mtype),
                        f"{mtype} takes a mapping of arguments: write `{mtype}: {{...}}`")
        try:
            LlmcRecipe.from_dict({stage: {groups: {mtype: args}}})
        except ValidationError as e:
            err = e.errors()[0]
            loc = tuple(err["loc"])
            field = ".".join(str(p) for p in (stage, groups, mtype, *loc))
            if err["type"] == "extra_forbidden":
                msg = f"unknown key {field!r}: remove it or check its spelling"
            else:
                msg = f"{field}: {err['msg'].splitlines()[0]} (llm-compressor's check): fix that value"
            raise _fail(lines, source, (stage, groups, mtype, *loc), msg) from None
        except ValueError as e:  # unknown modifier types, presets llm-compressor does not know
            raise _fail(lines, source, (stage, groups, mtype),
                        f"llm-compressor refuses {mtype} ({str(e).splitlines()[0]}): "
                        f"use {' or '.join(MODIFIERS)}") from None


def _modifiers(data: dict) -> list[tuple[str, str, str, Any]]:
    """(stage key, group key, modifier type, args) for every modifier, in file order, as llm-compressor walks it."""
    found = []
    for stage, groups in data.items():
        if not (isinstance(stage, str) and stage.endswith("_stage") and isinstance(groups, dict)):
            continue
        for gkey, mods in groups.items():
            if isinstance(gkey, str) and gkey.endswith("_modifiers") and isinstance(mods, dict):
                found.extend((stage, gkey, mtype, args) for mtype, args in mods.items())
    return found


def _args(raw: Any, yaml_path: tuple, internal: tuple, lines: dict, source: str,
          remap: dict) -> dict[str, Any] | None:
    """A QuantizationArgs mapping restricted to what qtoolkit's schema carries (nothing is dropped silently)."""
    if raw is None:
        return None
    unknown = [k for k, v in raw.items() if k not in ARGS_FIELDS and k not in DERIVED_KEYS and not _unset(v)]
    if unknown:
        raise _fail(lines, source, (*yaml_path, unknown[0]),
                    f"{'.'.join(map(str, yaml_path))}.{unknown[0]} is not mapped by qtoolkit: remove it "
                    f"(qtoolkit reads {', '.join(ARGS_FIELDS)})")
    remap[internal] = yaml_path
    for k in raw:
        remap[(*internal, k)] = (*yaml_path, k)
    out = {k: v for k, v in raw.items() if v is not None and k in ARGS_FIELDS}
    if isinstance(out.get("scale_dtype"), str):
        out["scale_dtype"] = out["scale_dtype"].removeprefix("torch.")  # llm-compressor writes `torch.bfloat16`
    return out


def to_internal(data: dict, lines: dict[tuple, int], source: str) -> tuple[dict[str, Any], dict[tuple, int]]:
    """An llm-compressor recipe dict -> (qtoolkit recipe dict, its key-path -> line map for error messages)."""
    mods = _modifiers(data)
    if not mods:
        raise _fail(lines, source, (), "the recipe's stages hold no `*_modifiers` mapping: add e.g. "
                    "`quant_modifiers: {QuantizationModifier: {...}}` under the stage")
    stage, gkey, mtype, args = mods[0]
    base = (stage, gkey, mtype)
    if len(mods) > 1:
        raise _fail(lines, source, mods[1][:3], f"qtoolkit applies one quantization modifier; this recipe has "
                    f"{len(mods)} ({', '.join(m[2] for m in mods)}): keep one {' or '.join(MODIFIERS)}")
    if mtype not in MODIFIERS:
        raise _fail(lines, source, base, f"modifier {mtype} is not supported by qtoolkit: use "
                    f"{' or '.join(MODIFIERS)}")
    _validate_with_llmcompressor(data, lines, source)
    extra = [k for k, v in args.items() if k not in MODIFIER_KEYS and k not in DERIVED_KEYS and not _unset(v, k)]
    if extra:
        raise _fail(lines, source, (*base, extra[0]), f"{mtype}.{extra[0]} is not mapped by qtoolkit: remove it "
                    f"(qtoolkit reads {', '.join(sorted(MODIFIER_KEYS - {'group', 'index', 'start', 'end', 'update'}))})")
    remap: dict[tuple, tuple] = {("quantization", "modifier"): base}
    q: dict[str, Any] = {"modifier": mtype, "ignore": list(args.get("ignore") or [])}
    remap[("quantization", "ignore")] = (*base, "ignore")
    targets = args.get("targets", ["Linear"])
    q["targets"] = [targets] if isinstance(targets, str) else list(targets)
    for k in ("dampening_frac", "block_size"):
        if args.get(k) is not None:
            q[k], remap[("quantization", k)] = args[k], (*base, k)
    if not _unset(args.get("kv_cache_scheme")):
        raw, kv_path = args["kv_cache_scheme"], (*base, "kv_cache_scheme")
        unknown = [k for k, v in raw.items() if k not in KV_FIELDS and k not in DERIVED_KEYS and not _unset(v)]
        if unknown:
            raise _fail(lines, source, (*kv_path, unknown[0]), f"kv_cache_scheme.{unknown[0]} is not mapped by "
                        f"qtoolkit: remove it (qtoolkit reads {', '.join(KV_FIELDS)})")
        q["kv_cache_scheme"] = {k: v for k, v in raw.items() if k in KV_FIELDS and v is not None}
        remap[("quantization", "kv_cache_scheme")] = kv_path
        for k in raw:
            remap[("quantization", "kv_cache_scheme", k)] = (*kv_path, k)
    if args.get("config_groups") and args.get("scheme"):
        raise _fail(lines, source, (*base, "scheme"), "give `scheme` or `config_groups`, not both")
    if args.get("config_groups"):
        _map_groups(args["config_groups"], (*base, "config_groups"), q, lines, source, remap)
    elif args.get("scheme"):
        scheme = args["scheme"]
        if isinstance(scheme, dict):
            if len(scheme) != 1:
                raise _fail(lines, source, (*base, "scheme"), "qtoolkit maps one preset in `scheme`: "
                            "use config_groups for several")
            (scheme, targets), = scheme.items()
            q["targets"] = [targets] if isinstance(targets, str) else list(targets)
        q["scheme"], remap[("quantization", "scheme")] = scheme, (*base, "scheme")
    else:
        raise _fail(lines, source, base, f"{mtype} needs `scheme` (e.g. W4A16) or `config_groups`: add one")
    out = {"version": 1, "name": _stem(source), "description": f"llm-compressor recipe {source}",
           "quantization": q}
    meta = data.get(META_KEY) or {}
    out.update({k: meta[k] for k in META_FIELDS if k in meta})
    if (mtype == "GPTQModifier" or "kv_cache_scheme" in q) and "calibration" not in out:
        out["calibration"] = {}  # qtoolkit's calibration defaults; `--calibration`/`--num-samples` override them
    new_lines = {k: v for k, v in lines.items() if k and k[0] == META_KEY}
    new_lines.update({k[1:]: v for k, v in new_lines.items()})
    for internal, yaml_path in remap.items():
        loc = yaml_path
        while loc and loc not in lines:
            loc = loc[:-1]
        if loc in lines:
            new_lines[internal] = lines[loc]
    new_lines.setdefault(("quantization",), lines.get(base, 1))
    return out, new_lines


def _map_groups(groups: dict, path: tuple, q: dict, lines: dict, source: str, remap: dict) -> None:
    head = {n: g for n, g in groups.items() if list(g.get("targets") or []) == ["lm_head"]}
    body = {n: g for n, g in groups.items() if n not in head}
    if len(body) != 1 or len(head) > 1:
        raise _fail(lines, source, path, f"qtoolkit maps one config group for the body plus at most one that "
                    f"targets exactly [lm_head]; this recipe has {len(groups)}: merge them")
    (bname, bgroup), = body.items()
    for name, group in groups.items():
        extra = [k for k, v in group.items() if k not in GROUP_KEYS and not _unset(v)]
        if extra:
            raise _fail(lines, source, (*path, name, extra[0]), f"config group key {extra[0]!r} is not mapped by "
                        f"qtoolkit: remove it")
        for k in ("output_activations", "format"):
            if group.get(k) is not None:
                raise _fail(lines, source, (*path, name, k), f"config group {name}: `{k}` is not supported by "
                            "qtoolkit (compressed-tensors infers the format): remove it")
    gpath = (*path, bname)
    q["targets"] = list(bgroup.get("targets") or [])
    remap[("quantization", "targets")] = (*gpath, "targets")
    q["weights"] = _args(bgroup.get("weights"), (*gpath, "weights"), ("quantization", "weights"), lines, source,
                         remap)
    if q["weights"] is None:
        raise _fail(lines, source, gpath, f"config group {bname} has no `weights`: qtoolkit quantizes weights")
    acts = _args(bgroup.get("input_activations"), (*gpath, "input_activations"),
                 ("quantization", "input_activations"), lines, source, remap)
    if acts is not None:
        q["input_activations"] = acts
    if head:
        (hname, hgroup), = head.items()
        hpath = (*path, hname)
        if hgroup.get("input_activations") is not None:
            raise _fail(lines, source, (*hpath, "input_activations"), "the lm_head group takes weight-only INT8 "
                        "or INT4: remove its input_activations")
        weights = _args(hgroup.get("weights"), (*hpath, "weights"), ("quantization", "head", "weights"), lines,
                        source, remap)
        q["head"] = {"weights": weights}
        remap[("quantization", "head")] = hpath
        if "lm_head" not in q["ignore"]:
            q["ignore"].append("lm_head")  # qtoolkit's spelling: the body ignores it, the head group takes it


def _stem(source: str) -> str:
    name = source.replace("\\", "/").rsplit("/", 1)[-1]
    for suffix in (".yaml", ".yml"):
        name = name.removesuffix(suffix)
    return name or "llm-compressor-recipe"
