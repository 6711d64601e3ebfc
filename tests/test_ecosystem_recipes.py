"""llm-compressor recipe files: read verbatim, written by --print-recipe, every shipped recipe round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from compressed_tensors.quantization import QuantizationArgs

from qtoolkit.cli import main
from qtoolkit.errors import RecipeError
from qtoolkit.quantize.llmc_reader import ARGS_FIELDS
from qtoolkit.quantize.llmc_writer import dump_llmc
from qtoolkit.quantize.recipe import RECIPE_DIR, Recipe, list_recipes, load_recipe, parse_recipe

CANARY = RECIPE_DIR / "examples" / "int3-canary-llmcompressor.yaml"

LLMC = """\
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      targets: [Linear]
      scheme: W4A16
"""

GROUPS = """\
sparsity_stage:
  run_type: oneshot
  quantization_modifiers:
    GPTQModifier:
      dampening_frac: 0.05
      ignore: ["lm_head", "re:.*down_proj"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights:
            num_bits: 4
            type: int
            strategy: group
            group_size: 32
            symmetric: false
"""


def _meaning(r: Recipe) -> dict:
    """What a recipe makes `oneshot` do and qtoolkit record: presets resolved, unset arguments dropped."""
    def clean(d):  # as compressed-tensors' QuantizationArgs fills them in when oneshot builds the modifier
        if d is None:
            return None
        args = QuantizationArgs.model_validate({k: v for k, v in d.items() if v is not None})
        return args.model_dump(include=set(ARGS_FIELDS), exclude_none=True)

    q = r.quantization
    resolved = {k: clean(v) for k, v in r.resolved_scheme().items()}
    head = r.resolved_head()
    return {"name": r.name, "description": r.description, "precision": r.precision, "modifier": q.modifier,
            "resolved": resolved, "head": clean(head["weights"]) if head else None, "targets": q.targets,
            "ignore": sorted(q.ignore), "dampening_frac": q.dampening_frac, "block_size": q.block_size,
            "calibration": r.calibration.model_dump() if r.calibration else None, "gates": r.gates}


@pytest.mark.parametrize("name", [n for n in list_recipes() if n != "bnb-nf4"])
def test_shipped_recipe_round_trips_through_llm_compressor(name, tmp_path):
    from llmcompressor.recipe import Recipe as LlmcRecipe

    r = load_recipe(name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(dump_llmc(r))
    # llm-compressor itself reads the written file (what oneshot(recipe=path) does) into one modifier
    mods = LlmcRecipe.create_instance(str(path)).modifiers
    assert [type(m).__name__ for m in mods] == [r.quantization.modifier]
    back = load_recipe(path)
    assert _meaning(back) == _meaning(r)
    # llm-compressor's own serialization (what it saves as recipe.yaml beside a checkpoint) reads back too;
    # it keeps only the modifier, so qtoolkit's name/precision/calibration/gates are not compared
    theirs = parse_recipe(LlmcRecipe.create_instance(str(path)).yaml(), source=f"{name}-recipe.yaml")
    modifier_only = ("resolved", "head", "targets", "ignore", "modifier", "dampening_frac", "block_size")

    def without_observer(m: dict) -> dict:  # llm-compressor writes out the observer it chose by default
        drop = ("observer",)
        m = {**m, "resolved": {k: v and {a: x for a, x in v.items() if a not in drop} for k, v in m["resolved"].items()},
             "head": m["head"] and {a: x for a, x in m["head"].items() if a not in drop}}
        m["block_size"] = m["block_size"] or (128 if m["modifier"] == "GPTQModifier" else None)  # its default
        return {k: m[k] for k in modifier_only}

    assert without_observer(_meaning(theirs)) == without_observer(_meaning(r))


def test_bnb_recipe_cannot_be_printed_as_llm_compressor(capsys):
    assert main(["quantize", "--recipe", "bnb-nf4", "--print-recipe"]) == 2
    err = capsys.readouterr().err.strip()
    assert "BitsAndBytes" in err and "\n" not in err


def test_print_recipe_cli_writes_a_recipe_that_reads_back(capsys, tmp_path):
    assert main(["quantize", "--recipe", "int4-rtn-asym-head8", "--print-recipe"]) == 0
    text = capsys.readouterr().out
    data = yaml.safe_load(text)
    assert "QuantizationModifier" in data["quant_stage"]["quant_modifiers"]
    back = parse_recipe(text, source="printed.yaml")
    assert _meaning(back) == _meaning(load_recipe("int4-rtn-asym-head8"))


def test_llm_compressor_preset_and_groups_layouts():
    r = parse_recipe(LLMC, source="w4a16.yaml")
    assert r.name == "w4a16" and r.quantization.scheme == "W4A16" and r.weight_args()["group_size"] == 128
    g = parse_recipe(GROUPS, source="/x/gptq.yaml")
    w = g.weight_args()
    assert (g.method, w["num_bits"], w["group_size"], w["symmetric"]) == ("gptq", 4, 32, False)
    assert g.quantization.ignore == ["lm_head", "re:.*down_proj"] and g.quantization.dampening_frac == 0.05
    assert g.calibration is not None  # GPTQ gets qtoolkit's calibration defaults
    d = parse_recipe(LLMC.replace("scheme: W4A16", "scheme: {W8A16: [Linear]}"), source="d.yaml")
    assert d.quantization.scheme == "W8A16"


@pytest.mark.parametrize("text, line, words", [
    (LLMC.replace("      scheme: W4A16\n", "      scheme: W4A16\n      bogus: 1\n"), 7, "unknown key"),
    (LLMC.replace("QuantizationModifier", "SparseGPTModifier"), 3, "use QuantizationModifier"),
    (LLMC.replace("QuantizationModifier", "QuantModifier"), 3, "use QuantizationModifier"),
    (LLMC.replace("scheme: W4A16", "scheme: W9A99"), 6, "preset scheme name"),
    (LLMC + "    SmoothQuantModifier:\n      smoothing_strength: 0.5\n", 7, "one quantization modifier"),
    (LLMC + "      kv_cache_scheme: {num_bits: 8, type: float, group_size: 16}\n", 7,
     "kv_cache_scheme.group_size is not mapped"),
    (LLMC + "      kv_cache_scheme: {num_bits: 4, type: int}\n", 7, "num_bits"),
    (GROUPS.replace("num_bits: 4", "num_bits: four"), 11, "valid integer"),
    (GROUPS.replace("num_bits: 4", "num_bits: 5"), 11, "num_bits in"),
    (GROUPS.replace("symmetric: false", "symmetric: false\n            observer_kwargs: {a: 1}"), 16,
     "observer_kwargs is not mapped"),
    (GROUPS.replace("symmetric: false", "symmetric: false\n            block_structure: [8, 8]"), 10,
     "Block structure requires block strategy (llm-compressor's check)"),
    (GROUPS.replace("group_size: 32", "group_size: 0"), 10, "group_size to be set"),
    (LLMC.replace("      scheme: W4A16\n", ""), 3, "needs `scheme`"),
])
def test_bad_llm_compressor_recipes_name_the_line(text, line, words):
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, source="bad.yaml")
    msg = str(e.value)
    assert f"bad.yaml:{line}:" in msg and words in msg and "\n" not in msg, msg


def test_llm_compressor_canary_quantizes_through_the_cli(tiny_model_dir, tmp_path, capsys):
    """The INT3 per-channel canary, written as llm-compressor writes recipes, quantizes like the qtoolkit one."""
    import llmcompressor  # noqa: F401  (an application that uses llm-compressor has imported it already)
    from loguru import logger

    seen: list[str] = []
    sink = logger.add(seen.append, level="INFO", format="{message}")  # the application's own sink
    out = tmp_path / "canary"
    assert main(["quantize", "--model", str(tiny_model_dir), "--recipe", str(CANARY), "--output", str(out),
                 "--no-verify"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["recipe"] == "int3-canary-llmcompressor"
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = cfg["config_groups"].values()
    assert (group["weights"]["num_bits"], group["weights"]["strategy"]) == (3, "channel")
    assert "lm_head" in cfg["ignore"]
    assert Path(out / "qtoolkit_recipe.yaml").read_text() == CANARY.read_text()
    saved = load_recipe(out / "recipe.yaml")  # the recipe.yaml llm-compressor wrote beside the checkpoint
    assert saved.weight_args() == {**load_recipe(CANARY).weight_args(), "observer": "memoryless_minmax"}
    logger.info("still-here")  # quantize left the application's loguru sinks in place
    logger.remove(sink)
    assert seen and seen[-1].strip() == "still-here"


def test_llm_compressor_kv_cache_scheme_is_honoured():
    """kv_cache_scheme maps verbatim, brings qtoolkit's calibration defaults (its scales are calibrated) and is
    written back into the llm-compressor recipe."""
    text = LLMC + "      kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}\n"
    r = parse_recipe(text, source="kv.yaml")
    assert r.quantization.kv_cache_scheme.model_dump() == {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                           "dynamic": False, "symmetric": True}
    assert r.calibration is not None
    written = yaml.safe_load(dump_llmc(r))["quant_stage"]["quant_modifiers"]["QuantizationModifier"]
    assert written["kv_cache_scheme"]["type"] == "float"
    assert parse_recipe(dump_llmc(r), source="back.yaml").quantization.kv_cache_scheme == r.quantization.kv_cache_scheme
    shipped = load_recipe("fp8-dynamic-kv8")
    assert shipped.quantization.kv_cache_scheme.type == "float" and shipped.calibration is not None
    with pytest.raises(RecipeError, match="calibration"):
        parse_recipe("version: 1\nname: x\nquantization:\n  modifier: QuantizationModifier\n  scheme: FP8_DYNAMIC\n"
                     "  kv_cache_scheme: {num_bits: 8}\n", source="nocal.yaml")
