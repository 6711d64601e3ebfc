"""What a caller asks of one request (SamplingParams) and what each engine step reports back (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import QToolError


class EngineInputError(QToolError):
    """A request the engine cannot serve as given (too long, bad sampling parameters)."""


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # a seeded request samples the same tokens whatever batch it runs in
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise EngineInputError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise EngineInputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise EngineInputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise EngineInputError("stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculativeUsage:
    """What speculation did for some requests: the one speculative-usage type (a request's running figures in the
    Speculator and its RequestOutput, the API usage block, a bench tier's summary, the engine's stats and the
    difference of two /metrics scrapes) and the one place its derived figures are computed."""

    draft_tokens: int = 0  # tokens proposed and verified
    accepted_tokens: int = 0  # of those, accepted by the target
    verify_steps: int = 0  # verifications that carried at least one proposal

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: the accepted drafts plus the target's own token."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def __add__(self, other: SpeculativeUsage) -> SpeculativeUsage:
        return SpeculativeUsage(self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens,
                                self.verify_steps + other.verify_steps)

    def as_dict(self) -> dict[str, float | int]:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "verify_steps": self.verify_steps, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeUsage:
        """A usage block as a server sent it; a block that gives only the mean accepted length (no verify_steps)
        gets its verifications back from it."""
        drafted, accepted = int(d.get("draft_tokens", 0)), int(d.get("accepted_tokens", 0))
        steps = d.get("verify_steps")
        if steps is None:
            length = d.get("mean_accepted_length") or 0.0
            steps = round(accepted / (length - 1)) if length > 1 else 0
        return cls(drafted, accepted, int(steps))


@dataclass
class RequestOutput:
    """One request's report from one step: the delta since the last report plus the cumulative output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    text: str
    token_ids: list[int]
    # speculative decoding, cumulative for the request (all 0 without a proposer): the API usage block's figures
    speculative: SpeculativeUsage = field(default_factory=SpeculativeUsage)
