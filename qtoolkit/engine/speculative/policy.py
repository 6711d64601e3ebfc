"""How many tokens each running sequence speculates this step.

Per sequence, k adapts to recent acceptance (HF assisted generation's schedule): all accepted -> k+1, any
rejection -> k-1 (at least 1); when the moving acceptance rate collapses the sequence pauses for a few steps
and then probes again with k = 1.

Per step, speculation only fills the part of the batch where extra tokens are (nearly) free: a verification
forward's cost grows with the total number of tokens in the step, so proposals are added only while the step
holds at most `max_verify_tokens` tokens. Past that the batch itself keeps the matmuls busy and speculating
would cost more target compute than the accepted tokens save.

Default 8: measured with the fp32 default model on this 2-core AVX2 CPU (/tmp/spec/verify_cost.json, context
256, min of 3): a step of 1 sequence x 5 tokens costs ~1.5x a 1-token step and 1 x 9 tokens ~2x, while 8
sequences x 1 token already cost ~2-2.5x a 1-token step; MEASUREMENTS.md agrees (4-token verification 1.34-2.5x
a 1-token step depending on the matmul path, fp32 1.50x). With acceptance around 0.6-0.8 the expected tokens per
verification of k=4..7 drafts (2.3-3.5) stay above that cost up to ~8 tokens a step and fall below it beyond,
so at 8 or more running sequences speculation is off and the engine decodes exactly as without it.
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
