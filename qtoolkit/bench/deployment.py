"""Throughput of two deployments (candidate and baseline endpoints) under the same load, tier by tier.

The load generator, workload and tier sizes are those of `qtool bench serve --endpoint`, so a tier here and a
standalone `qtool bench serve` against the same endpoint send the same requests (same `workload_sha256`). The two
endpoints alternate within each tier, and at the top tier they serve `rounds` rounds of fresh requests back to
back: the throughput gate judges the spread of the per-round ratios, as it does for the local ablation.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from qtoolkit.evals.stats.paired import CONFIDENCE, ratio_over_rounds

from ..endpoints.deployment import Deployment, EndpointError, EndpointInfo
from ..provenance import provenance
from .ablation import SpeedLooks
from .capacity import CapacityPlan, CapacityRounds, capacity_starts, paired_capacity
from .load_client import requests_sha256, run_load, summarize, warm_up
from .loop import Tier, TierLoop, TierRecord
from .summary import ServedBy, TierSummary
from .types import BenchRequest, Workload
from .workloads import as_workload

ROLES = ("baseline", "candidate")


def _measure(dep: Deployment, info: EndpointInfo, reqs: list[BenchRequest], concurrency: int, seed: int,
             ignore_eos: bool) -> TierSummary:
    res, duration = asyncio.run(run_load(info.url, info.model_id, reqs, concurrency=concurrency, seed=seed,
                                         ignore_eos=ignore_eos, api_key=dep.api_key()))
    summary = summarize(res, duration)
    if summary.failed:
        # a throughput with dropped requests measures the failures, not the deployment: ERROR, never a verdict
        raise EndpointError(f"the {dep.role} endpoint {info.url} failed {summary.failed} of {len(res)} benchmark "
                            f"requests at concurrency {concurrency} (first: {(summary.errors or ['no error text'])[0]}): "
                            "check the endpoint and run the same sign-off again (finished steps are reused)")
    return dataclasses.replace(summary, served_by=ServedBy(info.url, info.model_id, sum(1 for r in res if r.retries)))


def bench_deployments(deps: dict[str, Deployment], infos: dict[str, EndpointInfo], *, concurrency: list[int],
                      num_requests: int | None = None, mean_output_tokens: int = 64, max_output_tokens: int = 128,
                      workload: str | Workload = "mixed", seed: int = 0, rounds: int = 1,
                      ignore_eos: bool = True, speed: SpeedLooks | None = None,
                      capacity: CapacityPlan | None = None) -> dict[str, Any]:
    """Both endpoints on the same requests, tier by tier, then `rounds` rounds at the top tier; with `speed` (the
    sign-off's speed gates) the rounds are served at every tier and more are added while the gates are undecided,
    and with `capacity` the two endpoints' paired searches for the highest request rate within the SLO follow, as
    in the local sign-off's bench (bench/ablation.py): the same figures, of the deployments that ship."""
    for role in ROLES:  # first requests pay one-off costs (the same warm-up as `qtool bench serve`)
        warm_up(infos[role].url, infos[role].model_id, seed=seed, ignore_eos=ignore_eos, api_key=deps[role].api_key())

    def measure(role: str, reqs: list[BenchRequest], c: int, s: int) -> TierSummary:
        return _measure(deps[role], infos[role], reqs, c, s, ignore_eos)

    traffic = as_workload(workload)
    loop = TierLoop(list(ROLES), measure, traffic, seed, mean_output_tokens, max_output_tokens, rounds,
                    every_tier=speed is not None)
    tiers = loop.plan(concurrency, num_requests)
    loop.run(tiers)
    looks = None if speed is None else speed.serve(list(ROLES), list(ROLES), rounds,
                                                   lambda: [TierRecord.of(t) for t in tiers],
                                                   lambda n: loop.more_rounds(tiers, list(ROLES), n))
    searched = None if capacity is None else _capacity(deps, infos, loop, tiers, capacity, ignore_eos)
    config = {"concurrency": concurrency, "num_requests": num_requests, "workload": traffic.describe(),
              "mean_output_tokens": mean_output_tokens, "max_output_tokens": max_output_tokens, "seed": seed,
              "rounds": rounds, "ignore_eos": ignore_eos, "api": "completions", "systems": list(ROLES)}
    return {**provenance(candidate=infos["candidate"].url, baseline=infos["baseline"].url,
                         workload_sha256=requests_sha256(loop.requests),
                         rounds_workload_sha256=requests_sha256(loop.round_requests)),
            "config": config, "endpoints": {r: asdict(infos[r]) for r in ROLES},
            "tiers": [t.to_json() for t in tiers]} | \
        ({} if looks is None else {"speed_rounds": looks.to_json()}) | \
        ({} if searched is None else {"capacity": searched.to_json()})


def _capacity(deps: dict[str, Deployment], infos: dict[str, EndpointInfo], loop: TierLoop, tiers: list[Tier],
              plan: CapacityPlan, ignore_eos: bool) -> CapacityRounds:
    """The two endpoints' paired capacity searches (bench/capacity.py), as the local bench runs them."""

    def probe(role: str, rate: float, k: int) -> TierSummary:
        reqs = loop.probe_requests(plan.requests_per_probe, k)
        res, duration = asyncio.run(run_load(infos[role].url, infos[role].model_id, reqs, concurrency=len(reqs),
                                             rate=rate, seed=loop.seed + k, ignore_eos=ignore_eos,
                                             api_key=deps[role].api_key()))
        return TierSummary.of(res, duration, slo=plan.slo, rate=rate)

    pair = ("baseline", "candidate")
    return paired_capacity(probe, pair, plan, capacity_starts(TierRecord.of(tiers[-1]), pair))


@dataclass(frozen=True)
class EndpointFigures:
    """One endpoint's figures at one tier, as the throughput table shows them."""

    endpoint: str
    model_id: str
    output_tok_per_s: float
    requests_per_s: float
    completed: int
    failed: int
    ttft_p50_s: float | None
    tpot_p50_s: float | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EndpointFigures:
        return cls(**d)

    @classmethod
    def from_summary(cls, r: TierSummary) -> EndpointFigures:
        """From a tier result: _measure's summary (the load client's figures and the endpoint that served them)."""
        if r.served_by is None:
            raise ValueError("a deployment bench's tier result names no endpoint")
        return cls(r.served_by.endpoint, r.served_by.model_id, r.output_tok_per_s, r.requests_per_s, r.completed,
                   r.failed, r.ttft.p50, r.tpot.p50)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ThroughputRow:
    """Candidate ÷ baseline output tok/s at one tier (and over rounds at the top tier)."""

    concurrency: int
    num_requests: int
    endpoints: dict[str, EndpointFigures]  # role -> figures
    total_speedup: float | None
    total_speedup_rounds: dict[str, Any] | None = None  # ratio_over_rounds' figures
    # two endpoints are two fixed configurations: quantization alone (same engine, static batching) is not theirs
    quantization_speedup: None = None
    quantization_speedup_rounds: None = None

    @classmethod
    def from_tier(cls, tier: TierRecord, level: float = CONFIDENCE) -> ThroughputRow:
        c, b = (EndpointFigures.from_summary(tier.results[r]) for r in ("candidate", "baseline"))
        ok = c.completed and b.completed and not c.failed and not b.failed and b.output_tok_per_s
        rounds = tier.rounds
        return cls(tier.concurrency, tier.num_requests, {"baseline": b, "candidate": c},
                   c.output_tok_per_s / b.output_tok_per_s if ok else None,
                   ratio_over_rounds(rounds["candidate"], rounds["baseline"], level) if ok and rounds else None)

    def to_json(self) -> dict[str, Any]:
        out = {"concurrency": self.concurrency, "num_requests": self.num_requests,
               "endpoints": {r: self.endpoints[r].to_json() for r in ROLES}, "total_speedup": self.total_speedup}
        if self.total_speedup_rounds is not None:
            out["total_speedup_rounds"] = self.total_speedup_rounds
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ThroughputRow:
        return cls(int(d["concurrency"]), int(d["num_requests"]),
                   {r: EndpointFigures.from_json(e) for r, e in d["endpoints"].items()}, d.get("total_speedup"),
                   d.get("total_speedup_rounds"))


@dataclass(frozen=True)
class ThroughputTable:
    """Per tier: candidate ÷ baseline output tok/s (and over rounds at the top tier), in the shape the throughput
    gate reads: the candidate deployment is the full stack, the baseline deployment what it replaces."""

    tiers: list[ThroughputRow]
    workload_sha256: str

    @property
    def top(self) -> ThroughputRow | None:
        """The highest concurrency tier, where the throughput gate judges."""
        return self.tiers[-1] if self.tiers else None

    def to_json(self) -> dict[str, Any]:
        return {"tiers": [t.to_json() for t in self.tiers], "workload_sha256": self.workload_sha256}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ThroughputTable:
        return cls([ThroughputRow.from_json(t) for t in d["tiers"]], d["workload_sha256"])


@dataclass(frozen=True)
class DeploymentBench:
    """bench.json of a deployment sign-off as the throughput gate reads it: every tier and the hash of the
    requests (the rest of the file is provenance and configuration)."""

    tiers: list[TierRecord]
    workload_sha256: str

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DeploymentBench:
        return cls([TierRecord.from_json(t) for t in d["tiers"]], d["inputs"]["workload_sha256"])

    def table(self, level: float = CONFIDENCE) -> ThroughputTable:
        """The throughput table, its intervals over rounds at `level` (95%, or 1 - a sweep's family-wise share
        of a candidate)."""
        return ThroughputTable([ThroughputRow.from_tier(t, level) for t in self.tiers], self.workload_sha256)
