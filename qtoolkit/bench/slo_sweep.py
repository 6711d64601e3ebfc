"""Capacity at a latency SLO: the highest open-loop request rate at which p99 TTFT and p99 TPOT stay within their
bounds, found by a bracketing search (vLLM's `bench sweep serve_sla` and GuideLLM's rate sweeps ask the same).

The search doubles the rate from a start until a rate fails (or halves it until one passes), then bisects the
bracket geometrically until its ends are within `precision` of each other. A rate fails when its p99s break the SLO
or when the server did not keep up with it (summary.Saturation): a saturated rate's latencies grow with the run's
length, so they are reported as saturated and never averaged into a capacity. Each probe draws fresh prompts (a
repeated prompt would be served from the prefix cache).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import QToolError
from ..progress import status
from .summary import SLO, TierSummary

OK, VIOLATED, SATURATED = "ok", "slo violated", "saturated"
UNLOADED_IN_FLIGHT = 0.5  # requests in flight on average under which a probe counts as unloaded

# (rate, probe index) -> the summary of one open-loop run at that rate
Probe = Callable[[float, int], TierSummary]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


@dataclass(frozen=True)
class RatePoint:
    """One probe of the sweep: the offered rate, what was measured, and whether it met the SLO."""

    rate: float
    summary: TierSummary
    status: str  # ok | slo violated | saturated

    @property
    def passed(self) -> bool:
        return self.status == OK

    def to_json(self) -> dict[str, Any]:
        s = self.summary
        return {"rate": self.rate, "status": self.status, "completed": s.completed, "failed": s.failed,
                "achieved_rate": None if s.saturation is None else s.saturation.achieved_rate,
                "ttft_growth": None if s.saturation is None else s.saturation.ttft_growth,
                "p99_ttft_ms": ms(s.ttft.p99), "p99_tpot_ms": ms(s.tpot.p99), "median_ttft_ms": ms(s.ttft.p50),
                "median_tpot_ms": ms(s.tpot.p50), "request_goodput": s.goodput, "summary": s.to_json()}


def margin(summary: TierSummary, slo: SLO) -> float | None:
    """How far the probe's p99s are from the SLO: the largest p99 / bound over the bounded latencies (<= 1 meets
    it); None when a bounded latency was not measured."""
    pairs = ((slo.ttft_ms, summary.ttft.p99), (slo.tpot_ms, summary.tpot.p99), (slo.e2el_ms, summary.e2el.p99))
    fractions = [1000 * value / bound for bound, value in pairs if bound is not None and value is not None]
    if len(fractions) < sum(bound is not None for bound, _ in pairs) or not fractions:
        return None
    return max(fractions)


@dataclass(frozen=True)
class SweepResult:
    """The probes in the order measured, the capacity (highest passing rate; None when no rate passed), the
    lowest rate that failed (the bracket's upper end; None when the search never found one) and `estimate`: the
    rate where the p99 margin crosses the SLO, interpolated between the bracket's ends (a continuous figure, so
    capacities compared over rounds are not stuck on the search's grid)."""

    slo: SLO
    points: list[RatePoint]
    capacity: float | None
    failed_at: float | None
    estimate: float | None = None

    @property
    def saturated_rates(self) -> list[float]:
        return sorted(p.rate for p in self.points if p.status == SATURATED)

    def to_json(self) -> dict[str, Any]:
        return {"slo": {k: v for k, v in vars(self.slo).items() if v is not None}, "slo_text": self.slo.describe(),
                "capacity_rps": self.capacity, "first_failing_rps": self.failed_at,
                "capacity_estimate_rps": self.estimate, "saturated_rps": self.saturated_rates,
                "points": [p.to_json() for p in self.points]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SweepResult:
        points = [RatePoint(float(p["rate"]), TierSummary.from_json(p["summary"]), p["status"]) for p in d["points"]]
        return cls(SLO(**d["slo"]), points, d.get("capacity_rps"), d.get("first_failing_rps"),
                   d.get("capacity_estimate_rps"))


def _median_misses(summary: TierSummary, slo: SLO) -> bool:
    """Whether the probe's median request is past a bound (the SLO bounds p99s: its typical request missing one
    is a server too slow for the SLO, not a tail)."""
    checks = ((slo.ttft_ms, summary.ttft.p50), (slo.tpot_ms, summary.tpot.p50), (slo.e2el_ms, summary.e2el.p50))
    return any(bound is not None and value is not None and 1000 * value > bound for bound, value in checks)


def classify(summary: TierSummary, slo: SLO) -> str:
    if summary.saturation is not None and summary.saturation.saturated:
        return SATURATED
    return OK if slo.tier_meets(summary) else VIOLATED


@dataclass
class RateSearch:
    """The bracketing search as a state machine, so two servers' searches can take turns probe by probe: the
    rate grows by `step` from the start until a rate fails (or shrinks by it until one passes), then the bracket
    is bisected geometrically until its ends are within `precision` of each other, at most `max_probes` probes."""

    slo: SLO
    start_rate: float
    precision: float = 1.2
    max_probes: int = 10
    step: float = 2.0
    min_rate: float = 1e-3
    max_rate: float = 1e4
    points: list[RatePoint] = field(default_factory=list)
    lo: float | None = None
    hi: float | None = None
    missed_unloaded: bool = False  # a rate missed the SLO with requests barely overlapping: none lower meets it

    def __post_init__(self) -> None:
        if not (self.start_rate > 0 and math.isfinite(self.start_rate)) or not self.precision > 1 \
                or not self.step > 1:
            raise QToolError(f"the SLO sweep needs a positive start rate and a precision > 1 (got "
                             f"{self.start_rate}, {self.precision}): pass --slo-start-rate R")
        self._rate = self.start_rate

    def next_rate(self) -> float | None:
        """The next rate to probe; None when the search is done."""
        if len(self.points) >= self.max_probes:
            return None
        if self.lo is None and self.missed_unloaded:
            return None
        if self.lo is None or self.hi is None:
            return self._rate if self.min_rate <= self._rate <= self.max_rate else None
        return math.sqrt(self.lo * self.hi) if self.hi / self.lo > self.precision else None

    def record(self, rate: float, summary: TierSummary) -> RatePoint:
        point = RatePoint(rate, summary, classify(summary, self.slo))
        self.points.append(point)
        if point.passed:
            self.lo = rate
            self._rate = rate * self.step
        else:
            self.hi = rate
            self._rate = rate / self.step
            # Little's law: rate x mean latency requests in flight on average; under half a request (or under
            # one with the median request itself past a bound) the server missed the SLO serving requests about
            # one at a time, and halving the rate again changes nothing but doubles a probe's minutes (a vLLM CPU
            # fp8 endpoint, 15 s and more a request, was probed down to 0.017 requests/s: 16 minutes a probe)
            mean = summary.e2el.mean
            in_flight = None if mean is None else rate * mean
            if point.status == VIOLATED and in_flight is not None and (
                    in_flight < UNLOADED_IN_FLIGHT or (in_flight < 1 and _median_misses(summary, self.slo))):
                self.missed_unloaded = True
        return point

    def result(self) -> SweepResult:
        return SweepResult(self.slo, list(self.points), self.lo, self.hi, self.estimate())

    def estimate(self) -> float | None:
        """Log-linear interpolation of the p99 margin between the highest passing and the lowest failing probe
        (where it crosses 1); the bracket's geometric middle when the failing probe saturated (its latencies
        grow with the run's length, so its margin is no reading) or a margin is missing."""
        if self.lo is None or self.hi is None:
            return None
        below = next(p for p in self.points if p.rate == self.lo)
        above = next(p for p in self.points if p.rate == self.hi)
        m_lo, m_hi = margin(below.summary, self.slo), margin(above.summary, self.slo)
        if above.status == SATURATED or m_lo is None or m_hi is None or not (0 < m_lo <= 1 < m_hi):
            return math.sqrt(self.lo * self.hi)
        t = -math.log(m_lo) / (math.log(m_hi) - math.log(m_lo))
        return math.exp(math.log(self.lo) + t * (math.log(self.hi) - math.log(self.lo)))


def slo_sweep(probe: Probe, slo: SLO, *, start_rate: float, precision: float = 1.2, max_probes: int = 10,
              min_rate: float = 1e-3, max_rate: float = 1e4) -> SweepResult:
    """The bracketing search on one server; `probe(rate, k)` runs the k-th probe."""
    search = RateSearch(slo, start_rate, precision, max_probes, min_rate=min_rate, max_rate=max_rate)
    while (rate := search.next_rate()) is not None:
        status(f"SLO sweep: {rate:.3g} requests/s ({slo.describe()})")
        search.record(rate, probe(rate, len(search.points)))
    return search.result()
