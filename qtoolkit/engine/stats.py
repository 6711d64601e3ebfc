"""What the engine reports about itself (`Engine.stats()`): typed, so the Prometheus exporter and the benchmarks
read fields, not keys."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .params import SpeculativeUsage
from .speculative.metrics import SpeculativeMetrics


@dataclass
class SpeculativeStats(SpeculativeMetrics):
    """A snapshot of the Speculator's counters since start, with the load-aware policy's cost estimates."""

    draft_cost_ratio: float = 0.0  # policy estimate: one draft step / one verification forward
    verify_cost_per_token: float = 0.0  # policy estimate: a step's extra time per verified draft token

    @classmethod
    def snapshot(cls, metrics: SpeculativeMetrics, *, draft_cost_ratio: float,
                 verify_cost_per_token: float) -> SpeculativeStats:
        copied = {f.name: v.copy() if isinstance(v := getattr(metrics, f.name), list | dict) else v
                  for f in fields(metrics)}
        return cls(**copied, draft_cost_ratio=draft_cost_ratio, verify_cost_per_token=verify_cost_per_token)

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
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), fp8 or int8
    kv_bytes_per_token: int = 0  # K and V over all layers, scales included
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    requests_finished: int = 0
    speculative: SpeculativeStats | None = None  # None when the engine does not speculate
    batching: str = "continuous"  # the scheduler's mode now (Engine.set_mode switches it)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.kv_blocks_total * self.block_size

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class EngineMode:
    """What an engine runs as now: its batching, whether it speculates, and the proposer it has loaded (None:
    started without one, so speculation cannot be switched on)."""

    batching: str
    speculating: bool
    proposer: str | None

    def to_json(self) -> dict[str, str | bool | None]:
        return {"batching": self.batching, "speculating": self.speculating, "proposer": self.proposer}
