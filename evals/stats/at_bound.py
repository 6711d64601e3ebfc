"""Every quality gate's false PASS rate with the truth exactly on the policy's bound, by simulation.

    python -m qtoolkit.evals.stats.at_bound --output measurements/2026-12-04/issue39/at-bound.json \
        --table evals/stats/at_bound_table.py

A gate is worth what it does where a real regression sits: on its bound. There every PASS is wrong (the truth is
not strictly within the bound) and so is every FAIL (the truth is not strictly beyond it), so one simulation
measures both errors. For each gate statistic (kld_mean, nll_delta, rougeL_drop, pass_at_1_drop) it draws samples
whose population value is the default policy's bound (recipes/policies/default.yaml) in the shapes the
calibrated coverage scenarios use (evals/stats/coverage.py), and judges them with the sign-off's own code: the
interval method and reliability evals/stats/paired.py picks for each sample, each end at its side's level
(`paired.side_errors`), over the looks of each design the CLI produces:

- default: --limit 8 doubling to --max-items 64 (8, 16, 32, 64), Pocock-type spending of 5%;
- single look: --max-items equal to --limit (8, 16, 32 or 64 items, one look at 5%);
- a sweep's per-candidate share: 5% / m for m = 2, 3, 5 candidates, on the default design and on one look of 8;
- a family of three candidates on the bound, the fallback procedure of qtoolkit/signoff/family.py.

A run is counted a false PASS when any look's interval puts its PASS end within the bound while the method is
vouched for (reliable at that n, finite ends): the gate may be re-judged at later looks while another gate of its
task is undecided, so "any look" bounds every stopping rule. False FAILs are counted the same way on the other
end. `--table` writes, per statistic and schedule (one look, several looks), the largest share of a look's error
each end may spend such that every cell's false PASS (false FAIL) stays within its target: 5% for a sign-off, the share for a sweep's
candidate. The power check draws a clear pass@1 regression (drop 0.3 from a baseline share of 0.6) and counts
how often the default design decides FAIL by 64 items.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import t as student_t

from qtoolkit.progress import bar
from qtoolkit.signoff.error_spending import plan

from . import intervals as iv
from .at_bound_table import ONE_LOOK, SEVERAL_LOOKS
from .coverage_scenarios import Sample, Scenario, _rouge_pairs
from .paired import N_RESAMPLES, PASS_END, coverage_at, refine_shapes

ALPHA = 0.05  # the sign-off's claim: a decisive gate is wrong with probability at most 5%
DEFAULT_LOOKS = (8, 16, 32, 64)  # qtool signoff's --limit 8, --max-items 64
MAX_SHARE = 5.0  # no end spends more than 5x its look's nominal error, whatever the simulation allows
BOUNDS = {"kld": 0.10, "nll": 0.10, "bounded": 0.05, "binary": 0.15}  # recipes/policies/default.yaml
GATE_OF = {"kld": "kld_mean", "nll": "nll_delta", "bounded": "rougeL_drop", "binary": "pass_at_1_drop"}


def _solve_rouge_shift(target: float, **p: Any) -> float:
    """The early-divergence shift that puts the population ROUGE-L delta at `target` (bisection)."""
    lo, hi = -0.6, 0.0
    rng_seed = 12345
    for _ in range(30):
        mid = (lo + hi) / 2
        cand, base = _rouge_pairs(np.random.default_rng(rng_seed), (1_000_000,), **{**p, "shift": mid})
        if float(np.mean(cand - base)) > target:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def _binary(name: str, p_base: float, flip_fail: float, drop: float) -> Scenario:
    """Pass/fail pairs whose true drop (baseline - candidate pass rate) is `drop`."""
    flip_pass = (drop + (1 - p_base) * flip_fail) / p_base
    return Scenario(name, "binary", "calibrated", {"p_base": p_base, "flip_pass": flip_pass, "flip_fail": flip_fail})


def scenarios() -> list[Scenario]:
    """The calibrated coverage scenarios moved onto the default policy's bounds."""
    kld = [(0.15, 1.0, (90, 300)), (0.3, 1.0, (90, 300)), (0.5, 1.5, (40, 300)), (1.0, 2.0, (40, 300))]
    out = [Scenario(f"kld-sigma{s}", "kld", "calibrated",
                    {"mean": BOUNDS["kld"], "item_sigma": s, "token_sigma": t, "tokens": tok}) for s, t, tok in kld]
    out += [Scenario("nll-code", "nll", "calibrated", {"mean": BOUNDS["nll"], "item_sd": 0.02, "item_skew": 0.5,
                                                      "token_sd": 0.3, "tokens": (9, 110)}),
            Scenario("nll-summaries", "nll", "calibrated", {"mean": BOUNDS["nll"], "item_sd": 0.02,
                                                           "item_skew": 0.0, "token_sd": 0.2, "tokens": (20, 40)}),
            Scenario("nll-wide", "nll", "calibrated", {"mean": BOUNDS["nll"], "item_sd": 0.08, "item_skew": 0.5,
                                                      "token_sd": 0.5, "tokens": (9, 110)})]
    rouge = [("rouge-none-identical", 0.0, 0.5, 0.12), ("rouge-some-identical", 0.3, 0.0, 0.12),
             ("rouge-mostly-identical", 0.6, 0.0, 0.12), ("rouge-nearly-all-identical", 0.85, 0.0, 0.1)]
    for name, same, near, sd in rouge:
        p = {"a": 2.0, "b": 7.0, "same": same, "near": near, "sd": sd}
        shape = "bounded-sparse" if same >= 0.5 else "bounded"  # as coverage.py's scenarios are grouped
        out.append(Scenario(name, shape, "calibrated", {**p, "shift": _solve_rouge_shift(-BOUNDS["bounded"], **p)}))
    for p_base in (0.25, 0.5, 0.8):
        for flip_fail in (0.0, 0.1):
            out.append(_binary(f"pass-base{p_base}-back{flip_fail}", p_base, flip_fail, BOUNDS["binary"]))
    return out


