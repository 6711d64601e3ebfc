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
from dataclasses import dataclass
from typing import Any

from ..errors import QToolError
from ..progress import status
from .summary import SLO, TierSummary

OK, VIOLATED, SATURATED = "ok", "slo violated", "saturated"

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


@dataclass(frozen=True)
class SweepResult:
    """The probes in the order measured, the capacity (highest passing rate; None when no rate passed) and the
    lowest rate that failed (the bracket's upper end; None when the search never found one)."""

    slo: SLO
    points: list[RatePoint]
    capacity: float | None
    failed_at: float | None

    @property
    def saturated_rates(self) -> list[float]:
        return sorted(p.rate for p in self.points if p.status == SATURATED)

    def to_json(self) -> dict[str, Any]:
        return {"slo": {k: v for k, v in vars(self.slo).items() if v is not None}, "slo_text": self.slo.describe(),
                "capacity_rps": self.capacity, "first_failing_rps": self.failed_at,
                "saturated_rps": self.saturated_rates, "points": [p.to_json() for p in self.points]}


def classify(summary: TierSummary, slo: SLO) -> str:
    if summary.saturation is not None and summary.saturation.saturated:
        return SATURATED
    return OK if slo.tier_meets(summary) else VIOLATED


def slo_sweep(probe: Probe, slo: SLO, *, start_rate: float, precision: float = 1.2, max_probes: int = 10,
              min_rate: float = 1e-3, max_rate: float = 1e4) -> SweepResult:
    """The bracketing search; `probe(rate, k)` runs the k-th probe. At most `max_probes` probes."""
    if not (start_rate > 0 and math.isfinite(start_rate)) or not precision > 1:
        raise QToolError(f"the SLO sweep needs a positive start rate and a precision > 1 (got {start_rate}, "
                         f"{precision}): pass --slo-start-rate R")
    points: list[RatePoint] = []

    def run(rate: float) -> bool:
        status(f"SLO sweep: {rate:.3g} requests/s ({slo.describe()})")
        summary = probe(rate, len(points))
        points.append(RatePoint(rate, summary, classify(summary, slo)))
        return points[-1].passed

    lo, hi = None, None
    rate = start_rate
    while len(points) < max_probes and min_rate <= rate <= max_rate:
        if run(rate):
            lo = rate
            if hi is not None:
                break
            rate *= 2
        else:
            hi = rate
            if lo is not None:
                break
            rate /= 2
    while lo is not None and hi is not None and hi / lo > precision and len(points) < max_probes:
        mid = math.sqrt(lo * hi)
        if run(mid):
            lo = mid
        else:
            hi = mid
    return SweepResult(slo, points, lo, hi)
