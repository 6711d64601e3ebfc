"""How many tokens each running sequence speculates this step.

Per sequence, k adapts to recent acceptance (HF assisted generation's schedule): all accepted -> k+1, any
rejection -> k-1 (at least 1); when the moving acceptance rate collapses the sequence pauses for a few steps
and then probes again with k = 1.

Per step, speculation only fills the part of the batch where extra tokens are (nearly) free: a verification
forward's cost grows with the total number of tokens in the step, so proposals are added only while the step
holds at most `max_verify_tokens` tokens. Past that the batch itself keeps the matmuls busy and speculating
would cost more target compute than the accepted tokens save.

Default 8, from the fp32 cost curve of this CPU (MEASUREMENTS.md, plain-torch decoder): a step of 1 token
costs 55 ms, 5 tokens (4-token verification) 1.50x that, 8 tokens 1.55x, 32 tokens 3.05x. Up to ~8 tokens a
step is bound by streaming the weights, so drafts ride along nearly free; past it cost grows with tokens and a
draft token must be accepted with probability above ~0.7 (plus the draft model's own cost) to pay for itself.
With prompt-lookup acceptance of 0.3-0.5 on chat prompts (MEASUREMENTS.md) that is a loss, so at 8 or more
running sequences speculation is off and the engine decodes exactly as without it. A re-measurement of the curve
on the shared machine (load average ~10 on 2 cores, /tmp/spec/verify_cost.log) gave step times of 1-8 s with
no ordering between 1 and 9 tokens, i.e. noise: the setting stays tunable (`max_verify_tokens`) for a quiet box.
"""

from __future__ import annotations

from ..sequence import Sequence

DEFAULT_MAX_VERIFY_TOKENS = 8


class SpeculationPolicy:
    def __init__(self, num_speculative_tokens: int, max_verify_tokens: int = DEFAULT_MAX_VERIFY_TOKENS,
                 adaptive: bool = True, min_acceptance: float = 0.2, cooldown_steps: int = 8,
                 smoothing: float = 0.3):
        self.max_k = num_speculative_tokens
        self.max_verify_tokens = max_verify_tokens
        self.adaptive = adaptive
        self.min_acceptance, self.cooldown_steps, self.smoothing = min_acceptance, cooldown_steps, smoothing

    def wanted_k(self, seq: Sequence) -> int:
        if seq.spec_k is None:
            seq.spec_k = self.max_k
        if seq.spec_cooldown > 0:
            seq.spec_cooldown -= 1
            return 0
        return seq.spec_k if self.adaptive else self.max_k

    def plan(self, candidates: list[tuple[Sequence, int]], step_tokens: int) -> list[int]:
        """k for each (sequence, most it may take) that could speculate, given the step's other tokens.

        The spare tokens under max_verify_tokens go one at a time, round robin, to the sequences with the best
        recent acceptance first, so a single stream gets its whole k and a growing batch shares a shrinking pool.
        """
        ks = [0] * len(candidates)
        spare = self.max_verify_tokens - step_tokens
        if spare <= 0 or not candidates:
            return ks
        wants = [min(self.wanted_k(seq), cap) for seq, cap in candidates]
        order = sorted(range(len(candidates)), key=lambda i: -candidates[i][0].spec_acceptance)
        while spare > 0:
            given = False
            for i in order:
                if spare > 0 and ks[i] < wants[i]:
                    ks[i] += 1
                    spare -= 1
                    given = True
            if not given:
                break
        return ks

    def update(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """After verification of `proposed` tokens of which the first `accepted` were kept."""
        if proposed <= 0:
            return
        rate = accepted / proposed
        seq.spec_acceptance += self.smoothing * (rate - seq.spec_acceptance)
        if not self.adaptive:
            return
        k = seq.spec_k or self.max_k
        seq.spec_k = min(k + 1, self.max_k) if accepted == proposed else max(k - 1, 1)
        if seq.spec_acceptance < self.min_acceptance:
            seq.spec_cooldown = self.cooldown_steps
            seq.spec_k = 1
            seq.spec_acceptance = self.min_acceptance * 2  # probe again from a neutral estimate
