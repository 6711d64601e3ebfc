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
    # per number of decoding sequences in a step: the steps, and the draft tokens the policy gave them in all (so
    # the draft length it chose per sequence at each batch size, 0 included, is tokens / (steps * batch size))
    steps_by_batch: dict[int, int] = field(default_factory=dict)
    drafts_by_batch: dict[int, int] = field(default_factory=dict)

    def record_step(self, num_seqs: int, drafted: int) -> None:
        """One decode step of `num_seqs` sequences carrying `drafted` draft tokens in all."""
        self.steps_by_batch[num_seqs] = self.steps_by_batch.get(num_seqs, 0) + 1
        self.drafts_by_batch[num_seqs] = self.drafts_by_batch.get(num_seqs, 0) + drafted

    @property
    def chosen_length_by_batch(self) -> dict[int, float]:
        """Mean draft length per sequence the policy chose, by batch size (0.0 where it kept speculation off)."""
        return {n: round(self.drafts_by_batch.get(n, 0) / (steps * n), 4)
                for n, steps in sorted(self.steps_by_batch.items()) if steps}

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
