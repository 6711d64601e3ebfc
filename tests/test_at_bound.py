"""Gates judged where a real regression sits: with the truth exactly on the policy's bound.

The shipped split of each look's error between a gate's PASS end and its FAIL end (evals/stats/at_bound_table.py)
must keep the false PASS rate within 5% there; these tests re-simulate it on fewer runs than the shipped
measurement (measurements/2026-12-04/issue39/at-bound.json, 20,000 runs a cell) and hold every cell to its target
plus three Monte Carlo standard errors.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from qtoolkit.evals.stats import at_bound as ab
from qtoolkit.evals.stats import intervals as iv
from qtoolkit.evals.stats.at_bound_table import ONE_LOOK, SEVERAL_LOOKS, SIDE_SHARES
from qtoolkit.evals.stats.paired import N_RESAMPLES, Level, binary_delta_ci, side_errors
from qtoolkit.evals.summary import figure_from_json

from qtoolkit.signoff.verdicts import FAIL, INCONCLUSIVE, PASS, judge_interval, judge_quality

RUNS = 2000
RESAMPLES = N_RESAMPLES  # the sign-off's own: the far tails the PASS end reads depend on it


def _within(rate: float, target: float, runs: int) -> bool:
    return rate <= target + 3 * math.sqrt(target * (1 - target) / runs)


def test_all_concordant_pairs_give_a_real_interval_not_a_point():
    """8 HumanEval items, 4 solved by both sides, none flipped: Newcombe's continuity-corrected phi keeps the
    interval wide (without it phi = 1 and the interval collapses to [0, 0])."""
    both = np.array([1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
    lo, hi = iv.newcombe_paired(both[None], both[None], 0.9942)
    assert lo[0] < -0.2 and hi[0] > 0.2
    for level in (0.95, 0.99):
        lo, hi = iv.newcombe_paired(both[None], both[None], level)
        assert hi[0] - lo[0] > 0.2


@pytest.mark.parametrize("looks", [None, 1, 4])
@pytest.mark.parametrize("level", [0.95, 0.9942, 0.99])
def test_eight_concordant_items_never_pass_the_pass_at_1_gate(looks, level):
    both = [1, 1, 1, 1, 0, 0, 0, 0]
    ci = binary_delta_ci(both, both, Level(level, looks))
    fig = figure_from_json({"candidate": 0.5, "baseline": 0.5, "delta": 0.0, **ci.fields(), "items": 8})
    j = judge_quality(fig, -1.0, False, max_=0.15, min_=None, min_share=0.25)
    assert j.verdict != PASS, j.detail


def _newcombe_scalar(a: int, b: int, c: int, d: int, level: float) -> tuple[float, float]:
    """Newcombe (1998) method 10 written out for one 2x2 table of pairs (a: both pass, b: candidate only, c:
    baseline only, d: neither), as Altman et al.'s "Statistics with confidence" states it: phi from ad - bc
    shrunk by n/2 when positive."""
    from scipy.stats import norm
    n = a + b + c + d
    z = norm.ppf((1 + level) / 2)

    def wilson(k: int) -> tuple[float, float]:
        p = k / n
        centre, half = 2 * n * p + z * z, z * math.sqrt(z * z + 4 * n * p * (1 - p))
        return (centre - half) / (2 * (n + z * z)), (centre + half) / (2 * (n + z * z))

    p1, p2 = (a + b) / n, (a + c) / n
    (l1, u1), (l2, u2) = wilson(a + b), wilson(a + c)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    corrected = cross - n / 2 if cross > n / 2 else min(cross, 0)
    phi = corrected / math.sqrt(margins) if margins else 0.0
    lo = p1 - p2 - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0))
    hi = p1 - p2 + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0))
    return lo, hi


def test_newcombe_matches_the_published_formula_on_every_table():
    """The vectorized interval equals a scalar transcription of the formula on every table of 3-12 pairs."""
    for n in (3, 8, 12):
        for a in range(n + 1):
            for b in range(n + 1 - a):
                for c in range(n + 1 - a - b):
                    d = n - a - b - c
                    cand = np.array([1] * a + [1] * b + [0] * c + [0] * d, dtype=bool)
                    base = np.array([1] * a + [0] * b + [1] * c + [0] * d, dtype=bool)
                    lo, hi = iv.newcombe_paired(cand[None], base[None], 0.95)
                    assert (lo[0], hi[0]) == pytest.approx(_newcombe_scalar(a, b, c, d, 0.95), abs=1e-12)


def _table(a: int, b: int, c: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    cand = np.array([1] * a + [1] * b + [0] * c + [0] * d, dtype=bool)
    base = np.array([1] * a + [0] * b + [1] * c + [0] * d, dtype=bool)
    return cand[None], base[None]


def _tango_scalar(b: int, c: int, n: int, level: float) -> tuple[float, float]:
    """Tango (1998) written out for one table: the restricted estimate q of the baseline-only share solves
    2n q^2 + B q + C = 0 with B = -b - c + (2n - b + c) delta, C = -c delta (1 - delta); the score is
    (b - c - n delta) / sqrt(n (2 q + delta (1 - delta))); the ends are where it equals -+z (scipy's brentq)."""
    from scipy.optimize import brentq
    from scipy.stats import norm
    z = norm.ppf((1 + level) / 2)

    def score(delta: float) -> float:
        qb, qc = -b - c + (2 * n - b + c) * delta, -c * delta * (1 - delta)
        q = (math.sqrt(max(qb * qb - 8 * n * qc, 0.0)) - qb) / (4 * n)
        var = n * (2 * q + delta * (1 - delta))
        num = b - c - n * delta
        return num / math.sqrt(var) if var > 0 else (0.0 if num == 0 else math.copysign(math.inf, num))

    edge, est = 1 - 1e-13, (b - c) / n
    lo = -1.0 if score(-edge) <= z else brentq(lambda x: score(x) - z, -edge, est, xtol=1e-14)
    hi = 1.0 if score(edge) >= -z else brentq(lambda x: score(x) + z, est, edge, xtol=1e-14)
    return lo, hi


@pytest.mark.parametrize("level", [0.95, 0.995])
def test_tango_matches_a_scalar_transcription_on_every_table(level):
    """The vectorized interval equals Tango's formula solved one table at a time on every table of 3, 8, 12 and
    20 pairs (the ends depend only on the discordant counts b and c)."""
    for n in (3, 8, 12, 20):
        for b in range(n + 1):
            for c in range(n + 1 - b):
                lo, hi = iv.tango_paired(*_table(n - b - c, b, c, 0), level)
                assert (lo[0], hi[0]) == pytest.approx(_tango_scalar(b, c, n, level), abs=1e-9), (n, b, c)


def test_tango_is_never_a_point_and_has_the_closed_form_without_discordant_pairs():
    """No item flips: the score statistic is sqrt(n |delta| / (1 - |delta|)), so the interval is exactly
    +-z^2 / (n + z^2) (8 items at 95%: +-0.3244, the same width as Newcombe's there); every table of up to 16
    pairs gives a positive width at every level the sign-off uses."""
    from scipy.stats import norm
    for n in range(1, 80):
        for level in (0.95, 0.9942):
            z = norm.ppf((1 + level) / 2)
            lo, hi = iv.tango_paired(*_table(n // 2, 0, 0, n - n // 2), level)
            assert (lo[0], hi[0]) == pytest.approx((-z * z / (n + z * z), z * z / (n + z * z)), abs=1e-12)
    for n in (1, 2, 5, 8, 16):
        tables = [(b, c) for b in range(n + 1) for c in range(n + 1 - b)]
        cand = np.array([[1] * b + [0] * c + [0] * (n - b - c) for b, c in tables], dtype=bool)
        base = np.array([[0] * b + [1] * c + [0] * (n - b - c) for b, c in tables], dtype=bool)
        for level in (0.5, 0.95, 0.999, 1 - 1e-6):
            lo, hi = iv.tango_paired(cand, base, level)
            assert np.all(hi - lo > 1e-3) and np.all(lo >= -1) and np.all(hi <= 1), (n, level)


def test_tango_statistic_falls_with_the_tested_difference_on_every_table():
    """The at-bound simulation reads each run's critical error from the statistic at the bound (tango_critical),
    which is the interval's only if the statistic falls as the tested difference grows: checked on a fine grid for
    every table at the sign-off's looks."""
    grid = np.linspace(-0.999, 0.999, 1999)
    for n in (8, 16, 32, 64):
        b, c = (x.ravel().astype(np.float64) for x in np.meshgrid(np.arange(n + 1), np.arange(n + 1)))
        keep = b + c <= n
        t = iv.tango_z(b[keep, None], c[keep, None], n, grid[None, :])
        finite = np.isfinite(t[:, 1:]) & np.isfinite(t[:, :-1])
        assert not np.any((np.diff(t, axis=1) > 1e-12) & finite), n


def test_tango_critical_errors_agree_with_the_interval():
    """tango_critical's error is where the interval's end crosses the bound: a hair more error and the end is past
    it, a hair less and it is not."""
    rng = np.random.default_rng(3)
    for n in (8, 16, 64):
        base = rng.random((300, n)) < 0.6
        cand = base ^ (rng.random((300, n)) < np.where(base, 0.35, 0.05))
        for bound in (-0.15, 0.0, 0.1):
            hi_below, lo_above = iv.tango_critical(cand, base, bound)
            for crit, end, past in ((hi_below, 1, np.less_equal), (lo_above, 0, np.greater_equal)):
                ok = (crit > 1e-6) & (crit < 0.45)
                more = iv.tango_paired(cand, base, 1 - 2 * np.minimum(crit * 1.001, 0.499))[end]
                less = iv.tango_paired(cand, base, 1 - 2 * crit * 0.999)[end]
                assert np.all(past(more, bound)[ok]) and not np.any(past(less, bound)[ok]), (n, bound, end)


@pytest.mark.parametrize("lo, hi", [(math.nan, 0.01), (0.01, math.nan), (-math.inf, 0.01), (math.nan, math.nan)])
def test_a_nan_or_infinite_end_never_passes(lo, hi):
    j = judge_interval(0.005, lo, hi, max_=0.1, min_=None)
    assert j.verdict in (INCONCLUSIVE, FAIL) and j.verdict != PASS
    j = judge_interval(2.0, lo, hi, max_=None, min_=1.0)
    assert j.verdict != PASS


def test_an_interval_with_a_nan_end_fails_on_its_finite_best_end():
    assert judge_interval(0.5, 0.3, math.nan, max_=0.1, min_=None).verdict == FAIL


def test_side_errors_split_the_look_error_by_the_shipped_table():
    for stat, schedules in SIDE_SHARES.items():
        for looks, schedule in ((1, ONE_LOOK), (4, SEVERAL_LOOKS)):
            p, f = schedules[schedule]
            assert 0 < p <= ab.MAX_SHARE and 0 < f <= ab.MAX_SHARE
            assert side_errors(stat, 0.01, looks) == pytest.approx((0.01 * p, 0.01 * f))


def test_sided_interval_reads_the_pass_end_at_its_own_level():
    """Inside a sign-off's look the KLD gate's upper (PASS) end is computed at the PASS side's level and the lower
    (FAIL) end at the FAIL side's: each end equals the same end of a two-sided interval at that level."""
    rng = np.random.default_rng(0)
    v = rng.lognormal(-3, 0.4, 40)
    from qtoolkit.evals.stats.paired import mean_ci
    ci = mean_ci(v, seed=0, shape="kld", level=Level(0.99, 4))
    pass_err, fail_err = side_errors("kld", 0.01, 4)
    at_pass = mean_ci(v, seed=0, shape="kld", level=Level(1 - 2 * pass_err), method=ci.method)
    at_fail = mean_ci(v, seed=0, shape="kld", level=Level(1 - 2 * fail_err), method=ci.method)
    assert ci.bounds == pytest.approx([at_fail.bounds[0], at_pass.bounds[1]])


@pytest.fixture(scope="module")
def simulated():
    """The at-bound simulation for every scenario on fewer runs (the shipped file has 20,000 a cell)."""
    out, cells = {}, {}
    for sc in ab.scenarios():
        draws = ab.draw(sc, RUNS, ab.DEFAULT_LOOKS[-1], seed=7)
        crit = ab.criticals(sc, draws, RESAMPLES, 7, sc.truth())
        cells[sc.name] = {d.name: ab.per_run(sc, crit, d.looks, bool(ab.PASS_END[sc.family])) for d in ab.designs()}
        out[sc.name] = sc
    return out, cells


def test_false_pass_at_the_bound_is_within_target_for_every_design(simulated):
    """With the shipped shares: 5% for a sign-off (default 8 -> 64 looks and every single look), 5%/m for a
    sweep's candidate (m = 2, 3, 5). A regression sitting exactly on the bound must not pass more often."""
    scenarios, cells = simulated
    bad = []
    for name, sc in scenarios.items():
        for d in ab.designs():
            pass_share = SIDE_SHARES[sc.family][ab.schedule_of(d.name)][0]
            rate = float((cells[name][d.name].pass_at <= d.alpha * pass_share).mean())
            if not _within(rate, d.alpha, RUNS):
                bad.append((name, d.name, rate, d.alpha))
    assert not bad, bad


def test_the_old_two_sided_rule_passed_too_often_at_the_bound(simulated):
    """The bar's counter-test: an even split of the old 3% spend over 8 -> 64 looks (each end 1.5%) with the
    shipped interval methods lets some statistic pass more than 5% of regressions on the bound, so the simulation
    discriminates (without the continuity correction the pass@1 gate did far worse: 11-22%)."""
    scenarios, cells = simulated
    worst = max(float((cells[n]["single look 8"].pass_at <= 0.05 * 0.5).mean()) for n in scenarios)
    assert worst > 0.05


def test_a_clear_pass_at_1_regression_fails_by_64_items():
    """True drop 0.3 from a baseline share of 0.6: how often the default looks decide FAIL by 64 items. The issue's
    bar is 80%: with Tango's score interval 85.5% when the candidate only loses items and 62.9% when it also wins
    back 10% of the baseline's failures (measurements/2026-12-04/issue39/at-bound.json, 20,000 runs; Newcombe's
    interval gave 77% and 66%). A win-back adds discordant pairs both ways, so even one look of 64 items spending
    the whole 5% on the FAIL end decides only ~73% of those. Held here three standard errors of these 2,000 runs
    under what is measured, so a change that loses power fails."""
    out = ab.power(SIDE_SHARES["binary"][SEVERAL_LOOKS][1], RUNS, RESAMPLES, 11)
    assert out["power-back0.0"]["decided_fail_by_64"]["rate"] >= 0.82, out
    assert out["power-back0.1"]["decided_fail_by_64"]["rate"] >= 0.59, out


def test_three_candidates_on_the_bound_keep_the_family_wise_error(simulated):
    """The fallback procedure over three candidates whose truth is on the bound: any PASS is a family-wise error."""
    scenarios, _ = simulated
    for stat in ab.GATE_OF:
        sc = next(s for s in scenarios.values() if s.family == stat)
        rate = ab.family_of_three(sc, SIDE_SHARES[stat][SEVERAL_LOOKS][0], RUNS, RESAMPLES, 5)["rate"]
        assert _within(rate, 0.05, RUNS), (stat, rate)


# ---- a run folder made by older code, judged again --------------------------------------------------------------
REJUDGE_POLICY = ("version: 1\nname: t\ntasks:\n  code:\n    kld_mean: {max: 0.10}\n"
                  "    pass_at_1_drop: {max: 0.15, min_baseline_share: 0.25}\n")


def _code_record(i: int, passed: bool) -> dict:
    """One HumanEval item as the code task records it: both sides solve it (or neither), near-identical tokens."""
    nll = [0.5 + 0.01 * (i + j) for j in range(10)]
    tokens = {"tokens": 10, "nll_candidate": nll, "nll_baseline": nll, "kld": [0.001] * 10, "same_top1": [1] * 10}
    side = {"completion": "x", "finish_reason": "stop", "passed": passed}
    return {"id": f"HumanEval/{i}", "candidate": dict(side), "baseline": dict(side), "agree_exact": True,
            "solution_tokens": 10, "nll_solution_candidate": 0.5, "nll_solution_baseline": 0.5,
            "token_record": tokens}


def _old_run(folder, data: list[str] | None = None) -> None:
    """A run folder as the code before the continuity correction left it: 8 concordant items (4 solved by both)
    whose stored pass@1 interval is the collapsed [0, 0], a PASS at any drop bound."""
    folder.mkdir()
    (folder / "steps.json").write_text(json.dumps({n: {"status": "ok", "seconds": 1.0}
                                                   for n in ("quantize", "eval", "bench", "diagnose")}))
    records = {f"HumanEval/{i}": _code_record(i, i < 4) for i in range(8)}
    stale = {"pass@1": {"candidate": 0.5, "baseline": 0.5, "delta": 0.0, "ci95": [0.0, 0.0],
                        "ci_method": "Newcombe hybrid score (paired binary)", "ci_coverage": 0.983,
                        "ci_reliable": True, "items": 8},
             "text_stats": {"items": 8, "tokens": 80, "kld": {"mean_pm": [0.001, 0.0], "ci95": [0.0009, 0.0011],
                                                              "ci_method": "Student t (by item)",
                                                              "ci_coverage": 0.95, "ci_reliable": True}},
             "isolation": {"mode": "bubblewrap", "layers": ["pid namespace"], "missing": []}}
    tasks = {"code": {"key": {"settings": {}}, "records": records, "summary": stale, "items": 8}}
    (folder / "eval.json").write_text(json.dumps({"inputs": {"seed": 0}, "tasks": tasks}))
    (folder / "sequential.json").write_text(json.dumps({
        "looks": [{"items": 8, "undecided": [], "failed": [], "confidence": 0.9942}], "max_items": 64,
        "design": {"name": "old", "planned_items": [8, 16, 32, 64], "levels": [0.9942, 0.9951, 0.9921, 0.9886],
                   "alpha_spent": [0.0058, 0.0107, 0.0186, 0.03]}, "error_rate_bound": 0.05}))


def _rejudge(folder, policy, capsys, *extra: str) -> tuple[int, str]:
    from qtoolkit.cli import main
    code = main(["signoff", "--model", "default", "--recipe", "fp8-dynamic", "--policy", str(policy), "--rejudge",
                 "--output", str(folder), *extra])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def test_rejudge_rebuilds_summaries_from_records_with_the_code_now_running(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_text(REJUDGE_POLICY)
    out = tmp_path / "run"
    _old_run(out)
    code, text = _rejudge(out, policy, capsys)
    report = json.loads((out / "report.json").read_text())
    gate = {g["name"]: g for g in report["gates"]}["code.pass_at_1_drop"]
    assert gate["verdict"] != PASS and code == 3, text[-2000:]  # the stored [0, 0] said PASS
    assert report["verdict"] == "INCONCLUSIVE"
    assert "PASS end" in (out / "report.md").read_text()  # the reading states the split the verdict used


def test_rejudge_without_the_runs_data_files_refuses(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_text(REJUDGE_POLICY)
    out = tmp_path / "run"
    _old_run(out)
    ev = json.loads((out / "eval.json").read_text())
    ev["tasks"]["custom:mywork"] = {"key": {"settings": {"data_sha256": "0" * 64}}, "records": {}, "items": 0}
    (out / "eval.json").write_text(json.dumps(ev))
    before = (out / "eval.json").read_bytes()
    code, text = _rejudge(out, policy, capsys)
    assert code == 2 and "custom:mywork" in text and "--data" in text
    assert len([ln for ln in text.strip().splitlines() if ln.startswith("error")]) <= 1
    assert (out / "eval.json").read_bytes() == before  # nothing rewritten


def test_a_sweep_candidate_folder_is_not_signed_off_alone(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_text(REJUDGE_POLICY)
    sweep = tmp_path / "sweep"
    (sweep / "candidates").mkdir(parents=True)
    (sweep / "steps.json").write_text("{}")
    _old_run(sweep / "candidates" / "fp8-dynamic")
    code, text = _rejudge(sweep / "candidates" / "fp8-dynamic", policy, capsys)
    assert code == 2 and "candidate of the sweep" in text


def test_step_keys_change_with_the_code(monkeypatch, tmp_path):
    """A finished step is reused only by the same code: a different source hash (a fix) runs it again."""
    from qtoolkit.signoff import steps as steps_mod
    runner = steps_mod.StepRunner(tmp_path)
    out = tmp_path / "x.json"
    runner.run("eval", {"a": 1}, out, lambda: out.write_text("{}"))
    assert runner.finished("eval", {"a": 1}, out)
    monkeypatch.setattr(steps_mod, "code_identity", lambda: {"source_sha256": "another"})
    assert not runner.finished("eval", {"a": 1}, out)
    runner.lock.release()
