"""Three verdicts per gate and one overall verdict, each with what the sample size could have detected.

A gate compares an interval with its bound. PASS: the end worst for the candidate is within the bound. FAIL:
even the end best for the candidate is beyond it. INCONCLUSIVE: the interval straddles the bound, or the
interval method does not hold its coverage at this many items (stats' `ci_reliable` is False). NO EVIDENCE:
the metric cannot discriminate on this model (both sides solve none of the items, or the baseline solves
less than the share the policy asks for the gate); it is never counted as PASS, and it counts as
INCONCLUSIVE unless the policy made the gate conditional on that share.

Overall: FAIL if any gate fails, else INCONCLUSIVE if any required gate is inconclusive or without evidence,
else PASS; ERROR when a step failed. Exit codes: 0 PASS, 1 FAIL, 2 ERROR, 3 INCONCLUSIVE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..evals.summary import Figure, PairedDelta
from .error_spending import ALPHA, SequentialRecord

if TYPE_CHECKING:  # `qtool --help` reads EXIT_CODES from here and must not import torch (evals.results does)
    from ..evals.results import EvalResults

PASS, FAIL, INCONCLUSIVE, NO_EVIDENCE = "PASS", "FAIL", "INCONCLUSIVE", "NO EVIDENCE"
# ERROR is an overall verdict only: a step did not finish, so no gate could judge the candidate
ERROR = "ERROR"
EXIT_CODES = {PASS: 0, FAIL: 1, ERROR: 2, INCONCLUSIVE: 3}


@dataclass
class Judgement:
    verdict: str
    detail: str
    resolution: str = ""  # the smallest violation this gate could detect at the sample size used
    required: bool = True
    ci_method: str | None = None
    ci_coverage: float | None = None  # the method's simulated coverage at this sample size (evals/stats/coverage.py)


def _fmt(v: float) -> str:
    return f"{v + 0.0:.4g}"


def judge_interval(point: float | None, lo: float | None, hi: float | None, *, max_: float | None,
                   min_: float | None, n_text: str = "") -> Judgement:
    """PASS / FAIL / INCONCLUSIVE of an interval [lo, hi] (already signed so a bound reads naturally)."""
    if point is None or not math.isfinite(point):
        return Judgement(NO_EVIDENCE, "not measured" if point is None else f"the point estimate is {point}")
    if lo is not None and hi is not None and not (math.isfinite(lo) and math.isfinite(hi)):
        # a NaN end compares False with every bound (and sorts anywhere), an infinite one bounds nothing: such an
        # interval can fail a gate only through its finite end, and never pass one
        return _unbounded(point, lo, hi, max_=max_, min_=min_)
    if lo is None or hi is None:
        lo = hi = point
        resolution = "judged on a point, no interval"
    elif hi == lo:  # every item gave the same delta: the bootstrap cannot bound the noise
        resolution = f"zero-width interval{n_text.replace(',', ':', 1)}: no resolution can be stated"
    else:
        resolution = f"detects a violation larger than {_fmt((hi - lo) / 2)} (CI half-width{n_text})"
    worst, best = (hi, lo) if max_ is not None else (lo, hi)
    if max_ is not None:
        if worst <= max_:
            return Judgement(PASS, f"{_fmt(worst)} within max {max_:g}", resolution)
        if best > max_:
            return Judgement(FAIL, f"{_fmt(best)} > max {max_:g} (the whole interval)", resolution)
        return Judgement(INCONCLUSIVE, f"[{_fmt(lo)}, {_fmt(hi)}] straddles max {max_:g}", resolution)
    assert min_ is not None
    if worst >= min_:
        return Judgement(PASS, f"{_fmt(worst)} within min {min_:g}", resolution)
    if best < min_:
        return Judgement(FAIL, f"{_fmt(best)} < min {min_:g} (the whole interval)", resolution)
    return Judgement(INCONCLUSIVE, f"[{_fmt(lo)}, {_fmt(hi)}] straddles min {min_:g}", resolution)


def _unbounded(point: float, lo: float, hi: float, *, max_: float | None, min_: float | None) -> Judgement:
    """An interval with a NaN or infinite end: FAIL when its finite best end is beyond the bound, else
    INCONCLUSIVE; never PASS."""
    best = lo if max_ is not None else hi
    text = f"[{lo}, {hi}] has no finite {'upper' if max_ is not None else 'lower'} end"
    if math.isfinite(best) and ((max_ is not None and best > max_) or (min_ is not None and best < min_)):
        return Judgement(FAIL, f"{_fmt(best)} beyond the bound ({text})", "no resolution: an end is not finite")
    return Judgement(INCONCLUSIVE, text, "no resolution: an end is not finite")


def no_evidence(fig: Figure | float | None, min_share: float | None) -> str | None:
    """Why a pass-rate delta carries no evidence on this model, or None when it does."""
    if not isinstance(fig, PairedDelta) or fig.baseline is None:
        return None
    base, cand, n = fig.baseline, fig.candidate, "?" if fig.items is None else fig.items
    if min_share is not None and base < min_share:
        return f"the baseline solves {base:.0%} of {n} items, under the {min_share:.0%} the policy asks for this gate"
    if base == 0 and cand == 0:
        return f"both models solve none of the {n} items"
    return None


def judge_quality(fig: Figure | float | None, sign: float, point_only: bool, *, max_: float | None,
                  min_: float | None, min_share: float | None = None, required: bool = True) -> Judgement:
    """One quality gate from its figure (a paired delta, a token statistic, a rate or a plain number)."""
    if fig is None:
        return Judgement(NO_EVIDENCE, "not measured", required=required)
    if isinstance(fig, (int, float)):
        return judge_interval(sign * fig, None, None, max_=max_, min_=min_)
    why = no_evidence(fig, min_share)
    if why is not None:
        # conditional on a share: not required below it; otherwise it cannot be passed without evidence
        return Judgement(NO_EVIDENCE, why, "no evidence at this sample", required and min_share is None)
    point = fig.point
    lo = hi = None
    if not point_only and fig.ci.complete:
        a, b = sign * fig.ci.bounds[0], sign * fig.ci.bounds[1]
        lo, hi = (a, b) if a <= b or math.isnan(a) or math.isnan(b) else (b, a)  # sorted() misplaces a NaN
    items = fig.items
    j = judge_interval(None if point is None else sign * point, lo, hi, max_=max_, min_=min_,
                       n_text=f", {items} items" if items else "")
    return with_interval_method(j, fig.ci.method, fig.ci.coverage, fig.ci.reliable, "items")


def with_interval_method(j: Judgement, method: str | None, coverage: float | None, reliable: bool | None,
                         unit: str) -> Judgement:
    """Name the interval's method and simulated coverage; an interval whose method does not hold its coverage
    at this sample size (`reliable` False) decides nothing: INCONCLUSIVE, never PASS."""
    j.ci_method, j.ci_coverage = method, coverage
    if reliable is False and j.verdict != NO_EVIDENCE:
        j.verdict, j.detail = INCONCLUSIVE, f"too few {unit} for a reliable interval ({j.detail})"
    return j


def overall(verdicts: list[tuple[str, bool]]) -> str:
    """(verdict, required) per gate -> the release verdict."""
    if any(v == FAIL for v, _ in verdicts):
        return FAIL
    if not verdicts or any(v in (INCONCLUSIVE, NO_EVIDENCE) and req for v, req in verdicts):
        return INCONCLUSIVE
    return PASS


RULE = ("Each gate is judged on its interval. A quality gate's two ends are computed apart, each at its own share of "
        "the look's error (below): PASS when the end worst for the candidate is within the bound, FAIL when the end "
        "best for it is beyond the bound (the whole interval), INCONCLUSIVE when the interval straddles the bound "
        "or the interval method is unreliable at this many items; NO EVIDENCE when the metric cannot discriminate "
        "on this model (never a PASS). Overall: FAIL if any gate fails, else INCONCLUSIVE if a required gate is "
        "inconclusive or without evidence, else PASS; ERROR when a step failed. Exit codes: 0 PASS, 1 FAIL, "
        "2 ERROR, 3 INCONCLUSIVE.")


AT_BOUND = "measurements/2026-12-04/issue39/at-bound.json"  # the simulation the split below rests on


def side_split() -> str:
    """The shipped split of a look's error between each gate statistic's PASS end and FAIL end, in words."""
    from ..evals.stats.at_bound_table import (
        SIDE_SHARES,  # numpy-free, but kept out of `qtool --help`'s imports
    )
    names = {"kld": "KLD", "nll": "NLL", "bounded": "ROUGE-L", "binary": "pass@1"}
    return "; ".join(f"{names.get(k, k)} " + ", ".join(f"{p:.0%}/{f:.0%} ({s})" for s, (p, f) in v.items())
                     for k, v in SIDE_SHARES.items())


def error_statement(sequential: SequentialRecord) -> str:
    """The overall error of a decisive quality gate over its looks (sequential.json's design)."""
    design = sequential.design
    if design is None:  # written before error spending: every look judged a 95% interval
        k = len(sequential.looks)
        return (f"With {k} look(s) at 95% each, a decisive gate is wrong with probability at most K x 5% = "
                f"{0.05 * k:.0%}.")
    k = len(design.planned_items)
    looks = ", ".join(f"{n} items {1 - c:.2%}" for n, c in zip(design.planned_items, design.levels, strict=True))
    split = (f"Each look's error is split between a gate's PASS end and its FAIL end (shares of the look's error, "
             f"PASS/FAIL: {side_split()}), set by simulating every gate statistic with the truth exactly on the "
             f"policy's bound so that a false PASS stays within 5% for every look schedule and a sweep's candidate "
             f"within its share ({AT_BOUND}; qtoolkit/signoff/error_spending.py says why).")
    if k == 1:
        return f"One look ({looks} error): a PASS is wrong with probability at most 5%, and so is a FAIL. " + split
    bound = sequential.error_rate_bound or ALPHA  # a design's file states it: the 5% its looks share
    return (f"A decisive gate is wrong with probability at most {bound:.0%} over its {k} "
            f"looks, Lan-DeMets Pocock-type alpha spending (error per look: {looks}). " + split)


def reading(gates: list[Any], evals: EvalResults | None, sequential: SequentialRecord | None) -> list[str]:
    """Sentences that tell a reader what the verdict rests on (gates are signoff.judge.Gate objects)."""
    notes = [RULE]
    for g in gates:
        if g.verdict == NO_EVIDENCE and not g.required:
            task = g.task
            rest = [x.name for x in gates if x.task == task and x.verdict != NO_EVIDENCE]
            on = " and ".join(rest) if rest else "no other gate"
            notes.append(f"{g.name} carries no evidence here ({g.detail}), so it is shown but not counted: "
                         f"{task} quality on this model rests on {on}.")
    if sequential:
        looks, budget = sequential.looks, sequential.max_items
        sizes = " -> ".join(str(x.items) for x in looks)
        notes.append(f"Sample size: {sizes} items over {len(looks)} look(s) (budget --max-items {budget}). While "
                     "a required quality gate is inconclusive and none has failed, the items of the undecided "
                     "tasks double up to the budget, reusing finished ones. " + error_statement(sequential))
    code = None if evals is None else evals.summary("code")
    iso = None if code is None else code.get("isolation")
    if iso:
        weak = f" WEAK, opted out with --allow-weak-sandbox (missing: {'; '.join(iso['missing'])})" \
            if iso["mode"] != "bubblewrap" else ""
        notes.append(f"Model-written code ran under {iso['mode']}{weak}: {', '.join(iso['layers'])}.")
    return notes
