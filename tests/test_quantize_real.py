"""The real default model through `qtool quantize` (slow set): sizes and reload-and-generate for each format."""

from __future__ import annotations

import json

import pytest

from qtoolkit.cli import main
from qtoolkit.quantize.report import QuantizeReport

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("recipe, max_ratio, extra", [
    ("int4-rtn", 0.30, []),
    ("int4-gptq", 0.30, ["--num-samples", "16"]),  # fewer samples than the recipe's 64 keeps CI in budget
    ("fp8-dynamic", 0.52, []),
    ("fp8-weight", 0.52, []),
])
def test_default_model_quantizes_and_reloads(recipe, max_ratio, extra, tmp_path, capsys):
    out = tmp_path / recipe
    assert main(["quantize", "--model", "default", "--recipe", recipe, "--output", str(out), *extra]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["linear_ratio_vs_bf16"] <= max_ratio
    report = QuantizeReport.load(out / "quantize_report.json")
    assert report.totals.linear_layers == 210  # 30 layers x 7 projections; lm_head stays tied
    # transformers reloaded the checkpoint and wrote code for the smoke prompt
    assert "def " in report.smoke_test.completion, report.smoke_test


def test_group_128_is_refused_for_k_576(tmp_path, capsys):
    bad = tmp_path / "g128.yaml"
    bad.write_text("name: g128\nquantization:\n  modifier: QuantizationModifier\n  scheme: W4A16\n")
    code = main(["quantize", "--recipe", str(bad), "--output", str(tmp_path / "out")])
    assert code == 2 and "group_size 128 does not divide in_features 576" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
