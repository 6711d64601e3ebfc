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
from .paired import coverage_at, refine_shapes

MAIN_JOB_ROUNDS = 5  # qtool signoff --rounds default: the throughput gate's one look
GATE_OF = {"kld": "kld_mean (every task)", "nll": "nll_delta (every task)", "bounded": "rougeL_drop (summarization, custom)",
           "binary": "pass_at_1_drop (code, custom)", "rounds": "throughput.min_speedup"}


def _rows(s: Sample, rows: np.ndarray, n: int) -> Sample:
    """The first n items of the selected runs."""
    def cut(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[rows, :n]
    return Sample(cut(s.v), cut(s.w), cut(s.cand), cut(s.base))


def _one_method(method: str, s: Sample, counts: np.ndarray | None, level: float) -> iv.Interval:
    if method == "newcombe":
        return iv.newcombe_paired(s.cand, s.base, level)
    return iv.BOOTSTRAP_METHODS[method](s.v, s.w, counts, level)


@dataclass
class LookResult:
    lo: np.ndarray
    hi: np.ndarray
    decides: np.ndarray  # [runs] bool: the interval is vouched for and finite, so the gate may be decisive
    methods: dict[str, float]  # share of runs judged by each method


def judge_look(family: str, s: Sample, n: int, level: float, counts: np.ndarray) -> LookResult:
    """Every run's interval at one look, by the method the sign-off picks for that run's sample."""
    runs = s.v.shape[0]
    shapes = np.full(runs, "binary", dtype=object) if family == "binary" else refine_shapes(family, s.v[:, :n])
    lo, hi = np.full(runs, np.nan), np.full(runs, np.nan)
    decides = np.zeros(runs, dtype=bool)
    methods: dict[str, float] = {}
    for shape in sorted(set(shapes)):
        rows = np.flatnonzero(shapes == shape)
        method, _, reliable = coverage_at(shape, n)
        method = "newcombe" if shape == "binary" else method
        a, b = _one_method(method, _rows(s, rows, n), counts, level)
        finite = np.isfinite(a) & np.isfinite(b)
        lo[rows], hi[rows] = a, b
        decides[rows] = reliable & finite  # mean_ci: an infinite bootstrap-t end falls back to an unvouched t
        methods[f"{shape}:{method}"] = round(rows.size / runs, 4)
    return LookResult(lo, hi, decides, methods)


def simulate(scenario: Scenario, looks: Sequence[int], levels: Sequence[float], runs: int, resamples: int,
             seed: int, draws: Sample | None = None) -> dict[str, Any]:
    """Wrong decisive verdicts of one gate statistic over the looks, the truth on the bound."""
    truth = scenario.truth()
    if draws is None:
        rng = np.random.default_rng([seed, looks[-1], sum(map(ord, scenario.name)), 29])
        draws = scenario.draw(rng, runs, looks[-1])
    wrong = np.zeros(runs, dtype=bool)
    below = np.zeros(runs, dtype=bool)  # the first decisive interval lies wholly below the truth
    per_look: dict[str, Any] = {}
    for n, level in zip(looks, levels, strict=True):
        counts = iv.resample_counts(n, resamples, seed + n)
        r = judge_look(scenario.family, draws, n, level, counts)
        excl = r.decides & ((r.lo > truth) | (r.hi < truth))
        first = excl & ~wrong
        below |= first & (r.hi < truth)
        per_look[str(n)] = {"level": round(level, 6), "decided_here": float(first.mean()),
                            "miss_this_look": float(excl.mean()), "vouched": float(r.decides.mean()),
                            "methods": r.methods}
        wrong |= excl
    p = float(wrong.mean())
    return {"wrong_decisive": p, "se": math.sqrt(max(p * (1 - p), 1e-12) / runs),
            "wrong_interval_below_truth": float(below.mean()), "wrong_interval_above_truth": float((wrong & ~below).mean()),
            "looks": per_look}


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
        for name, levels in (("every_look_at_95", [0.95] * len(looks)), ("spend_5_percent", plan(looks, 0.05).levels)):
            r = simulate(scenario, looks, levels, runs, resamples, seed, draws)
            compared[name] = {"wrong_decisive": r["wrong_decisive"], "se": r["se"]}
    return {"statistic": scenario.family, "gate": GATE_OF[scenario.family], "shape": scenario.shape,
            "kind": scenario.kind, "params": scenario.params, "truth": scenario.truth(), "looks": list(looks),
            "design": design.describe(), "nominal_spent": design.alpha, "sequential": out, "compared": compared}


def summarize(results: dict[str, dict[str, Any]], alpha: float, tolerance: float) -> dict[str, Any]:
    """Per gate statistic: the worst calibrated scenario's overall error, and whether it is within the bar."""
    out: dict[str, Any] = {}
    for stat in dict.fromkeys(r["statistic"] for r in results.values()):
        rows = {k: r for k, r in results.items() if r["statistic"] == stat}
        calibrated = {k: r for k, r in rows.items() if r["kind"] == "calibrated"}
        worst = max(calibrated or rows, key=lambda k: rows[k]["sequential"]["wrong_decisive"])
        err = rows[worst]["sequential"]["wrong_decisive"]
        out[stat] = {"gate": GATE_OF[stat], "worst_calibrated_scenario": worst, "wrong_decisive": err,
                     "se": rows[worst]["sequential"]["se"],
                     "compared": {k: v["wrong_decisive"] for k, v in rows[worst]["compared"].items()},
                     "within_bar": err <= alpha + tolerance,
                     "stress": {k: r["sequential"]["wrong_decisive"] for k, r in rows.items() if r["kind"] == "stress"}}
    return out


def run(scenarios: Iterable[Scenario], looks: Sequence[int], runs: int, resamples: int, seed: int
        ) -> dict[str, dict[str, Any]]:
    return {s.name: measure(s, looks, runs, resamples, seed) for s in bar(list(scenarios), desc="sequential",
                                                                            unit="scenario")}


def tolerance(alpha: float, runs: int) -> float:
    """Two Monte Carlo standard errors of an error rate of alpha over `runs` runs (0.0069 at 4,000)."""
    return 2 * math.sqrt(alpha * (1 - alpha) / runs)
