"""The one server-per-system benchmark loop (`qtool bench serve`, the sign-off's ablation, the deployment bench):
every system serves the same requests tier by tier, the order alternating between tiers to spread drift, and
then repeated rounds of fresh requests, interleaved within each round, give every ratio a 95% interval."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qtoolkit.evals.stats.paired import ratio_over_rounds

from ..progress import status
from .summary import TierSummary
from .types import BenchRequest, Workload
from .workloads import as_workload

# (label, requests, concurrency, seed) -> that system's summary of serving them
Measure = Callable[[str, list[BenchRequest], int, int], TierSummary]


def requests_per_tier(concurrency: int, num_requests: int | None) -> int:
    """Default: two waves of the tier's concurrency (at least 4, at most 64) to keep a CPU run to minutes."""
    return num_requests if num_requests else min(max(4, 2 * concurrency), 64)


def interleaved(labels: Sequence[str], turn: int) -> list[str]:
    """The measuring order of one tier or round: as given on even turns, reversed on odd ones."""
    return list(labels) if turn % 2 == 0 else list(reversed(labels))


@dataclass
class Tier:
    """One concurrency tier: its requests, each system's summary on them (keyed by the system's label, in the
    order the systems were given) and, when the tier is repeated, each repeated system's output tok/s per round
    (round 1 is the tier's own measurement)."""

    concurrency: int
    requests: list[BenchRequest]
    results: dict[str, TierSummary] = field(default_factory=dict)
    rounds: dict[str, list[float]] | None = None
    # beside each round's output tok/s: its median TPOT and median TTFT (seconds), the speed gates' figures
    rounds_tpot: dict[str, list[float | None]] | None = None
    rounds_ttft: dict[str, list[float | None]] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def add_round(self, label: str, summary: TierSummary) -> None:
        """One more round of `label`."""
        # a summary without latencies (HF generate's) has no TPOT / TTFT: None, which no speed gate passes on
        for name, value in (("rounds", summary.output_tok_per_s), ("rounds_tpot", summary.tpot.p50),
                            ("rounds_ttft", summary.ttft.p50)):
            if getattr(self, name) is None:
                setattr(self, name, {})
            getattr(self, name).setdefault(label, []).append(value)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"concurrency": self.concurrency, "num_requests": self.num_requests,
                               "results": {label: r.to_json() for label, r in self.results.items()}}
        for name in ("rounds", "rounds_tpot", "rounds_ttft"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class TierRecord:
    """A tier as a bench JSON holds it (no requests, only their count): what the tables read back."""

    concurrency: int
    num_requests: int
    results: dict[str, TierSummary]
    rounds: dict[str, list[float]] | None = None
    rounds_tpot: dict[str, list[float | None]] | None = None
    rounds_ttft: dict[str, list[float | None]] | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TierRecord:
        return cls(int(d["concurrency"]), int(d["num_requests"]),
                   {label: TierSummary.from_json(r) for label, r in d["results"].items()}, d.get("rounds"),
                   d.get("rounds_tpot"), d.get("rounds_ttft"))

    @classmethod
    def of(cls, tier: Tier) -> TierRecord:
        """A tier as measured (its requests counted)."""
        return cls(tier.concurrency, tier.num_requests, dict(tier.results), tier.rounds, tier.rounds_tpot,
                   tier.rounds_ttft)

    def tok_per_s(self, label: str) -> float | None:
        """The system's output tok/s at this tier; None when it was not measured or completed nothing."""
        r = self.results.get(label)
        return r.output_tok_per_s if r and r.completed else None

    def requests_per_s(self, label: str) -> float | None:
        """The system's completed requests/s at this tier; None when it was not measured or completed nothing."""
        r = self.results.get(label)
        return r.requests_per_s if r and r.completed else None


def fresh_requests(workload: str | Workload, n: int, used: list[BenchRequest], *, seed: int,
                   mean_output_tokens: int, max_output_tokens: int) -> list[BenchRequest]:
    """n requests whose prompts none of `used` had: a repeated prompt would be served from the prefix cache."""
    seen = {r.prompt for r in used}
    pool = as_workload(workload).requests(4 * n + len(used), seed=seed, mean_output_tokens=mean_output_tokens,
                                          max_output_tokens=max_output_tokens)
    fresh = []
    for r in pool:
        if r.prompt not in seen and len(fresh) < n:
            seen.add(r.prompt)
            fresh.append(r)
    return fresh if len(fresh) == n else pool[:n]  # a tiny prompt pool: repeats are unavoidable


@dataclass
class TierLoop:
    """Systems (by label) x tiers, then rounds. With rounds > 1, `repeat` (default: every system) serves a tier
    again rounds - 1 more times on fresh requests: at every tier when `every_tier`, else at the top tier only.
    The k-th repeated tier draws round r's requests with seed + 100 (k + 1) + r, so rounds never reuse the
    tiers' prompts; tier t's round r is measured with seed + t + r (its arrival times when a rate is set)."""

    labels: list[str]
    measure: Measure
    workload: Workload
    seed: int
    mean_output_tokens: int
    max_output_tokens: int
    rounds: int = 1
    repeat: list[str] | None = None
    every_tier: bool = False
    # called with (tier index, tier) after each system's measurement and after the tier's rounds
    on_result: Callable[[int, Tier], None] | None = None
    requests: list[BenchRequest] = field(default_factory=list)
    round_requests: list[BenchRequest] = field(default_factory=list)

    def plan(self, concurrency: list[int], num_requests: int | None) -> list[Tier]:
        """The tiers' requests: one seeded draw of the workload, cut into consecutive slices."""
        sizes = [requests_per_tier(c, num_requests) for c in concurrency]
        self.requests = self.workload.requests(sum(sizes), seed=self.seed, mean_output_tokens=self.mean_output_tokens,
                                               max_output_tokens=self.max_output_tokens)
        tiers, offset = [], 0
        for c, n in zip(concurrency, sizes, strict=True):
            tiers.append(Tier(c, self.requests[offset:offset + n]))
            offset += n
        return tiers

    def run(self, tiers: list[Tier], after_tier: Callable[[int, Tier], None] | None = None) -> list[Tier]:
        """Measure every tier, its rounds and then `after_tier(index, tier)` (e.g. the HF baseline)."""
        repeated = 0
        for t, tier in enumerate(tiers):
            self._measure_tier(t, tier)
            again = [x for x in self.labels if self.repeat is None or x in self.repeat]
            if self.rounds > 1 and again and (self.every_tier or t == len(tiers) - 1):
                self._repeat(t, tier, again, repeated)
                repeated += 1
                if self.on_result is not None:
                    self.on_result(t, tier)
            if after_tier is not None:
                after_tier(t, tier)
        return tiers

    def _measure_tier(self, t: int, tier: Tier) -> None:
        """Every system on the tier's requests, interleaved; results kept in the order of `labels`."""
        results: dict[str, TierSummary] = {}
        for label in interleaved(self.labels, t):
            status(f"concurrency {tier.concurrency}: {tier.num_requests} requests against {label}")
            results[label] = self.measure(label, tier.requests, tier.concurrency, self.seed + t)
            tier.results = {x: results[x] for x in self.labels if x in results}
            if self.on_result is not None:
                self.on_result(t, tier)

    def _repeat(self, t: int, tier: Tier, labels: list[str], k: int) -> None:
        for label in labels:
            tier.add_round(label, tier.results[label])
        for r in range(1, self.rounds):
            self._round(t, tier, labels, k, r, f"round {r + 1}/{self.rounds}")

    def _round(self, t: int, tier: Tier, labels: list[str], k: int, r: int, name: str) -> None:
        """Round r of the k-th repeated tier: fresh requests, `labels` interleaved."""
        reqs = fresh_requests(self.workload, tier.num_requests, self.requests + self.round_requests,
                              seed=self.seed + 100 * (k + 1) + r, mean_output_tokens=self.mean_output_tokens,
                              max_output_tokens=self.max_output_tokens)
        self.round_requests.extend(reqs)
        for label in interleaved(labels, r):
            status(f"concurrency {tier.concurrency}, {name}: {len(reqs)} requests against {label}")
            tier.add_round(label, self.measure(label, reqs, tier.concurrency, self.seed + t + r))

    def probe_requests(self, n: int, k: int) -> list[BenchRequest]:
        """The k-th capacity probe's `n` requests: none a tier or round had (a server's prefix cache would serve
        a repeated prompt), kept with the rounds' so that later probes draw others."""
        reqs = fresh_requests(self.workload, n, self.requests + self.round_requests, seed=self.seed + 5000 + k,
                              mean_output_tokens=self.mean_output_tokens, max_output_tokens=self.max_output_tokens)
        self.round_requests.extend(reqs)
        return reqs

    def more_rounds(self, tiers: list[Tier], labels: list[str], until: int) -> None:
        """Rounds of `labels` at every tier until each has `until` (the speed gates' further looks); a tier's
        k-th repeated index is its position, as when `every_tier` repeated them."""
        for t, tier in enumerate(tiers):
            done = len((tier.rounds or {}).get(labels[0], []))
            for r in range(done, until):
                self._round(t, tier, labels, t, r, f"round {r + 1}")
            if self.on_result is not None:
                self.on_result(t, tier)


def ratio_rounds(rounds: dict[str, list[float]], numerator: str, denominator: str) -> dict[str, Any] | None:
    """numerator ÷ denominator over paired rounds (evals.stats.ratio_over_rounds: geometric mean, t-interval);
    None when either side is missing or a round measured nothing (all its requests failed)."""
    a, b = rounds.get(numerator), rounds.get(denominator)
    if not a or not b or min(a) <= 0 or min(b) <= 0:
        return None
    return ratio_over_rounds(a, b)
