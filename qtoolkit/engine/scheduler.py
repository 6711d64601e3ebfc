"""Decides, every step, which sequences run and how many tokens each brings.

Continuous batching: running sequences go first (FCFS), each taking one decode token or its next prefill
chunk from a per-step token budget; waiting sequences then join while budget, sequence slots and KV blocks
last. When blocks run out, the latest-arrived running sequence is preempted by recompute: its blocks are freed
and it re-enters the front of the queue with its prompt plus the tokens generated so far, so its output is
the same as if it had never been interrupted. `static` batching (the baseline) admits a new batch only once
the previous batch has completely finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class WorkItem:
    """One sequence's share of a step: its next `num_new` uncomputed tokens, then any draft tokens to verify.

    The drafts travel here, never in `seq.token_ids`, which holds only committed tokens."""

    seq: Sequence
    num_new: int
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # q of each draft token [len(drafts), vocab]; None = point masses
    yields_token: bool = field(init=False)  # the step reaches the sequence's last token, so it samples the next

    def __post_init__(self) -> None:
        self.yields_token = self.seq.num_computed_tokens + self.num_new == len(self.seq)

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def tokens(self) -> list[int]:
        start = self.seq.num_computed_tokens
        return self.seq.token_ids[start:start + self.num_new] + self.drafts

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    @property
    def num_logits(self) -> int:
        """Rows that need logits: the last one when the step yields a token, plus one per draft verified."""
        return (1 + len(self.drafts)) if self.yields_token else 0

    def kept(self, tokens: list[int]) -> int:
        """How many fed tokens keep their K/V once `tokens` are chosen: the sequence's own, and the accepted
        drafts (all chosen tokens but the target's own last one, which is fed next step)."""
        return self.num_new + (len(tokens) - 1 if self.drafts else 0)

    @property
    def decodes(self) -> bool:
        """A plain decode: one committed token in, one token out (the only kind that may speculate)."""
        return self.num_new == 1 and self.yields_token


@dataclass
class ScheduledStep:
    work: list[WorkItem] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.work)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 batching: str = "continuous", watermark: float = 0.01):
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.batching = batching
        # blocks kept free when admitting new work, so running sequences can decode a while before preempting
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        # keep the queue in arrival order: preempted sequences arrived before everything still waiting
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival < seq.arrival:
            i += 1
        self.waiting.insert(i, seq)
        step.preempted.append(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        if self.batching == "static" and not self.running:
            while self.waiting and len(self.running) < self.max_num_seqs:
                self._admit(self.waiting.popleft())
        # 1. running sequences, oldest first; the newest are preempted when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                self._preempt(self.running[-1], step)
                if seq.status is SequenceStatus.WAITING:  # it was the newest itself
                    break
            if seq.status is SequenceStatus.WAITING:
                break
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            step.work.append(WorkItem(seq, n))
            budget -= n
            i += 1
        # 2. waiting sequences join while budget, slots and blocks last (not right after a preemption)
        if self.batching == "continuous" and not step.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                cached = self.blocks.match_prefix(seq)
                computed = len(cached) * self.blocks.block_size
                n = min(len(seq) - computed, budget)
                needed = self.blocks.blocks_needed(computed + n) - len(cached)
                # a cached block that sits in the free list is taken out of it by reuse, not allocated
                free_cached = sum(1 for b in cached if self.blocks.blocks[b].ref_count == 0)
                reserve = self.watermark_blocks if self.running else 0  # an idle engine must always admit
                if needed + free_cached + reserve > self.blocks.num_free_blocks:
                    break
                self.waiting.popleft()
                self._admit(seq, cached)
                self.blocks.grow(seq, seq.num_computed_tokens + n)
                step.work.append(WorkItem(seq, n))
                budget -= n
        return step

    def _admit(self, seq: Sequence, cached: list[int] | None = None) -> None:
        if cached is None:
            cached = self.blocks.match_prefix(seq)
        self.blocks.take_prefix(seq, cached)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
