"""What speculation did inside the server during one bench tier, and what it could have bought at best.

The load generator sees only tokens and timings; the engine's side (draft and verify time, acceptance per draft
position, the policy's cost estimates) comes from the server's Prometheus `/metrics`, scraped before and after the
tier and differenced. From those measured costs the tier gets a ceiling: the speedup the policy's own cost model
(Leviathan et al.) allows at the measured acceptance and at perfect acceptance, first for the decode steps, then
for whole requests, where the prefill share measured on the no-spec system of the same tier does not speed up.
The ceiling is reported for concurrency 1, where a request's time is its own prefill plus its decode steps.
The model takes draft positions as independent trials of the first position's acceptance; prompt lookup's
acceptance is bursty (a match tends to run on), so it can beat the "measured acceptance" figure. The figure at
acceptance 1 is a true bound for the measured r and v: no step can emit more than k + 1 tokens. Both costs are
moving estimates from the same tier, so they carry its noise (v at batch 1 moves several-fold between runs).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from ..engine.params import SpeculativeUsage
from ..engine.speculative.policy import SpeculationPolicy
from ..engine.stats import SpeculativeStats
from ..server.metrics import parse_speculative


async def _get_metrics(base_url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(headers=headers, timeout=10.0) as client:
            resp = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


def scrape_speculative(base_url: str, api_key: str | None = None) -> SpeculativeStats | None:
    text = asyncio.run(_get_metrics(base_url, api_key))
    return parse_speculative(text) if text else None


@dataclass(frozen=True)
class TierSpeculation:
    """Engine-side speculation over one tier (a bench result's `speculative_engine`): the usage counted over the
    tier, acceptance per draft position, where the time went, and the policy's cost estimates at the tier's end."""

    usage: SpeculativeUsage = field(default_factory=SpeculativeUsage)
    acceptance_by_position: list[float] = field(default_factory=list)
    speculative_steps: int = 0
    plain_steps: int = 0
    proposer_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_cost_ratio: float = 0.0
    verify_cost_per_token: float = 0.0
    # the policy's mean draft length per sequence at each batch size it decoded at over the tier (0 = off)
    chosen_draft_length_by_batch: dict[int, float] = field(default_factory=dict)

    @property
    def proposer_share(self) -> float:
        spent = self.proposer_seconds + self.verify_seconds
        return round(self.proposer_seconds / spent, 4) if spent > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"draft_tokens": self.usage.draft_tokens, "accepted_tokens": self.usage.accepted_tokens,
                "acceptance_rate": self.usage.acceptance_rate,
                "acceptance_by_position": list(self.acceptance_by_position),
                "verifications": self.usage.verify_steps,
                "speculative_steps": self.speculative_steps, "plain_steps": self.plain_steps,
                "proposer_seconds": self.proposer_seconds, "verify_seconds": self.verify_seconds,
                "proposer_share": self.proposer_share, "draft_cost_ratio": self.draft_cost_ratio,
                "verify_cost_per_token": self.verify_cost_per_token,
                "chosen_draft_length_by_batch": {str(n): v for n, v in self.chosen_draft_length_by_batch.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TierSpeculation:
        usage = SpeculativeUsage(int(d["draft_tokens"]), int(d["accepted_tokens"]), int(d["verifications"]))
        return cls(usage, list(d["acceptance_by_position"]), int(d["speculative_steps"]), int(d["plain_steps"]),
                   d["proposer_seconds"], d["verify_seconds"], d["draft_cost_ratio"], d["verify_cost_per_token"],
                   {int(n): float(v) for n, v in d.get("chosen_draft_length_by_batch", {}).items()})


def tier_delta(before: SpeculativeStats | None, after: SpeculativeStats | None) -> TierSpeculation | None:
    """Engine-side speculation over one tier: counters differenced, the policy's cost estimates as at its end."""
    if after is None:
        return None
    before = before or SpeculativeStats()
    by_position = []
    for i, (proposed, accepted) in enumerate(zip(after.proposed_at, after.accepted_at, strict=True)):
        proposed -= before.proposed_at[i] if i < len(before.proposed_at) else 0
        accepted -= before.accepted_at[i] if i < len(before.accepted_at) else 0
        if proposed > 0:
            by_position.append(round(accepted / proposed, 4))
    usage = SpeculativeUsage(after.draft_tokens - before.draft_tokens, after.accepted_tokens - before.accepted_tokens,
                             after.verify_steps - before.verify_steps)
    return TierSpeculation(usage, by_position, after.steps_with_speculation - before.steps_with_speculation,
                           after.steps_without_speculation - before.steps_without_speculation,
                           round(after.proposer_seconds - before.proposer_seconds, 4),
                           round(after.verify_seconds - before.verify_seconds, 4),
                           round(after.draft_cost_ratio, 4), round(after.verify_cost_per_token, 4),
                           _chosen_lengths(before, after))


def _chosen_lengths(before: SpeculativeStats, after: SpeculativeStats) -> dict[int, float]:
    """Mean draft length per sequence by batch size over the tier (the counters differenced)."""
    out = {}
    for n, steps in sorted(after.steps_by_batch.items()):
        steps -= before.steps_by_batch.get(n, 0)
        if steps > 0:
            drafts = after.drafts_by_batch.get(n, 0) - before.drafts_by_batch.get(n, 0)
            out[n] = round(drafts / (steps * n), 4)
    return out


@dataclass(frozen=True)
class CeilingPoint:
    """The policy's best draft length at one acceptance, and the speedups it gives a decode step and a request."""

    best_k: int
    decode_speedup: float
    request_speedup: float

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CeilingPoint:
        return cls(int(d["best_k"]), float(d["decode_speedup"]), float(d["request_speedup"]))


@dataclass(frozen=True)
class SpeculationCeiling:
    """A bench result's `speculative_ceiling`: the best speedup the measured costs allow, at the measured
    first-position acceptance and at acceptance 1 (see speculation_ceiling)."""

    model: str
    draft_cost_ratio: float
    verify_cost_per_token: float
    prefill_share: float
    first_position_acceptance: float
    measured_acceptance: CeilingPoint
    full_acceptance: CeilingPoint

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "draft_cost_ratio": self.draft_cost_ratio,
                "verify_cost_per_token": self.verify_cost_per_token, "prefill_share": self.prefill_share,
                "first_position_acceptance": self.first_position_acceptance,
                "measured_acceptance": asdict(self.measured_acceptance),
                "full_acceptance": asdict(self.full_acceptance)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SpeculationCeiling:
        return cls(d["model"], d["draft_cost_ratio"], d["verify_cost_per_token"], d["prefill_share"],
                   d["first_position_acceptance"], CeilingPoint.from_json(d["measured_acceptance"]),
                   CeilingPoint.from_json(d["full_acceptance"]))


def speculation_ceiling(engine: TierSpeculation, *, num_speculative_tokens: int,
                        prefill_share: float) -> SpeculationCeiling:
    """Best speedup the measured costs allow: at the measured first-position acceptance, and at acceptance 1.

    decode = max over k <= K of E(a, k) / ((1 + k v) (1 + k r)), the policy's model of one step;
    request = 1 / (p + (1 - p) / decode), with p the no-spec system's share of request time spent before the first
    token (prefill), which speculation does not touch.
    """
    policy = SpeculationPolicy(num_speculative_tokens)
    policy.draft_cost, policy.verify_cost = engine.draft_cost_ratio, engine.verify_cost_per_token
    measured = engine.acceptance_by_position[0] if engine.acceptance_by_position else 0.0

    def at(a: float) -> CeilingPoint:
        k, gain = policy.best_k(a)
        gain = max(gain, 1.0)  # below 1 the policy decodes plainly
        return CeilingPoint(k, round(gain, 3), round(1.0 / (prefill_share + (1.0 - prefill_share) / gain), 3))

    return SpeculationCeiling("E(a,k) / ((1 + k v)(1 + k r)); request = 1 / (p + (1 - p) / decode)",
                              policy.draft_cost, policy.verify_cost, round(prefill_share, 4), measured, at(measured),
                              at(1.0))
