"""How often the capacity gate PASSes a candidate whose true capacity ratio sits exactly on the policy's bound.

`python -m qtoolkit.signoff.capacity_simulation --runs 4000 --output FILE.json` runs the sign-off's own paired
search (bench.capacity.paired_capacity, bench.slo_sweep.RateSearch) against simulated servers and judges the
result as the gate does (speed.capacity_ratio, Student t on the per-round log ratios). A simulated server's p99
margin (p99 latency / its bound) at rate r is (r / C)^k x exp(sigma Z): k is how steeply latency climbs near
capacity, sigma a probe's noise; the baseline's C is drawn per run and the candidate's is bound x C. Beside it, the
rule a single search would give (the bracket's ends: [lo_c / hi_b, hi_c / lo_b]) shows why the gate uses rounds.
The bar is 5% (the report's claim).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import numpy as np

from ..bench.capacity import CapacityPlan, paired_capacity
from ..bench.summary import SLO, Distribution, TierSummary
from ..io import write_text
from .speed import capacity_ratio

SIGMAS = (0.05, 0.10, 0.20, 0.30)  # sd of a probe's log margin
STEEPNESS = (2.0, 4.0)  # p99 ~ rate^k near capacity
ROUNDS = (3, 5)
BOUND = 0.9
TARGET = 0.05
SLO_MS = 1000.0


@dataclass(frozen=True)
class Cell:
    sigma: float
    steepness: float
    rounds: int
    runs: int
    false_pass: float  # the gate's rule: the interval's lower end at least the bound
    false_pass_one_search: float  # the bracket of round 1 alone
    fail_rate: float
    mean_probes: float

    @property
    def ok(self) -> bool:
        return self.false_pass <= TARGET


def _summary(p99_s: float) -> TierSummary:
    d = Distribution(p99_s, p99_s, p99_s, p99_s)
    return TierSummary(16, 16, 0, 1.0, 0, 0, 0.0, 0.0, d, Distribution(), Distribution(), Distribution(), [])


def simulate(sigma: float, steepness: float, rounds: int, runs: int, seed: int) -> Cell:
    rng = np.random.default_rng(seed)
    plan = CapacityPlan(SLO(ttft_ms=SLO_MS), rounds=rounds)
    passes = one = fails = probes = 0
    for _ in range(runs):
        base = math.exp(rng.uniform(-1.5, 1.5))
        caps = {"b": base, "c": BOUND * base}

        def probe(label: str, rate: float, k: int, caps: dict[str, float] = caps) -> TierSummary:
            margin = (rate / caps[label]) ** steepness * math.exp(sigma * rng.standard_normal())
            return _summary(margin * SLO_MS / 1000)

        # the start: a closed-loop throughput reading, anywhere within 2x of the capacity
        starts = {x: caps[x] * math.exp(rng.uniform(-0.7, 0.7)) for x in caps}
        result = paired_capacity(probe, ("b", "c"), plan, starts)
        probes += sum(len(s.points) for r in result.rounds for s in r.values())
        fig = capacity_ratio(result, level=0.95)
        if fig.complete and fig.ci is not None:
            passes += fig.ci[0] >= BOUND
            fails += fig.ci[1] < BOUND
        first = result.rounds[0]
        lo_c, hi_b = first["c"].capacity, first["b"].failed_at
        one += lo_c is not None and hi_b is not None and lo_c / hi_b >= BOUND
    return Cell(sigma, steepness, rounds, runs, passes / runs, one / runs, fails / runs, probes / runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qtoolkit.signoff.capacity_simulation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    if args.runs < 1:
        print("error: --runs must be at least 1: pass e.g. --runs 2000", file=sys.stderr)
        return 2
    os.environ["QTOOLKIT_QUIET"] = "1"  # no status line per probe
    cells = []
    for i, (sigma, k, rounds) in enumerate((s, k, r) for s in SIGMAS for k in STEEPNESS for r in ROUNDS):
        cells.append(simulate(sigma, k, rounds, args.runs, args.seed + i))
        c = cells[-1]
        print(f"sigma {sigma:.2f} k {k:g} rounds {rounds}: false PASS {c.false_pass:.2%} (one search "
              f"{c.false_pass_one_search:.2%}), FAIL {c.fail_rate:.2%}, {c.mean_probes:.1f} probes",
              file=sys.stderr)
    worst = max(c.false_pass for c in cells)
    write_text(args.output, json.dumps({
        "what": "false PASS of the capacity gate with the true capacity ratio exactly on the bound",
        "bound": BOUND, "target": TARGET, "runs_per_cell": args.runs, "seed": args.seed,
        "worst_false_pass": worst, "all_within_target": all(c.ok for c in cells),
        "cells": [asdict(c) for c in cells]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
