"""Capacity at a latency SLO, candidate against baseline: paired rounds of the bracketing search (slo_sweep.py).

One search is no interval: it probes closest to where the servers' p99s cross the SLO, so a probe's noise decides
the bracket's ends, and a gate judged on the bracket alone passed a candidate whose capacity sat exactly on the
bound in up to 36% of simulated sign-offs; over the rounds as below, at most 4.05%
(measurements/2026-12-05/issue40d/capacity-gate-false-pass.json). So the sign-off repeats the search in
rounds: each round runs both servers' searches probe by probe in turn (so a drift of the machine hits both), and
each gives a continuous estimate (the margin interpolated between the bracket's ends); the capacity ratio and its
interval come from the rounds as the other speed gates' do (Student's t on the per-round log ratios).

Later rounds start just under the previous round's estimate and grow by a smaller step, so they cost about three
probes each instead of the first round's five or six.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..progress import status
from .loop import TierRecord
from .slo_sweep import RateSearch, SweepResult
from .summary import SLO, TierSummary

FIRST_STEP, LATER_STEP, LATER_START = 2.0, 1.3, 1 / 1.15
LOOK_STEP = 2  # rounds added per further look, by the speed gates (signoff/speed.py) and the capacity gate


def round_looks(first: int, max_rounds: int | None) -> tuple[int, ...]:
    """Round counts of successive looks: first, first + LOOK_STEP, ... up to max_rounds (at least first)."""
    looks = [first]
    while max_rounds is not None and looks[-1] < max_rounds:
        looks.append(min(looks[-1] + LOOK_STEP, max_rounds))
    return tuple(looks)
# a probe lasts requests / rate, so halving without end costs minutes a probe: a server that misses the SLO at an
# eighth of its start (half its closed-loop requests/s at the top tier) has no capacity worth gating, and the
# search stops there (the gate then says so instead of deciding)
MAX_DROP = 8.0

# (system label, rate, probe index) -> the summary of one open-loop run of that system at that rate
PairProbe = Callable[[str, float, int], TierSummary]


@dataclass(frozen=True)
class CapacityPlan:
    """What the sign-off's capacity gate measures: the SLO, the rounds of the paired search and their size."""

    slo: SLO
    rounds: int = 3
    requests_per_probe: int = 16
    precision: float = 1.35  # the margin is interpolated inside the bracket, so a coarse one suffices
    max_probes: int = 8
    max_rounds: int | None = None  # rounds added LOOK_STEP at a time while `decided` says no, up to this
    # the caller's (the sign-off's) judgement of the rounds so far; not part of what is measured
    decided: Callable[[CapacityRounds], bool] | None = field(default=None, compare=False, repr=False)

    @property
    def looks(self) -> tuple[int, ...]:
        """The round counts at which the gate is judged: rounds, rounds + 2, ... up to max_rounds."""
        return round_looks(self.rounds, self.max_rounds)

    def to_json(self) -> dict[str, Any]:
        return {"slo": {k: v for k, v in vars(self.slo).items() if v is not None}, "rounds": self.rounds,
                "requests_per_probe": self.requests_per_probe, "precision": self.precision,
                "max_probes": self.max_probes} | ({} if self.max_rounds is None else {"max_rounds": self.max_rounds})


@dataclass(frozen=True)
class CapacityRounds:
    """bench.json's `capacity`: the pair (baseline label, candidate label) and each round's two searches."""

    plan: CapacityPlan
    pair: tuple[str, str]
    rounds: list[dict[str, SweepResult]]

    def estimates(self, label: str) -> list[float | None]:
        return [r[label].estimate if label in r else None for r in self.rounds]

    def to_json(self) -> dict[str, Any]:
        return {**self.plan.to_json(), "pair": list(self.pair), "slo_text": self.plan.slo.describe(),
                "estimates_rps": {label: self.estimates(label) for label in self.pair},
                "sweeps": [{label: s.to_json() for label, s in r.items()} for r in self.rounds]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CapacityRounds:
        plan = CapacityPlan(SLO(**d["slo"]), int(d["rounds"]), int(d["requests_per_probe"]),
                            float(d["precision"]), int(d["max_probes"]), d.get("max_rounds"))
        rounds = [{label: SweepResult.from_json(s) for label, s in r.items()} for r in d["sweeps"]]
        return cls(plan, (d["pair"][0], d["pair"][1]), rounds)


def capacity_starts(top: TierRecord, pair: tuple[str, str]) -> dict[str, float]:
    """Each search's first rate: its system's closed-loop requests/s at the top tier, halved (the SLO's capacity
    lies below that saturation)."""
    return {label: 0.5 * (top.requests_per_s(label) or 1.0) for label in pair}


def _next_start(result: SweepResult, start: float) -> float:
    """Where the next round's search starts: just under this round's estimate (or its bracket's end)."""
    anchor = result.estimate or result.capacity or (result.failed_at / FIRST_STEP if result.failed_at else None)
    return (anchor or start) * LATER_START


def paired_capacity(probe: PairProbe, pair: tuple[str, str], plan: CapacityPlan,
                    starts: dict[str, float]) -> CapacityRounds:
    """`plan.rounds` rounds, then more up to each further look while `plan.decided` says the gate is not
    decided (fewer when a round finds no capacity for a server); in each, the two systems' searches take turns
    probe by probe, the first to probe alternating between rounds."""
    rounds: list[dict[str, SweepResult]] = []
    k = 0
    looks = plan.looks
    for r in range(looks[-1]):
        if r in looks[:-1] and (plan.decided is None or plan.decided(CapacityRounds(plan, pair, rounds))):
            break  # a look: decided (or nobody to ask), so no more rounds
        status_total = next(n for n in looks if n > r)
        later = r > 0
        searches = {label: RateSearch(plan.slo, starts[label], plan.precision, plan.max_probes,
                                      step=LATER_STEP if later else FIRST_STEP,
                                      min_rate=starts[label] / MAX_DROP) for label in pair}
        order = list(pair) if r % 2 == 0 else list(reversed(pair))
        while True:
            turn = [(label, rate) for label in order if (rate := searches[label].next_rate()) is not None]
            if not turn:
                break
            for label, rate in turn:
                status(f"capacity round {r + 1}/{status_total}: {label} at {rate:.3g} requests/s "
                       f"({plan.slo.describe()})")
                searches[label].record(rate, probe(label, rate, k))
                k += 1
        rounds.append({label: s.result() for label, s in searches.items()})
        if any(rounds[-1][label].estimate is None for label in pair):
            break  # a server without a capacity in one round leaves the gate nothing to judge: no more probes
        starts = {label: _next_start(rounds[-1][label], starts[label]) for label in pair}
    return CapacityRounds(plan, pair, rounds)
