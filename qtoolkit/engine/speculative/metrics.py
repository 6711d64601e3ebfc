"""Engine-wide speculative decoding counters: acceptance overall and per draft position, and where time goes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculativeMetrics:
    proposer: str = ""
    num_speculative_tokens: int = 0
    max_verify_tokens: int = 0
    verify_steps: int = 0  # sequence-verifications that carried at least one proposal
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted plus the target's own token, per verification
    proposed_at: list[int] = field(default_factory=list)  # per draft position: how often a token was proposed
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted
    steps_with_speculation: int = 0
    steps_without_speculation: int = 0  # decode steps where the policy or the proposer gave nothing
    proposer_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forward + acceptance of steps that carried proposals

    def record(self, proposed: int, accepted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.emitted_tokens += accepted + 1
        while len(self.proposed_at) < proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted
