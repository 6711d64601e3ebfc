"""What every proposer hands the engine: a few guessed next tokens per sequence, and the distribution they were
drawn from when that matters for rejection sampling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sequence import Sequence

MAX_SPECULATIVE_TOKENS = 16  # past this a verify step is a prefill: acceptance decays geometrically anyway


@dataclass
class Proposal:
    tokens: list[int]
    # q: the distribution row i's token was drawn from, [len(tokens), vocab]; None = the tokens were chosen
    # deterministically (prompt lookup, greedy draft), i.e. q is a point mass on each token
    draft_probs: torch.Tensor | None = None


class Proposer(Protocol):
    name: str
    # what catching up one token costs against the target prefilling one (a draft model ~1, a shared cache 0):
    # the engine weighs catch_up_tokens by it before deciding a long context is worth catching up on
    catch_up_cost: float

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[Proposal]:
        """Up to k next tokens for each (sequence, k); an empty proposal means plain decoding this step."""
        ...

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: drop any state (draft KV) kept for it."""
        ...

    def catch_up_tokens(self, seq: Sequence) -> int:
        """Tokens the proposer must process before it can draft for `seq` (a draft model's prefill); 0 if none."""
        ...
