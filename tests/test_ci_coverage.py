"""The coverage harness, reduced: every interval a default-policy gate reads keeps >= 93% coverage at the main
job's sample sizes (8 items, 5 rounds) and at 40 items, over 2,000 seeded simulated runs per cell."""

from __future__ import annotations

import json

import numpy as np
import pytest
from qtoolkit.evals.stats import coverage
from qtoolkit.evals.stats.paired import LABELS, coverage_at, paired_delta, ratio_over_rounds, token_stats
from qtoolkit.evals.summary import figure_from_json

from qtoolkit.commands.signoff import DEFAULT_MAX_ITEMS
from qtoolkit.signoff.config import LocalSignoffConfig
from qtoolkit.signoff.policy import load_policy
from qtoolkit.signoff.sequential import stages
from qtoolkit.signoff.verdicts import INCONCLUSIVE, PASS, judge_quality

RUNS = 2000
GATED = ("kld", "nll", "bounded", "binary", "rounds")  # kld_mean, nll_delta, rougeL_drop, pass_at_1_drop, speedup
# the table's shape of the figure each interval-judged gate of the default policy reads (memory gates read the
# checkpoint's measured bytes: a point, no sample)
GATE_SHAPES = {"kld_mean": "kld", "nll_delta": "nll", "rougeL_drop": "bounded", "pass_at_1_drop": "binary",
               "min_speedup": "rounds", "min_decode_speedup": "rounds", "prefill_margin": "rounds",
               "capacity": "rounds"}  # the capacity gate: Student t on log ratios over its paired searches
# (shape, n) where the table's method misses 93% (measurements/2026-12-04/issue39/ci-coverage.json): with the
# ROUGE-L drop on its bound the deltas skew and no interval holds 93% at 8 or 16 items (Student t 0.907 / 0.930),
# so the ROUGE-L gate decides from 32 items. Paired pass/fail: Tango's score interval holds at every size (Newcombe's,
# measured beside it, covers 0.926 at 12-16 items with a pass@1 drop of 0.15, so it is no longer the gate's method)
SHORT = {("bounded", 8), ("bounded", 16)}


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
        if (shape, int(n)) in SHORT:  # below the bar here: the shipped table marks it unreliable (see SHORT)
            assert not coverage_at(shape, int(n))[2]
            continue
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
        assert reliable == ((shape, n) not in SHORT) and (cov >= coverage.TARGET) == reliable
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


def test_every_default_policy_gate_reads_a_shape_the_table_vouches_for_at_the_main_jobs_looks():
    """Every interval-judged gate of the default policy maps to a table shape, and that shape's method holds
    >= 93% at each look of the main job (8 items doubling to the --max-items budget; its rounds) and at 40."""
    policy = load_policy("default")
    gates = [m for bounds in policy.tasks.values() for m in bounds]
    gates += [k for k, v in policy.throughput.model_dump().items() if v is not None]
    assert set(gates) <= set(GATE_SHAPES), set(gates) - set(GATE_SHAPES)
    # the main job: `qtool signoff --model default --recipe fp8-dynamic`
    cfg = LocalSignoffConfig(recipe="fp8-dynamic", output="runs/signoff")
    looks = stages(cfg.limit, DEFAULT_MAX_ITEMS) + [40]
    assert looks[:4] == [8, 16, 32, 64] and cfg.rounds == 3  # the speed gates' first look (signoff/speed.py)
    for gate in gates:
        shape = GATE_SHAPES[gate]
        for n in [cfg.rounds] if shape == "rounds" else looks:
            method, cov, reliable = coverage_at(shape, n)
            if (shape, n) in SHORT:  # measured below the bar: marked unreliable, so the gate cannot pass there
                assert not reliable and cov < coverage.TARGET, (gate, n, cov)
                continue
            assert reliable and cov >= coverage.TARGET and method not in coverage.LEGACY, (gate, n, method, cov)
    # a pass@1 drop that looks well within its bound decides nothing at 16 items, and passes at 64
    for n, verdict in ((16, INCONCLUSIVE), (64, PASS)):
        fig = figure_from_json(paired_delta([1.0] * (n // 2) + [0.0] * (n // 2), [1.0] * (n // 2) + [0.0] * (n // 2),
                                            seed=0))
        assert judge_quality(fig, -1.0, False, max_=0.15, min_=None).verdict == verdict, n


def test_the_figures_gates_read_take_the_method_of_their_shape():
    """The shape a figure is given by the code that makes it is the one GATE_SHAPES names."""
    rng = np.random.default_rng(0)
    n = 8
    nll = paired_delta(rng.normal(1.0, 0.1, n), rng.normal(1.0, 0.1, n), rng.integers(20, 90, n), seed=0)
    rouge = paired_delta(rng.uniform(0.1, 0.4, n), rng.uniform(0.1, 0.4, n), seed=0)
    passed = paired_delta([1.0, 0, 1, 0, 0, 1, 0, 0], [1.0, 1, 1, 0, 0, 0, 0, 0], seed=0)
    records = [{"tokens": 50, "nll_candidate": list(rng.uniform(0.5, 1.5, 50)),
                "nll_baseline": list(rng.uniform(0.5, 1.5, 50)),
                "kld": list(0.03 * rng.lognormal(0.0, 0.15) * rng.lognormal(-0.1, 0.5, 50))} for _ in range(n)]
    kld = token_stats(records, seed=0)["kld"]
    rounds = ratio_over_rounds([12.0, 12.5, 11.9, 12.2, 12.8], [10.0] * 5)
    for gate, fig in (("nll_delta", nll), ("rougeL_drop", rouge), ("pass_at_1_drop", passed),
                      ("kld_mean", kld)):
        assert fig["ci_method"] == LABELS[coverage_at(GATE_SHAPES[gate], n)[0]], (gate, fig["ci_method"])
    assert rounds["ci_method"] == LABELS["rounds"] and rounds["ci_coverage"] == coverage_at("rounds", 5)[1]
