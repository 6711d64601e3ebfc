"""What a task needs from a model: generate text and score token sequences. Three implementations:

- `engine` (the product path): qtoolkit's own serving engine, in process;
- `hf`: plain transformers, a cross-check that needs nothing of ours;
- `openai`: any OpenAI-compatible endpoint (`--endpoint URL`), so evaluation scales out to a vLLM deployment.

Prompts are built locally (chat template included) and sent as text, so all backends see the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import AutoTokenizer

from qtoolkit.errors import BackendError


class ScoringUnsupported(BackendError):
    """The backend generates but cannot score token sequences (an endpoint without echo + logprobs)."""


@dataclass
class GenParams:
    max_tokens: int = 128
    temperature: float = 0.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class GeneratedText:
    """One completion a backend generated for one prompt."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


@dataclass
class Scored:
    """Teacher-forced scores of one sequence of T tokens: predictions of tokens 1..T-1.

    `logprobs` (full log-softmax, [T-1, vocab]) and `top1` exist only where the backend can give them;
    `target` (log p of each actual next token, [T-1]) always does.
    """

    target: Any
    logprobs: Any = None
    top1: Any = None


class Backend(Protocol):
    name: str
    tokenizer: Any
    full_distributions: bool  # can score() return full next-token distributions (needed for KLD)?

    def describe(self) -> dict[str, Any]: ...

    def generate(self, prompts: list[str], params: GenParams) -> list[GeneratedText]: ...

    def score(self, token_ids: list[list[int]]) -> list[Scored]: ...


def truncate_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Cut `text` at the earliest stop string; report whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def scored_from_logprobs(logprobs, token_ids: list[int]) -> Scored:
    """Build a Scored from a full [T or T-1, vocab] log-softmax tensor whose row i predicts token i+1."""
    lp = logprobs[: len(token_ids) - 1].float()
    targets = torch.tensor(token_ids[1:], dtype=torch.long).view(-1, 1)
    return Scored(target=lp.gather(1, targets).squeeze(1), logprobs=lp, top1=lp.argmax(-1))


def load_tokenizer(path):
    return AutoTokenizer.from_pretrained(path)
