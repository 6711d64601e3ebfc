"""Prompt lookup (n-gram) proposer: find the sequence's last n tokens earlier in its prompt or output and propose
what followed them there. No model and no state, so it costs microseconds; it shines when the output copies from
the prompt (code edits, extractive summaries) and proposes nothing otherwise."""

from __future__ import annotations

import torch

from ..sequence import Sequence
from .base import Proposal


class NgramProposer:
    name = "ngram"
    catch_up_cost = 0.0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, window: int = 4096):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.window = window  # search only the most recent tokens: bounds the cost on very long contexts

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        history = torch.tensor(tokens[-self.window:])
        length = len(history)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pattern = history[-n:]
            # windows starting at 0 .. length-n-1: each occurrence before the suffix itself
            windows = history[:-1].unfold(0, n, 1)
            hits = (windows == pattern).all(dim=1).nonzero().flatten()
            if len(hits):
                start = int(hits[-1]) + n  # the most recent occurrence predicts best
                return history[start:start + k].tolist()
        return []

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[Proposal]:
        return [Proposal(self.lookup(seq.token_ids, k) if k > 0 else []) for seq, k in batch]

    def release(self, seq: Sequence) -> None:
        pass

    def catch_up_tokens(self, seq: Sequence) -> int:
        return 0
