"""The coverage harness, reduced: every interval a default-policy gate reads keeps >= 93% coverage at the main
job's sample sizes (8 items, 5 rounds) and at 40 items, over 2,000 seeded simulated runs per cell."""

from __future__ import annotations

import json

import pytest
from qtoolkit.evals import coverage
from qtoolkit.evals.stats import coverage_at

RUNS = 2000
GATED = ("kld", "nll", "bounded", "binary", "rounds")  # kld_mean, nll_delta, rougeL_drop, pass_at_1_drop, speedup


@pytest.fixture(scope="module")
def measured():
    names = [s.name for s in coverage.SCENARIOS if s.kind == "calibrated"]
    results = coverage.run(RUNS, 999, seed=1, names=names, item_sizes=(8, 40), round_sizes=(5,))
    return results, coverage.table(results)


@pytest.mark.parametrize("shape", GATED)
def test_every_gated_statistic_keeps_coverage_at_the_main_jobs_sizes(measured, shape):
    _, tab = measured
    sizes = ("5",) if shape == "rounds" else ("8", "40")
    for n in sizes:
        method = tab[shape]["method"][n]
        assert method not in coverage.LEGACY
        assert tab[shape]["coverage"][method][n] >= coverage.TARGET, (shape, n, method, tab[shape]["coverage"])


def test_the_old_intervals_are_shown_to_undercover(measured):
    """The harness can fail: at 8 items the percentile bootstrap and the token-iid `±` miss far too often."""
    _, tab = measured
    assert tab["kld"]["coverage"]["percentile"]["8"] < 0.90
    assert tab["kld"]["coverage"]["token_iid"]["40"] < 0.80  # tokens of one item are not independent
    assert tab["binary"]["coverage"]["percentile"]["8"] < 0.50  # all-equal samples collapse to a point


def test_shipped_table_matches_a_rerun_and_marks_small_samples_unreliable(measured):
    _, tab = measured
    for shape in GATED:
        n = 5 if shape == "rounds" else 8
        method, cov, reliable = coverage_at(shape, n)
        assert reliable and cov >= coverage.TARGET
        assert abs(cov - tab[shape]["coverage"][method][str(n)]) < 0.03  # 2,000 reduced runs vs the full table
    assert coverage_at("kld", 2) == (coverage_at("kld", 2)[0], None, False)  # below the table: nothing known


def test_cli_writes_measurements_and_table(tmp_path, monkeypatch):
    monkeypatch.setattr(coverage, "SCENARIOS", [s for s in coverage.SCENARIOS if s.name in
                                                {"rounds-lognormal", "rounds-heavy", "pass-even"}])
    monkeypatch.setattr(coverage, "METHODS", {k: coverage.METHODS[k] for k in ("binary", "rounds")})
    monkeypatch.setattr(coverage, "ITEM_SIZES", (8,))
    out, tab = tmp_path / "cov.json", tmp_path / "table.py"
    assert coverage.main(["--output", str(out), "--table", str(tab), "--runs", "200", "--resamples", "99"]) == 0
    data = json.loads(out.read_text())
    assert data["runs"] == 200 and set(data["scenarios"]) == {"rounds-lognormal", "rounds-heavy", "pass-even"}
    assert "percentile" in data["scenarios"]["rounds-heavy"]["n"]["5"]  # the old method is kept beside the new
    namespace: dict = {}
    exec(tab.read_text(), namespace)
    assert namespace["TABLE"]["rounds"]["method"]["5"] == "t"
