"""Recipe schema: every shipped recipe parses; each kind of bad recipe gives one error naming file, line and fix."""

from __future__ import annotations

import pytest

from qtoolkit.errors import RecipeError
from qtoolkit.quantize.recipe import check_against_model, list_recipes, load_recipe, parse_recipe

GOOD = """\
version: 1
name: t
quantization:
  modifier: QuantizationModifier
  scheme: W4A16
  weights:
    group_size: 32
"""


def test_shipped_recipes_parse():
    names = list_recipes()
    for required in ("fp8-dynamic", "fp8-weight", "int4-rtn", "int4-gptq", "int8-weight", "bnb-nf4"):
        assert required in names
    for name in names:
        r = load_recipe(name)
        assert r.name == name and len(r.sha256) == 64


def test_resolved_schemes_match_their_names():
    assert load_recipe("fp8-weight").resolved_scheme()["input_activations"] is None
    dyn = load_recipe("fp8-dynamic").resolved_scheme()
    assert dyn["weights"]["type"] == "float" and dyn["input_activations"]["dynamic"] is True
    w4 = load_recipe("int4-rtn").weight_args()
    assert (w4["num_bits"], w4["strategy"], w4["group_size"]) == (4, "group", 32)
    w8 = load_recipe("int8-weight").weight_args()
    assert (w8["num_bits"], w8["strategy"], w8["group_size"]) == (8, "channel", None)
    assert load_recipe("int4-gptq").calibration.num_samples > 0


@pytest.mark.parametrize("text, line, words", [
    (GOOD.replace("  scheme: W4A16\n", "  scheme: W4A16\n  bogus_key: 1\n"), 6, "unknown key"),
    (GOOD.replace("    group_size: 32\n", "    group_size: 32\n    num_bits: 5\n"), 8, "num_bits in"),
    (GOOD.replace("scheme: W4A16", "scheme: W9A99"), 5, "unknown scheme"),
    (GOOD.replace("  weights:\n    group_size: 32\n", "  weights: [1, 2\n"), 7, "malformed YAML"),
    (GOOD.replace("modifier: QuantizationModifier", "modifier: GPTQModifier"), 4, "calibration"),
    (GOOD.replace("group_size: 32", "group_size: -4"), 7, "greater than 0"),
])
def test_bad_recipes_name_the_line(text, line, words):
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, source="bad.yaml")
    msg = str(e.value)
    assert f"bad.yaml:{line}" in msg and words in msg and "\n" not in msg


def test_group_size_must_divide_in_features():
    r = parse_recipe(GOOD.replace("group_size: 32", "group_size: 128"), source="g.yaml")
    shapes = {"model.layers.0.self_attn.q_proj": (576, 576), "model.layers.0.mlp.down_proj": (576, 1536)}
    with pytest.raises(RecipeError, match=r"g.yaml:7: group_size 128 does not divide in_features 576.*32 or 64"):
        check_against_model(r, shapes)
    check_against_model(parse_recipe(GOOD, source="g.yaml"), shapes)  # 32 divides both


def test_recipe_matching_no_layer_is_an_error():
    with pytest.raises(RecipeError, match="match no Linear"):
        check_against_model(parse_recipe(GOOD), {})


def test_unknown_recipe_name_lists_the_shipped_ones():
    with pytest.raises(RecipeError, match="unknown recipe 'int5-magic'.*int4-rtn"):
        load_recipe("int5-magic")


def test_head_section_resolves_its_own_scheme_and_frees_lm_head_from_ignore():
    base = "version: 1\nname: r\nquantization:\n  modifier: QuantizationModifier\n  scheme: W4A16\n  ignore: [lm_head]\n"
    r = parse_recipe(base + "  head: {scheme: W8A16, weights: {strategy: channel}}\n")
    assert r.resolved_head()["weights"]["num_bits"] == 8 and r.resolved_head()["weights"]["strategy"] == "channel"
    assert r.quantization.body_ignore() == [] and r.quantization.ignore == ["lm_head"]
    assert parse_recipe(base).resolved_head() is None and parse_recipe(base).quantization.body_ignore() == ["lm_head"]
    with pytest.raises(RecipeError, match="head takes INT8 or INT4"):
        parse_recipe(base + "  head: {scheme: FP8}\n")
    with pytest.raises(RecipeError, match="unknown scheme"):
        parse_recipe(base + "  head: {scheme: W9A16}\n")
