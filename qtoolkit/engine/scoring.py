"""What Engine.score gives when asked for top-k figures only (TokenLogprobs): a server's `logprobs`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """Teacher-forced figures of one sequence, row i predicting token i+1 (the last row predicts nothing: nan):
    the log-probability of the token that follows and the top-k alternatives. It is what a server returns for
    `logprobs`, without holding the [T, vocab] rows of a long prompt."""

    target: torch.Tensor  # [T] float32
    top_values: torch.Tensor  # [T, k] float32, best first
    top_ids: torch.Tensor  # [T, k] int64

    @staticmethod
    def of(rows: torch.Tensor, token_ids: list[int], start: int, k: int) -> TokenLogprobs:
        """Rows [n, vocab] of log-softmax at positions start..start+n-1 of `token_ids`."""
        n = rows.shape[0]
        following = torch.tensor(token_ids[start + 1:start + n + 1], dtype=torch.long)
        target = torch.full((n,), float("nan"))
        target[:len(following)] = rows[:len(following)].gather(1, following[:, None])[:, 0]
        top = rows.topk(k, dim=-1) if k else (rows[:, :0], torch.zeros((n, 0), dtype=torch.long))
        return TokenLogprobs(target, top[0].clone(), top[1].clone())

    @staticmethod
    def cat(pieces: list[TokenLogprobs]) -> TokenLogprobs:
        return TokenLogprobs(*(torch.cat([getattr(p, f) for p in pieces]) for f in ("target", "top_values",
                                                                                    "top_ids")))
