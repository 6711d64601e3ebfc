"""Speculation as one object: propose -> verify -> roll back, around the engine's one verification forward.

The Speculator owns the proposer, the load-aware policy, the metrics, the target KV slots reserved for drafts
and the per-request state (the policy's, and what each request's usage block reports), keyed by request id.
Drafts travel in the step's WorkItems; `seq.token_ids` only ever holds committed tokens.
"""

from __future__ import annotations

import time

import torch

from ..block_manager import BlockManager
from ..model_runner import ModelRunner
from ..params import SpeculativeUsage
from ..scheduler import WorkItem
from ..sequence import Sequence
from ..speculative_spec import SpeculativeSpec
from .base import MAX_SPECULATIVE_TOKENS, Proposer
from .builder import build_proposer
from .eagle3 import Eagle3Proposer
from .metrics import SpeculativeMetrics
from .policy import SpeculationPolicy
from .verify import verify

# a draft catches up on a long context (over CATCH_UP_MIN_TOKENS, weighed by its catch_up_cost) only when the
# request may still generate at least 1/CATCH_UP_RATIO as many tokens: a 250-token summarization prompt before a
# 50-token answer cost the self-int4 server 10-30% without this
CATCH_UP_RATIO = 2
CATCH_UP_MIN_TOKENS = 128


