"""What the engine reports about itself (`Engine.stats()`): typed, so the Prometheus exporter and the benchmarks
read fields, not keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from .params import SpeculativeUsage


@dataclass(frozen=True)
class SpeculativeStats:
    """Engine-wide speculative decoding counters since start, and the load-aware policy's cost estimates."""

    proposer: str = ""
    num_speculative_tokens: int = 0
    max_verify_tokens: int = 0
    verify_steps: int = 0  # sequence-verifications that carried at least one proposal
    draft_tokens: int = 0
    accepted_tokens: int = 0
    proposed_at: list[int] = field(default_factory=list)  # per draft position: how often a token was proposed
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted
    steps_with_speculation: int = 0
    steps_without_speculation: int = 0  # decode steps where the policy or the proposer gave nothing
    proposer_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forward + acceptance of steps that carried proposals
    draft_cost_ratio: float = 0.0  # policy estimate: one draft step / one verification forward
    verify_cost_per_token: float = 0.0  # policy estimate: a step's extra time per verified draft token

    @property
    def usage(self) -> SpeculativeUsage:
        return SpeculativeUsage(self.draft_tokens, self.accepted_tokens, self.verify_steps)

    @property
    def acceptance_rate(self) -> float:
        return self.usage.acceptance_rate

    @property
    def mean_accepted_length(self) -> float:
        return self.usage.mean_accepted_length

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at, strict=True)]


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0  # queued in the scheduler or in the inbox
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    block_size: int = 0
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    requests_finished: int = 0
    speculative: SpeculativeStats | None = None  # None when the engine does not speculate

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
