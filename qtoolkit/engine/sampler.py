"""Next-token choice: greedy, temperature, top-k, top-p, each sampled row drawn from its request's generator.

The filters run batched over the rows that sample; only the final draw is per row, because each request owns
a seeded torch.Generator: its tokens then depend on its seed alone, not on which requests share the batch.
"""

from __future__ import annotations

import torch

from .params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [R, V] outside each row's top-k and nucleus (top_k 0 = off, top_p 1 = off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)
    remove = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # drop a token when the tokens ranked above it already reach top_p; the top token always stays
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def warped_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from: temperature, then top-k / top-p, then softmax."""
    sub = logits.float()
    temps = torch.tensor([p.temperature for p in params], dtype=sub.dtype)
    sub = sub / temps[:, None]
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=sub.dtype)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sub = apply_top_k_top_p(sub, top_k, top_p)
    return sub.softmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [R, V] float32, one row per request -> one token id per row."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens.tolist()
    probs = warped_probs(logits.index_select(0, torch.tensor(rows)), [params[i] for i in rows])
    out = tokens.tolist()
    for j, i in enumerate(rows):
        out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    return out
