"""What a caller asks of one request (SamplingParams) and what each engine step reports back (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # speculative decoding, cumulative for the request (all 0 without a proposer)
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted by the target
    num_spec_steps: int = 0  # verification steps that carried at least one proposal

    def speculative_usage(self) -> dict[str, float | int]:
        """Per-request acceptance figures for the API usage block."""
        return {"draft_tokens": self.num_draft_tokens, "accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
                "mean_accepted_length": (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps
                if self.num_spec_steps else 0.0}
