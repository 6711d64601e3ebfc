"""How often the speed gates PASS a candidate whose true speed ratio sits exactly on the policy's bound.

`python -m qtoolkit.signoff.speed_simulation --runs 20000 --output FILE.json` simulates each cell (a per-round
spread x a round schedule x a noise shape): per-round log ratios drawn around log(bound) (log-normal round
ratios; "t3" draws heavier-tailed Student t(3) noise of the same scale), looked at with the sign-off's schedule
(speed.round_looks) and levels (speed.speed_design), the interval the gate judges (Student t on the log ratios,
as evals.stats.paired.ratio_over_rounds computes it). Two false-PASS rates per cell:
- `false_pass_stopping`: the sign-off's own rule: stop at the first look where the gate is decided (PASS or FAIL);
- `false_pass_any_look`: a PASS at any look, whatever the stopping rule (an upper bound for every rule, e.g. when
  another gate keeps the rounds going).
The bar is 5% (the report's claim); the union bound of error spending promises at most alpha / 2 = 2.5% for a
one-sided false PASS when the intervals hold their level.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import t as student_t

from ..io import write_text
from .speed import round_looks, speed_design

SPREADS = (0.01, 0.03, 0.05, 0.10, 0.20, 0.40)  # sd of a round's log ratio (measured: ~0.01-0.15 on 2 cores)
SCHEDULES = ((3, 9), (3, 3), (5, 5), (3, 15))  # (--rounds, --max-rounds); (3, 9) is the sign-off's default
BOUND = 1.0
TARGET = 0.05


@dataclass(frozen=True)
class Cell:
    spread: float
    rounds: int
    max_rounds: int
    noise: str
    runs: int
    looks: list[int]
    levels: list[float]
    false_pass_stopping: float
    false_pass_any_look: float
    fail_rate_stopping: float  # FAIL with the truth on the bound is also wrong, on the candidate's side
    mean_rounds: float

    @property
    def ok(self) -> bool:
        return self.false_pass_any_look <= TARGET


def _noise(rng: np.random.Generator, shape: tuple[int, int], spread: float, noise: str) -> np.ndarray:
    if noise == "normal":
        return rng.normal(0.0, spread, size=shape)
    # Student t(3) scaled to the same sd: rare rounds far off (a neighbour's burst on a shared CPU)
    return rng.standard_t(3, size=shape) * spread / math.sqrt(3.0)


def simulate(spread: float, rounds: int, max_rounds: int, *, runs: int, noise: str = "normal", seed: int = 0,
             bound: float = BOUND) -> Cell:
    """One cell: `runs` simulated gates with the true ratio exactly `bound`."""
    looks = round_looks(rounds, max_rounds)
    levels = speed_design(looks, alpha=0.05).levels
    rng = np.random.default_rng(seed)
    logs = math.log(bound) + _noise(rng, (runs, looks[-1]), spread, noise)
    passed_any = np.zeros(runs, bool)
    stopped = np.zeros(runs, bool)
    passed_stop = np.zeros(runs, bool)
    failed_stop = np.zeros(runs, bool)
    used = np.full(runs, looks[-1], float)
    for n, level in zip(looks, levels, strict=True):
        x = logs[:, :n]
        mean, sd = x.mean(axis=1), x.std(axis=1, ddof=1)
        half = student_t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
        lo, hi = np.exp(mean - half), np.exp(mean + half)
        p, f = lo >= bound, hi < bound
        passed_any |= p
        new = ~stopped & (p | f)
        passed_stop |= new & p
        failed_stop |= new & f
        used[new] = n
        stopped |= new
    return Cell(spread, rounds, max_rounds, noise, runs, list(looks), [round(v, 6) for v in levels],
                float(passed_stop.mean()), float(passed_any.mean()), float(failed_stop.mean()), float(used.mean()))


def run_grid(runs: int, seed: int = 0) -> dict:
    cells = [simulate(s, r, m, runs=runs, noise=noise, seed=seed + i)
             for i, (s, (r, m), noise) in enumerate((s, sch, nz) for nz in ("normal", "t3") for sch in SCHEDULES
                                                    for s in SPREADS)]
    worst = max(c.false_pass_any_look for c in cells)
    return {"what": "false PASS rate of a speed gate with the true ratio exactly on its bound",
            "bound": BOUND, "target": TARGET, "runs_per_cell": runs, "seed": seed,
            "worst_false_pass_any_look": worst, "all_within_target": all(c.ok for c in cells),
            "cells": [asdict(c) for c in cells]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    result = run_grid(args.runs, args.seed)
    if args.output:
        write_text(args.output, json.dumps(result, indent=1) + "\n")
    for c in result["cells"]:
        print(f"{c['noise']:>6} sd {c['spread']:.2f} rounds {c['rounds']}..{c['max_rounds']}: false PASS "
              f"{c['false_pass_stopping']:.4f} (any look {c['false_pass_any_look']:.4f}), mean rounds "
              f"{c['mean_rounds']:.1f}")
    print(f"worst {result['worst_false_pass_any_look']:.4f}, within {TARGET:.0%}: {result['all_within_target']}")
    return 0 if result["all_within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
