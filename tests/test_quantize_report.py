"""quantize_report.json as a type: a report from before recipes carried `kv_cache_scheme` still reads, what the
sign-off keeps of it round-trips, and a damaged file is one error naming the file (exit 2), not a KeyError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qtoolkit.errors import QToolError
from qtoolkit.quantize.report import QuantizeReport, QuantizeSummary
from qtoolkit.signoff.judge import evaluate_gates
from qtoolkit.signoff.policy import MemoryGates, load_policy
from qtoolkit.signoff.report import markdown, plot_memory
from qtoolkit.signoff.verdict import SignoffReport

OLDER = Path(__file__).parent / "data" / "quantize_report_before_kv_cache_scheme.json"


def test_older_report_reads_with_its_figures():
    raw = json.loads(OLDER.read_text())
    assert "kv_cache_scheme" not in raw["recipe"]  # the file really predates the key
    report = QuantizeReport.load(OLDER)
    assert report.recipe.name == "int4-rtn" and report.recipe.kv_cache_scheme is None
    assert report.totals.linear_layers == len(report.layers) == 14
    assert report.totals.linear_quantized_bytes == sum(x.quantized_bytes for x in report.layers)
    assert report.totals.linear_ratio_vs_bf16 == raw["totals"]["linear_ratio_vs_bf16"]
    assert report.timings.verify_s == raw["timings"]["verify_s"]
    assert report.smoke_test is not None and report.smoke_test.prompt.startswith("Write a Python function")
    # written back, only the key the older writer did not know is added (as null); every figure is kept
    again = report.to_json()
    assert again["recipe"].pop("kv_cache_scheme") is None
    assert again == raw and list(again) == list(raw)


def test_first_format_without_recipe_hash_or_head_reads(tmp_path):
    raw = json.loads(OLDER.read_text())
    for key in ("sha256", "head"):  # the first quantize_report.json files had neither
        del raw["recipe"][key]
    (tmp_path / "quantize_report.json").write_text(json.dumps(raw))
    report = QuantizeReport.load(tmp_path / "quantize_report.json")
    assert report.recipe.sha256 is None and report.recipe.head is None and report.recipe.name == "int4-rtn"
    assert report.totals == QuantizeReport.load(OLDER).totals


def test_summary_is_what_the_signoff_report_keeps():
    report = QuantizeReport.load(OLDER)
    section = json.loads(json.dumps(report.summary.to_json()))  # through JSON, as report.json stores it
    assert set(section) == {"recipe", "totals", "timings", "smoke_test"}
    assert QuantizeSummary.from_json(section) == report.summary


def test_skipped_smoke_test_has_no_verify_timing(tmp_path):
    raw = json.loads(OLDER.read_text())
    raw["smoke_test"] = None
    del raw["timings"]["verify_s"]
    (tmp_path / "quantize_report.json").write_text(json.dumps(raw))
    report = QuantizeReport.load(tmp_path / "quantize_report.json")
    assert report.smoke_test is None and report.timings.verify_s is None
    assert "verify_s" not in report.to_json()["timings"]


def test_missing_report_is_none(tmp_path):
    assert QuantizeReport.load(tmp_path / "quantize_report.json") is None


@pytest.mark.parametrize("damage", ["truncated", "no totals", "totals not a mapping"])
def test_damaged_report_is_one_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "quantize_report.json"
    raw = json.loads(OLDER.read_text())
    if damage == "no totals":
        del raw["totals"]
    elif damage == "totals not a mapping":
        raw["totals"] = []
    path.write_text(OLDER.read_text()[:200] if damage == "truncated" else json.dumps(raw))
    with pytest.raises(QToolError, match="is not a readable quantize report.*qtool quantize") as e:
        QuantizeReport.load(path)
    assert str(path) in str(e.value) and e.value.exit_code == 2


def test_signoff_reads_memory_figures_from_the_typed_report():
    """The sign-off's memory gates, its report.md and its memory plot take their figures from the type."""
    report = QuantizeReport.load(OLDER)
    t = report.totals
    base = load_policy("default")
    policy = base.model_copy(update={"memory": MemoryGates(max_linear_ratio_vs_bf16=0.3,
                                                           max_checkpoint_bytes=t.checkpoint_bytes - 1)})
    gates = {g.name: g for g in evaluate_gates(policy, None, None, report)}
    ratio, size = gates["memory.max_linear_ratio_vs_bf16"], gates["memory.max_checkpoint_bytes"]
    assert (ratio.point, ratio.verdict) == (t.linear_ratio_vs_bf16, "PASS")  # 0.2828 <= 0.3
    assert (size.point, size.verdict) == (t.checkpoint_bytes, "FAIL")  # one byte over
    missing = {g.name: g for g in evaluate_gates(policy, None, None, None)}["memory.max_checkpoint_bytes"]
    assert missing.point is None and missing.verdict != "PASS"

    signoff = {"config": {"model": "m", "recipe": "int4-rtn"}, "verdict": "PASS", "policy": {"name": "p", "tasks": {}},
               "created": "now", "reasons": [], "gates": [], "steps": {}, "inputs": {}, "versions": {},
               "machine": {}, "quantize": json.loads(json.dumps(report.summary.to_json()))}
    md = markdown(SignoffReport.from_json(signoff))
    assert f"{t.linear_quantized_bytes / 2**20:.1f} MiB quantized" in md
    assert f"checkpoint {t.checkpoint_bytes / 2**20:.1f} MiB" in md
    assert plot_memory(report.summary)  # a PNG drawn from the same figures
