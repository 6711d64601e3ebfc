"""The sequential sign-off's overall error by simulation: how often a gate judged over the planned looks ends decisive
(PASS or FAIL) when it should not.

    python -m qtoolkit.evals.stats.coverage --sequential 8,16,32,64 \
        --output measurements/2026-12-02/issue29/sequential-coverage.json

Worst case: the true mean sits exactly on the gate's bound, so every decisive verdict is wrong (a PASS or a
FAIL is right only for a truth strictly on its side). Each simulated run draws the planned maximum of items
once and judges its prefixes at the looks, as the sign-off does (finished items are reused), each look at its
own level from the error-spending design (qtoolkit/signoff/error_spending.py), with the interval method and the
reliability the sign-off itself reads (evals/stats/paired.py: the shape refined from the sample, coverage_at; an
interval the table does not vouch for, or one with an infinite end, decides nothing). A run is wrong when any
look's interval excludes the truth: the run of one gate stops there, and a gate kept drawing by another gate of
its task can only be wrong at its final look if some look excluded the truth, so this bounds both. NO EVIDENCE
(both sides solve nothing) is not modelled: every such run is counted as judged, which only adds to the error.

Each look's interval has its PASS end and its FAIL end at their own shares of the look's error (paired.side_errors,
the split evals/stats/at_bound.py sets), and a false PASS and a false FAIL are counted apart: for any truth off the
bound only one of them can be wrong, so each held to 5% keeps a decisive gate within 5%. evals/stats/at_bound.py
measures the false PASS of every look schedule and sweep share the CLI produces; this module keeps the comparison
with the rules before.

Beside the design, the same draws are judged at 95% on every look (the rule before error spending) to show the
inflation the design removes. The throughput gate's rounds are one look at 95% (5 rounds, `qtool signoff
--rounds` default): measured in the same file for a complete picture of the gates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qtoolkit.progress import bar
from qtoolkit.signoff.error_spending import plan

from . import intervals as iv
from .coverage_scenarios import Sample, Scenario
from .paired import PASS_END, coverage_at, refine_shapes, sided_interval

MAIN_JOB_ROUNDS = 5  # qtool signoff --rounds default: the throughput gate's one look
GATE_OF = {"kld": "kld_mean (every task)", "nll": "nll_delta (every task)", "bounded": "rougeL_drop (summarization, custom)",
           "binary": "pass_at_1_drop (code, custom)", "rounds": "throughput.min_speedup"}


def _rows(s: Sample, rows: np.ndarray, n: int) -> Sample:
    """The first n items of the selected runs."""
    def cut(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[rows, :n]
    return Sample(cut(s.v), cut(s.w), cut(s.cand), cut(s.base))


def _one_method(method: str, s: Sample, counts: np.ndarray | None, level: float) -> iv.Interval:
    if method in iv.PAIRED_BINARY_METHODS:
        return iv.PAIRED_BINARY_METHODS[method](s.cand, s.base, level)
    return iv.BOOTSTRAP_METHODS[method](s.v, s.w, counts, level)


@dataclass
class LookResult:
    lo: np.ndarray
    hi: np.ndarray
    decides: np.ndarray  # [runs] bool: the interval is vouched for and finite, so the gate may be decisive
    methods: dict[str, float]  # share of runs judged by each method


def judge_look(family: str, s: Sample, n: int, level: float, counts: np.ndarray, sided: int = 1) -> LookResult:
    """Every run's interval at one look, by the method the sign-off picks for that run's sample; `sided`: each
    end at its own side's share of the look's error 1 - level in a design of `sided` looks, as a sign-off's look
    computes it (paired.py); 0: one two-sided interval at `level`."""
    runs = s.v.shape[0]
    shapes = np.full(runs, "binary", dtype=object) if family == "binary" else refine_shapes(family, s.v[:, :n])
    lo, hi = np.full(runs, np.nan), np.full(runs, np.nan)
    decides = np.zeros(runs, dtype=bool)
    methods: dict[str, float] = {}
    for shape in sorted(set(shapes)):
        rows = np.flatnonzero(shapes == shape)
        method, _, reliable = coverage_at(shape, n)
        sub = _rows(s, rows, n)

        def at(c: float, method: str = method, sub: Sample = sub) -> iv.Interval:
            return _one_method(method, sub, counts, c)

        a, b = sided_interval(at, shape, level, sided) if sided and shape in PASS_END else at(level)
        finite = np.isfinite(a) & np.isfinite(b)
        lo[rows], hi[rows] = a, b
        decides[rows] = reliable & finite  # mean_ci: an infinite bootstrap-t end falls back to an unvouched t
        methods[f"{shape}:{method}"] = round(rows.size / runs, 4)
    return LookResult(lo, hi, decides, methods)


def simulate(scenario: Scenario, looks: Sequence[int], levels: Sequence[float], runs: int, resamples: int,
             seed: int, draws: Sample | None = None, sided: bool = True) -> dict[str, Any]:
    """Wrong decisive verdicts of one gate statistic over the looks, the truth on the bound: a false PASS (the
    PASS end on the passing side of the truth) and a false FAIL (the FAIL end beyond it) counted apart."""
    truth = scenario.truth()
    if draws is None:
        rng = np.random.default_rng([seed, looks[-1], sum(map(ord, scenario.name)), 29])
        draws = scenario.draw(rng, runs, looks[-1])
    upper = bool(PASS_END.get(scenario.family, 0))  # rounds: a minimum speedup, its PASS end the lower one
    false_pass = np.zeros(runs, dtype=bool)
    false_fail = np.zeros(runs, dtype=bool)
    per_look: dict[str, Any] = {}
    for n, level in zip(looks, levels, strict=True):
        counts = iv.resample_counts(n, resamples, seed + n)
        r = judge_look(scenario.family, draws, n, level, counts, len(looks) if sided else 0)
        p = r.decides & ((r.hi < truth) if upper else (r.lo > truth))
        f = r.decides & ((r.lo > truth) if upper else (r.hi < truth))
        first = (p | f) & ~(false_pass | false_fail)
        per_look[str(n)] = {"level": round(level, 6), "decided_here": float(first.mean()),
                            "miss_this_look": float((p | f).mean()), "vouched": float(r.decides.mean()),
                            "methods": r.methods}
        false_pass |= p
        false_fail |= f
    wrong = false_pass | false_fail
    return {"wrong_decisive": float(wrong.mean()), "se": _se(wrong), "false_pass": float(false_pass.mean()),
            "false_pass_se": _se(false_pass), "false_fail": float(false_fail.mean()), "false_fail_se": _se(false_fail),
            "looks": per_look}


def _se(x: np.ndarray) -> float:
    p = float(x.mean())
    return math.sqrt(max(p * (1 - p), 1e-12) / x.size)


def measure(scenario: Scenario, looks: Sequence[int], runs: int, resamples: int, seed: int) -> dict[str, Any]:
    """The design and, on the same draws, the rules it is compared with: 95% at every look (the rule before error
    spending) and the same Pocock-type spending of the full 5% nominal (which the KLD gate's intervals overrun)."""
    if scenario.family == "rounds":
        looks = (MAIN_JOB_ROUNDS,)
    design = plan(looks)
    rng = np.random.default_rng([seed, looks[-1], sum(map(ord, scenario.name)), 29])
    draws = scenario.draw(rng, runs, looks[-1])
    out = simulate(scenario, looks, design.levels, runs, resamples, seed, draws)
    compared = {}
    if len(looks) > 1:
        for name, levels in (("every_look_at_95", [0.95] * len(looks)), ("spend_3_percent", plan(looks, 0.03).levels)):
            r = simulate(scenario, looks, levels, runs, resamples, seed, draws, sided=False)
            compared[name] = {"wrong_decisive": r["wrong_decisive"], "se": r["se"], "false_pass": r["false_pass"]}
    return {"statistic": scenario.family, "gate": GATE_OF[scenario.family], "shape": scenario.shape,
            "kind": scenario.kind, "params": scenario.params, "truth": scenario.truth(), "looks": list(looks),
            "design": design.describe(), "nominal_spent": design.alpha, "sequential": out, "compared": compared}


def summarize(results: dict[str, dict[str, Any]], alpha: float, tolerance: float) -> dict[str, Any]:
    """Per gate statistic: the worst calibrated scenario's false PASS and false FAIL, each within the bar (at most
    one of them can be wrong for any truth off the bound, so each held to alpha keeps a decisive gate within it)."""
    out: dict[str, Any] = {}
    for stat in dict.fromkeys(r["statistic"] for r in results.values()):
        rows = {k: r for k, r in results.items() if r["statistic"] == stat}
        calibrated = {k: r for k, r in rows.items() if r["kind"] == "calibrated"} or rows
        worst = max(calibrated, key=lambda k: max(rows[k]["sequential"]["false_pass"],
                                                  rows[k]["sequential"]["false_fail"]))
        seq = rows[worst]["sequential"]
        out[stat] = {"gate": GATE_OF[stat], "worst_calibrated_scenario": worst, "false_pass": seq["false_pass"],
                     "false_fail": seq["false_fail"], "wrong_decisive": seq["wrong_decisive"], "se": seq["se"],
                     "compared": {k: v["wrong_decisive"] for k, v in rows[worst]["compared"].items()},
                     "within_bar": max(seq["false_pass"], seq["false_fail"]) <= alpha + tolerance,
                     "stress": {k: r["sequential"]["false_pass"] for k, r in rows.items() if r["kind"] == "stress"}}
    return out


def run(scenarios: Iterable[Scenario], looks: Sequence[int], runs: int, resamples: int, seed: int
        ) -> dict[str, dict[str, Any]]:
    return {s.name: measure(s, looks, runs, resamples, seed) for s in bar(list(scenarios), desc="sequential",
                                                                            unit="scenario")}


def tolerance(alpha: float, runs: int) -> float:
    """Two Monte Carlo standard errors of an error rate of alpha over `runs` runs (0.0069 at 4,000)."""
    return 2 * math.sqrt(alpha * (1 - alpha) / runs)