class Speculator:
    def __init__(self, proposer: Proposer, policy: SpeculationPolicy, metrics: SpeculativeMetrics,
                 blocks: BlockManager):
        self.proposer, self.policy, self.metrics, self.blocks = proposer, policy, metrics, blocks
        self.usage: dict[str, SpeculativeUsage] = {}
        # a head fed with the target's own hidden states: the verification forward captures them for it
        self.features = proposer if isinstance(proposer, Eagle3Proposer) else None
        self.aux_layers = self.features.aux_layers if self.features is not None else ()
        self._propose_seconds = 0.0
        if hasattr(proposer, "bind_policy"):  # a proposer that weighs its own options by the cost model
            proposer.bind_policy(policy)
        draft = getattr(proposer, "model", None)  # a draft model's context bounds the engine's
        self.max_model_len = draft.config.max_position_embeddings if draft is not None else 1 << 62

    @classmethod
    def build(cls, spec: SpeculativeSpec, model, tokenizer, runner: ModelRunner, blocks: BlockManager, *,
              num_speculative_tokens: int, max_verify_tokens: int, max_num_seqs: int, dtype: str) -> Speculator:
        # a draft's own KV holds what the target's does plus k lookahead slots per running sequence
        extra = max_num_seqs * -(-MAX_SPECULATIVE_TOKENS // blocks.block_size)
        proposer = build_proposer(spec, model, tokenizer, num_blocks=blocks.num_blocks + extra,
                                  block_size=blocks.block_size, dtype=dtype, target_runner=runner)
        return cls(proposer, SpeculationPolicy(num_speculative_tokens, max_verify_tokens),
                   SpeculativeMetrics(str(spec), num_speculative_tokens, max_verify_tokens), blocks)

    # -- propose --------------------------------------------------------------------------------------------
    def _cap(self, seq: Sequence, max_model_len: int, spare_tokens: int) -> int:
        """The most a sequence may draft: never past max_tokens (the target adds one token of its own), the
        context or the step's token budget, and nothing when catching up would cost more than drafting saves."""
        left = seq.params.max_tokens - seq.num_output_tokens - 1
        cap = max(0, min(left, max_model_len - len(seq), spare_tokens))
        behind = self.proposer.catch_up_tokens(seq) * self.proposer.catch_up_cost if cap else 0
        return 0 if behind > CATCH_UP_MIN_TOKENS and behind > CATCH_UP_RATIO * left else cap

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Target KV slots for k drafts, from free blocks only (speculation never preempts anyone)."""
        while k > 0 and not self.blocks.can_grow(seq, len(seq) + k):
            k -= 1
        if k > 0:
            self.blocks.grow(seq, len(seq) + k)  # reserved now, so the next sequence sees the rest
        return k

    def propose(self, work: list[WorkItem], max_model_len: int, token_budget: int) -> None:
        """Attach drafts to the decoding items the policy lets speculate, with target KV slots for them."""
        decoding = [item for item in work if item.decodes]
        if not decoding:
            return
        step_tokens = sum(item.num_new for item in work)
        caps = [(item.seq.request_id, self._cap(item.seq, max_model_len, token_budget - step_tokens))
                for item in decoding]
        reserved = [(item, self._reserve(item.seq, k))
                    for item, k in zip(decoding, self.policy.plan(caps, step_tokens), strict=True)]
        batch = [(item, k) for item, k in reserved if k > 0]
        if batch:
            started = time.perf_counter()
            proposals = self.proposer.propose([(item.seq, k) for item, k in batch])
            self._propose_seconds = time.perf_counter() - started
            self.metrics.proposer_seconds += self._propose_seconds
            for (item, k), proposal in zip(batch, proposals, strict=True):
                item.drafts = proposal.tokens[:k]
                item.draft_probs = proposal.draft_probs if item.drafts else None
                self.blocks.shrink(item.seq, len(item.seq) + len(item.drafts))  # a shorter proposal's reserve
        self.metrics.record_step(len(decoding), sum(len(item.drafts) for item in decoding))
        if any(item.drafts for item in decoding):
            self.metrics.steps_with_speculation += 1
        else:
            self.metrics.steps_without_speculation += 1

    # -- verify, roll back ------------------------------------------------------------------------------------
    def verify(self, item: WorkItem, logits: torch.Tensor) -> list[int]:
        """The item's accepted drafts and one token of the target's, from its 1 + k logits rows."""
        seq, k = item.seq, len(item.drafts)
        tokens = verify(logits, item.drafts, item.draft_probs, seq.params, seq.generator)
        accepted = len(tokens) - 1
        self.usage[seq.request_id] = self.usage_of(seq.request_id) + SpeculativeUsage(k, accepted, 1)
        self.policy.update(seq.request_id, k, accepted)
        self.metrics.record(k, accepted)
        if k and hasattr(self.proposer, "feedback"):
            self.proposer.feedback(k, accepted)
        return tokens

    def settle(self, item: WorkItem) -> None:
        """After the commit moved num_computed_tokens past the accepted drafts: hand back the rejected ones'
        slots (their K/V are garbage and are never registered for reuse)."""
        if item.drafts:
            self.blocks.shrink(item.seq, item.seq.num_computed_tokens)

    def observe(self, work: list[WorkItem], chosen: list[list[int]], aux: list[torch.Tensor] | None,
                seconds: float) -> None:
        """After verification, before the commit: the step's time for the policy's cost model, and the target
        features of every position the step keeps for a head that reads them."""
        if self.features is not None and aux is not None:
            self.features.observe([(item.seq.request_id, item.start, rows[:item.kept(tokens)])
                                   for item, tokens, rows in zip(work, chosen, aux, strict=True)])
        drafted = [len(item.drafts) for item in work if item.drafts]
        if drafted:
            self.metrics.verify_seconds += seconds
            self.policy.observe_cost(self._propose_seconds, max(drafted), seconds, len(work), sum(drafted))
            if hasattr(self.proposer, "observe_step"):
                self.proposer.observe_step(self._propose_seconds, max(drafted), seconds)
        elif all(item.decodes for item in work):
            self.policy.observe_plain(len(work), seconds)

    # -- per request ------------------------------------------------------------------------------------------
    def usage_of(self, request_id: str) -> SpeculativeUsage:
        return self.usage.get(request_id) or SpeculativeUsage()

    def release(self, seq: Sequence) -> None:
        """The request finished or was aborted (after its last report)."""
        self.proposer.release(seq)
        self.policy.forget(seq.request_id)
        self.usage.pop(seq.request_id, None)
