"""Recipe and policy YAML: anchors/aliases and oversized files are refused at once with one line."""

from __future__ import annotations

import time

import pytest

from qtoolkit.cli import main
from qtoolkit.errors import RecipeError
from qtoolkit.quantize.recipe import load_recipe
from qtoolkit.signoff.policy import PolicyError, load_policy


def nested_aliases(levels: int = 9) -> str:
    """The billion-laughs shape: each level lists the previous one nine times (376 bytes at 9 levels)."""
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [{','.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


def test_nested_alias_recipe_is_refused_instantly(tmp_path):
    text = nested_aliases()
    assert len(text.encode()) < 400
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    t = time.monotonic()
    with pytest.raises(RecipeError, match=r"bomb.yaml:1: YAML anchors and aliases"):
        load_recipe(path)
    with pytest.raises(PolicyError, match="anchors and aliases"):
        load_policy(path)
    assert time.monotonic() - t < 5  # the tree is never composed (it would take minutes, then all memory)


def test_oversized_and_malformed_yaml_name_the_file(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n" + "# pad\n" * 300_000)
    with pytest.raises(RecipeError, match=r"big.yaml: \d+ bytes is larger than"):
        load_recipe(big)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(PolicyError, match="bad.yaml"):
        load_policy(bad)


def test_cli_refuses_an_alias_recipe_with_exit_2(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(nested_aliases())
    assert main(["quantize", "--model", str(tmp_path / "nowhere"), "--recipe", str(path),
                 "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bomb.yaml" in err[0]


def test_shipped_recipes_and_policies_still_load():
    from qtoolkit.quantize.recipe import list_recipes

    for name in list_recipes():
        assert load_recipe(name).name
    assert load_policy("default")