@dataclass(frozen=True)
class Design:
    """A look schedule and the error it spends (5%, or a sweep candidate's share)."""

    name: str
    looks: tuple[int, ...]
    alpha: float = ALPHA

    @property
    def errors(self) -> list[float]:
        return list(plan(self.looks, self.alpha).look_alphas)


def designs() -> list[Design]:
    out = [Design("default 8->64", DEFAULT_LOOKS)]
    out += [Design(f"single look {n}", (n,)) for n in DEFAULT_LOOKS]
    for m in (2, 3, 5):
        out += [Design(f"sweep of {m}: default 8->64", DEFAULT_LOOKS, ALPHA / m),
                Design(f"sweep of {m}: single look 8", (8,), ALPHA / m)]
    return out


def _cut(s: Sample, rows: np.ndarray, n: int) -> Sample:
    def c(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[rows, :n]
    return Sample(c(s.v), c(s.w), c(s.cand), c(s.base))


def _bisect(end: Callable[[np.ndarray], np.ndarray], reached: Callable[[np.ndarray], np.ndarray],
            runs: int) -> np.ndarray:
    """Per run, the smallest one-sided error (log-bisection over [1e-7, 0.5]) at which `reached(end(error))`
    holds; inf where it never does. `end` takes one error per run; the end moves monotonically with the error
    (the interval narrows as the error grows)."""
    never = ~reached(end(np.full(runs, 0.5)))
    always = reached(end(np.full(runs, 1e-7)))
    a, b = np.full(runs, np.log(1e-7)), np.full(runs, np.log(0.5))
    for _ in range(30):
        mid = (a + b) / 2
        ok = reached(end(np.exp(mid)))
        b, a = np.where(ok, mid, b), np.where(ok, a, mid)
    return np.where(never, np.inf, np.where(always, 0.0, np.exp(b)))


@dataclass
class Critical:
    """Per run at one look: the smallest one-sided error at which the upper end falls to the bound or below
    (`hi_below`) and at which the lower end rises to it or above (`lo_above`); `decides`: the sign-off lets this
    look decide (the method is reliable at n)."""

    hi_below: np.ndarray
    lo_above: np.ndarray
    decides: np.ndarray


def critical(family: str, s: Sample, n: int, counts: np.ndarray, bound: float) -> Critical:
    """The critical errors of every run at one look, by the method paired.py picks for each sample's shape."""
    runs = s.v.shape[0]
    shapes = np.full(runs, "binary", dtype=object) if family == "binary" else refine_shapes(family, s.v[:, :n])
    hb, la = np.full(runs, np.inf), np.full(runs, np.inf)
    decides = np.zeros(runs, dtype=bool)
    for shape in sorted(set(shapes)):
        rows = np.flatnonzero(shapes == shape)
        method, _, reliable = coverage_at(shape, n)
        sub = _cut(s, rows, n)
        decides[rows] = reliable
        hb[rows], la[rows] = _critical_of(family, method, sub, counts, bound)
    return Critical(hb, la, decides)


def _critical_of(family: str, method: str, s: Sample, counts: np.ndarray, b: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    if method == "tango":  # its score statistic falls with the tested difference: the critical errors in closed form
        return iv.tango_critical(s.cand, s.base, b)
    if family == "binary":
        def end(i: int) -> Callable[[np.ndarray], np.ndarray]:
            return lambda e: iv.PAIRED_BINARY_METHODS[method](s.cand, s.base, 1 - 2 * e)[i]
        runs = s.cand.shape[0]
        return _bisect(end(1), lambda x: x <= b, runs), _bisect(end(0), lambda x: x >= b, runs)
    if method == "t":
        m, se = iv.point_and_se(s.v, s.w)
        df = max(s.v.shape[1] - 1, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            hb = np.where(se > 0, student_t.sf((b - m) / se, df), np.where(m <= b, 0.0, np.inf))
            la = np.where(se > 0, student_t.sf((m - b) / se, df), np.where(m >= b, 0.0, np.inf))
        return hb, la
    if method == "studentized":
        # hi(e) = m - q_e(t*) se <= b  <=>  the ceil(e B)-th smallest t* >= c = (m - b) / se  <=>  e > #{t* < c} / B;
        # lo(e) = m - q_{1-e}(t*) se >= b  <=>  e >= 1 - #{t* <= c} / B (order statistics, as studentized() takes)
        m, se, t = iv.studentized_parts(s.v, s.w, counts)
        big_b = t.shape[1]
        with np.errstate(divide="ignore", invalid="ignore"):
            c = np.where(se > 0, (m - b) / se, 0.0)[:, None]
        below = (t < c).sum(1) / big_b
        at_most = (t <= c).sum(1) / big_b
        hb = np.where(se > 0, below + 0.5 / big_b, np.where(m <= b, 0.0, np.inf))
        la = np.where(se > 0, 1 - at_most, np.where(m >= b, 0.0, np.inf))
        return hb, la
    if method == "bca":
        parts = iv.bca_parts(s.v, s.w, counts)

        def bca_end(i: int) -> Callable[[np.ndarray], np.ndarray]:
            return lambda e: iv.bca_from_parts(parts, 1 - 2 * e)[i]
        runs = s.v.shape[0]
        return _bisect(bca_end(1), lambda x: x <= b, runs), _bisect(bca_end(0), lambda x: x >= b, runs)
    raise ValueError(f"no critical-error rule for interval method {method!r}")


@dataclass
class Cell:
    """Per run, the smallest total error a design must spend for a PASS (or a FAIL) at some look."""

    pass_at: np.ndarray
    fail_at: np.ndarray


def per_run(sc: Scenario, crit: dict[int, Critical], looks: Sequence[int], bound_is_upper: bool) -> Cell:
    """A design spends error e_k = total x w_k at look k (Pocock weights): a run PASSes at some look when
    total >= crit_k / w_k there, so its critical total is the minimum over the looks that may decide."""
    weights = [e / ALPHA for e in plan(looks, ALPHA).look_alphas]
    pass_at = np.full(crit[looks[0]].decides.shape, np.inf)
    fail_at = pass_at.copy()
    for n, wk in zip(looks, weights, strict=True):
        c = crit[n]
        p_crit, f_crit = (c.hi_below, c.lo_above) if bound_is_upper else (c.lo_above, c.hi_below)
        pass_at = np.minimum(pass_at, np.where(c.decides, p_crit / wk, np.inf))
        fail_at = np.minimum(fail_at, np.where(c.decides, f_crit / wk, np.inf))
    return Cell(pass_at, fail_at)


def _rate(x: np.ndarray) -> dict[str, float]:
    p = float(x.mean())
    return {"rate": round(p, 5), "se": round(math.sqrt(max(p * (1 - p), 1e-12) / x.size), 5)}


def draw(sc: Scenario, runs: int, n: int, seed: int) -> Sample:
    return sc.draw(np.random.default_rng([seed, n, sum(map(ord, sc.name)), 39]), runs, n)


def criticals(sc: Scenario, draws: Sample, resamples: int, seed: int, bound: float) -> dict[int, Critical]:
    return {n: critical(sc.family, draws, n, iv.resample_counts(n, resamples, seed + n), bound)
            for n in DEFAULT_LOOKS}


def max_share(at: np.ndarray, alpha: float) -> float:
    """The largest share s of `alpha` one end may spend with mean(at <= alpha s) at most the target less two
    Monte Carlo standard errors: the shares are chosen on these draws, so a margin keeps a fresh simulation
    (tests/test_at_bound.py) within the target too."""
    srt = np.sort(at)
    margin = 2 * math.sqrt(alpha * (1 - alpha) / at.size)
    k = int(math.floor((alpha - margin) * at.size))  # at most k runs may fall at or under the spend
    if k >= at.size:
        return float("inf")
    return float(srt[k] / alpha) * (1 - 1e-9)


def simulate(runs: int, resamples: int, seed: int) -> tuple[dict[str, Any], dict[str, dict[str, Cell]]]:
    """Every scenario x design: each end's largest share with the error within target, with the truth on the
    bound; the per-run critical totals are kept for the tables built from them."""
    out: dict[str, Any] = {}
    cells: dict[str, dict[str, Cell]] = {}
    for sc in bar(scenarios(), desc="at the bound", unit="scenario"):
        draws = draw(sc, runs, DEFAULT_LOOKS[-1], seed)
        crit = criticals(sc, draws, resamples, seed, sc.truth())
        upper = bool(PASS_END[sc.family])
        rows: dict[str, Any] = {}
        cells[sc.name] = {}
        for d in designs():
            cell = per_run(sc, crit, d.looks, upper)
            cells[sc.name][d.name] = cell
            rows[d.name] = {"target": d.alpha, "max_pass_share": max_share(cell.pass_at, d.alpha),
                            "max_fail_share": max_share(cell.fail_at, d.alpha)}
        out[sc.name] = {"statistic": sc.family, "gate": GATE_OF[sc.family], "params": sc.params,
                        "truth": sc.truth(), "designs": rows}
    return out, cells


def rates_at(out: dict[str, Any], cells: dict[str, dict[str, Cell]],
             chosen: dict[str, dict[str, tuple[float, float]]]) -> None:
    """Each cell's false PASS and false FAIL rate at the chosen shares, into `out`."""
    for name, rows in out.items():
        for d in designs():
            ps, fs = chosen[rows["statistic"]][schedule_of(d.name)]
            cell, row = cells[name][d.name], rows["designs"][d.name]
            row["false_pass"] = _rate(cell.pass_at <= d.alpha * ps)
            row["false_fail"] = _rate(cell.fail_at <= d.alpha * fs)


def family_of_three(sc: Scenario, pass_share: float, runs: int, resamples: int, seed: int) -> dict[str, float]:
    """Three independent candidates on the bound through the fallback procedure (signoff/family.py): the first at
    5%/3, each later one at its share plus what a passing predecessor hands on. A family-wise error is any PASS."""
    upper = bool(PASS_END[sc.family])
    share = np.ones(runs)
    any_pass = np.zeros(runs, dtype=bool)
    for k in range(3):
        d = draw(sc, runs, DEFAULT_LOOKS[-1], seed + 1000 * (k + 1))
        cell = per_run(sc, criticals(sc, d, resamples, seed, sc.truth()), DEFAULT_LOOKS, upper)
        p = cell.pass_at <= ALPHA * share / 3 * pass_share
        any_pass |= p
        share = np.where(p, share + 1, 1)
    return _rate(any_pass)


def power(fail_share: float, runs: int, resamples: int, seed: int) -> dict[str, Any]:
    """A clear pass@1 regression (drop 0.3, baseline share 0.6): how often the default design FAILs by 64 items."""
    out = {}
    for back in (0.0, 0.1):
        sc = _binary(f"power-back{back}", 0.6, back, 0.3)
        d = draw(sc, runs, DEFAULT_LOOKS[-1], seed)
        cell = per_run(sc, criticals(sc, d, resamples, seed, -BOUNDS["binary"]), DEFAULT_LOOKS, False)
        out[sc.name] = {"params": sc.params, "decided_fail_by_64": _rate(cell.fail_at <= ALPHA * fail_share)}
    return out


def schedule_of(design: str) -> str:
    return ONE_LOOK if "single look" in design else SEVERAL_LOOKS


def _share(x: float) -> float:
    """Rounded down to 0.01, at most MAX_SHARE (an end that never errs in the simulation gets MAX_SHARE)."""
    return MAX_SHARE if not math.isfinite(x) else min(MAX_SHARE, math.floor(x * 100) / 100)


def choose(out: dict[str, Any]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per statistic and schedule (one look, several looks), the share of a look's error each end spends: the
    smallest cell's maximum, rounded down to 0.01. A share above 1 spends more nominal error than the look has:
    allowed where the simulation shows the end's actual error within target (a paired pass/fail
    interval is conservative over several looks), since the guarantee is the simulated rate, not the nominal one."""
    chosen: dict[str, dict[str, tuple[float, float]]] = {}
    for stat in GATE_OF:
        chosen[stat] = {}
        for schedule in (ONE_LOOK, SEVERAL_LOOKS):
            cells = [c for r in out.values() if r["statistic"] == stat
                     for d, c in r["designs"].items() if schedule_of(d) == schedule]
            ps = min(c["max_pass_share"] for c in cells)
            fs = min(c["max_fail_share"] for c in cells)
            chosen[stat][schedule] = (_share(ps), _share(fs))
    return chosen


def table_text(chosen: dict[str, dict[str, tuple[float, float]]], command: str) -> str:
    rows = "".join(f'    "{k}": {{ONE_LOOK: {v[ONE_LOOK]}, SEVERAL_LOOKS: {v[SEVERAL_LOOKS]}}},\n'
                   for k, v in chosen.items())
    return ('"""Each gate statistic\'s split of a look\'s error between its PASS end and its FAIL end, written by\n'
            "evals/stats/at_bound.py from the simulation with the truth on the policy's bound: do not edit by hand.\n\n"
            f"Regenerate with: {command}\n" + '"""\n\n' + 'ONE_LOOK, SEVERAL_LOOKS = "one look", "several looks"\n'
            "# statistic -> schedule -> (share of a look's error spent by the PASS end, by the FAIL end)\n"
            f"SIDE_SHARES = {{\n{rows}}}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qtoolkit.evals.stats.at_bound", description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, required=True, help="JSON file for the measured rates")
    p.add_argument("--table", type=Path, help="also write the shipped split (evals/stats/at_bound_table.py)")
    p.add_argument("--runs", type=int, default=20_000)
    p.add_argument("--resamples", type=int, default=N_RESAMPLES, help="bootstrap resamples (the sign-off's own)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.runs < 100 or a.resamples < 100:
        p.error("--runs and --resamples must be at least 100")
    t0 = time.time()
    sims, cells = simulate(a.runs, a.resamples, a.seed)
    chosen = choose(sims)
    rates_at(sims, cells, chosen)
    fam = {stat: family_of_three(next(s for s in scenarios() if s.family == stat and s.name == worst_pass(sims, stat)),
                                 chosen[stat][SEVERAL_LOOKS][0], a.runs, a.resamples, a.seed) for stat in GATE_OF}
    command = (f"python -m qtoolkit.evals.stats.at_bound --output {a.output} --runs {a.runs} --resamples "
               f"{a.resamples} --seed {a.seed}" + (f" --table {a.table}" if a.table else ""))
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps({
        "command": command, "runs": a.runs, "resamples": a.resamples, "seed": a.seed, "alpha": ALPHA,
        "seconds": round(time.time() - t0, 1), "bounds": BOUNDS,
        "chosen_shares": {k: {s: {"pass_end": p, "fail_end": f} for s, (p, f) in v.items()} for k, v in chosen.items()},
        "worst": {stat: worst_cells(sims, stat) for stat in GATE_OF},
        "family_of_three_on_bound": fam, "power_pass_at_1": power(chosen["binary"][SEVERAL_LOOKS][1], a.runs, a.resamples, a.seed),
        "scenarios": sims}, indent=1) + "\n")
    if a.table:
        a.table.write_text(table_text(chosen, command))
    return 0


def worst_pass(sims: dict[str, Any], stat: str) -> str:
    """The scenario of a statistic whose default design comes closest to its target (for the family check)."""
    return max((k for k, v in sims.items() if v["statistic"] == stat),
               key=lambda k: sims[k]["designs"]["default 8->64"]["false_pass"]["rate"])


def worst_cells(sims: dict[str, Any], stat: str) -> dict[str, Any]:
    """Per side, the cell with the highest rate over its target."""
    out = {}
    for side in ("false_pass", "false_fail"):
        ratio, name, design = max((c[side]["rate"] / c["target"], k, d) for k, v in sims.items()
                                  if v["statistic"] == stat for d, c in v["designs"].items())
        cell = sims[name]["designs"][design]
        out[side] = {"scenario": name, "design": design, "target": cell["target"], **cell[side],
                     "over_target": round(ratio, 3)}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
