"""Accept or reject a sequence's proposed tokens against the target's logits from one verification forward.

Row i of `logits` is the target's distribution for the token after proposal[:i], so k proposals give k+1 rows.
Greedy: keep the longest prefix equal to the target's argmax, then the target's own token (correction or
bonus) — token-identical to decoding without speculation. Sampling: speculative rejection sampling (Leviathan et
al., Chen et al.): accept token x with probability min(1, p(x)/q(x)); at the first rejection draw from the
normalized residual max(0, p - q); after k acceptances draw the bonus token from p. Every emitted token is then
distributed exactly as p. A deterministic proposer (prompt lookup, greedy draft) has q = one-hot(x): accept
with probability p(x), residual is p with x removed.
"""

from __future__ import annotations

import torch

from ..params import SamplingParams
from ..sampler import warped_probs


def verify_greedy(logits: torch.Tensor, proposal: list[int]) -> list[int]:
    target = logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(proposal) and proposal[n] == target[n]:
        n += 1
    return proposal[:n] + [target[n]]


def verify_sampled(logits: torch.Tensor, proposal: list[int], draft_probs: torch.Tensor | None,
                   params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    p = warped_probs(logits, [params] * logits.shape[0])
    uniforms = torch.rand(len(proposal), generator=generator, dtype=torch.float64).tolist()
    for i, token in enumerate(proposal):
        p_x = float(p[i, token])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if uniforms[i] * q_x < p_x:  # u < p/q without dividing by a tiny q
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[token] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
            residual = p[i]
        return proposal[:i] + [int(torch.multinomial(residual, 1, generator=generator))]
    return proposal + [int(torch.multinomial(p[len(proposal)], 1, generator=generator))]


def verify(logits: torch.Tensor, proposal: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """The tokens to append: the accepted proposals followed by exactly one token drawn from the target."""
    if params.greedy:
        return verify_greedy(logits, proposal)
    return verify_sampled(logits, proposal, draft_probs, params, generator)
