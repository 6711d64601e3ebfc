"""EAGLE-3 proposer (`--speculative eagle3:DIR`): a one-layer head trained on the target's own hidden states
(qtoolkit/draft/head.py) drafts k tokens in a chain.

The head's row at position i pairs the fused target feature of position i (three of the target's layers, captured
by the verification forward itself: no extra target work) with the embedding of token i+1, and predicts token
i+2; later chain steps feed the head's own output hidden back with the drafted token's embedding. So per request:
- after every step, the target features of the positions that step committed (prompt chunks, the last token, the
  accepted drafts) are fused and kept pending;
- at a proposal, the pending rows extend the head's KV in one call (at the first proposal that is the prompt) and
  the chain runs k - 1 more single-row steps;
- the chain's rows were computed from the head's own hidden, not the target's, so they are always dropped after
  the proposal (DraftKV.truncate), together with the last target row, which the next proposal feeds again: a
  proposal always starts from target features, whatever was accepted.
Catching up costs fc and one q/k/v projection per row (only the last row runs attention, the MLP and the head's LM
head): 1.6% of a target token's multiply-adds on SmolLM2-135M, so a long prompt does not turn the head off
(`catch_up_cost` weighs the engine's catch-up rule).

Drafts are drawn over the head's reduced vocabulary; for a sampled request q is that softmax scattered onto the
target's ids (zero elsewhere), so rejection sampling stays exact; greedy requests draft by argmax (point masses).
A request's head state survives preemption: the target recomputes the same features, which are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...draft.head import DraftKV, Eagle3Head, attend
from ...model.llama import LlamaModel
from ..sampler import warped_probs
from ..sequence import Sequence
from .base import Proposal
from .draft import draft_generator


@dataclass
class HeadState:
    """One request on the head: its KV from position `origin` on, then fused target features not yet fed."""

    kv: DraftKV
    origin: int  # the position of the head's first KV row (a prefix the target took from its cache has none)
    # fused features of positions origin + len(kv) .. known_end - 1, in chunks (one per step: no copying while a
    # request decodes plainly for many steps)
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0

    @property
    def known_end(self) -> int:
        return self.origin + len(self.kv) + self.num_pending

    def take_pending(self) -> torch.Tensor:
        rows = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = [rows]
        return rows


def catch_up_cost(head: Eagle3Head, target: LlamaModel) -> float:
    """Multiply-adds of one catch-up row (fc and q/k/v) over one target token's (every layer, the LM head)."""
    h, t = head.config, target.config
    row = 3 * h.target_hidden_size * h.hidden_size + 2 * h.hidden_size * (h.num_attention_heads + 2 *
                                                                          h.num_key_value_heads) * h.head_dim
    attn = t.hidden_size * (2 * t.num_heads + 2 * t.num_kv_heads) * t.head_dim
    return row / (t.num_layers * (attn + 3 * t.hidden_size * t.intermediate_size) + t.hidden_size * t.vocab_size)


class Eagle3Proposer:
    def __init__(self, head: Eagle3Head, target: LlamaModel, name: str):
        self.name, self.head, self.target = name, head, target
        self.aux_layers = tuple(head.config.aux_layer_ids)
        self.catch_up_cost = catch_up_cost(head, target)
        self.target_ids = head.to_target(torch.arange(head.config.draft_vocab_size))
        # the head's own embeddings where its checkpoint has them (speculators'), else the target's it shares
        self.embed_table = target.embed_tokens if head.embed_tokens is None else head.embed_tokens
        self.states: dict[str, HeadState] = {}
        self.generators: dict[str, torch.Generator] = {}

    def _embed(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long)
        return F.embedding(ids, self.embed_table).to(self.head.fc.weight.dtype)

    # -- features from the target's forwards ----------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, computed: list[tuple[str, int, torch.Tensor]]) -> None:
        """Per request (id, start, aux): the target computed positions start .. start + len(aux) - 1 with these
        aux hidden states. Their features are fused in one matmul for the whole step and kept pending."""
        news = []
        for request_id, start, aux in computed:
            st = self.states.get(request_id)
            if st is None or start > st.known_end:  # new, or a hole (never seen before a cached prefix): start over
                st = self.states[request_id] = HeadState(DraftKV.empty(self.head.config, self.head.fc.weight.dtype),
                                                         start)
            skip = st.known_end - start  # a recompute after preemption brings the same features again
            if skip < aux.shape[0]:
                news.append((st, aux[skip:]))
        if news:
            fused = self.head.fuse(torch.cat([rows for _, rows in news]).to(self.head.fc.weight.dtype))
            for (st, _), rows in zip(news, fused.split([len(r) for _, r in news]), strict=True):
                st.pending.append(rows)
                st.num_pending += len(rows)

    # -- drafting -------------------------------------------------------------------------------------------
    def _draw(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft token (a target id) from the head's logits row, and q over the full vocabulary if sampled."""
        if seq.params.greedy:
            return int(self.target_ids[int(logits.argmax())]), None
        q_draft = warped_probs(logits[None], [seq.params])[0]
        j = int(torch.multinomial(q_draft, 1, generator=self.generators[seq.request_id]))
        q = q_draft.new_zeros(self.target.config.vocab_size)
        q[self.target_ids] = q_draft
        return int(self.target_ids[j]), q

    def _first(self, st: HeadState, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the pending target rows (position p paired with token p+1): the head's KV grows by all of them;
        only the last row needs its output (hidden and logits)."""
        rows = st.take_pending()
        n = rows.shape[0]
        first = st.known_end - n
        positions = torch.arange(first, first + n)
        embeds = self._embed(seq.token_ids[first + 1:first + n + 1])
        q, k, v = self.head.qkv(embeds, rows, positions)
        st.kv.append(k.to(st.kv.k.dtype), v.to(st.kv.v.dtype))
        last = attend(q[-1:], st.kv.k.to(q.dtype), st.kv.v.to(q.dtype),
                      torch.ones(1, len(st.kv), dtype=torch.bool))
        return self.head.finish(last.reshape(1, -1), rows[-1:])

    @torch.inference_mode()
    def _propose_one(self, seq: Sequence, k: int) -> Proposal:
        st = self.states.get(seq.request_id)
        # every committed position but the last has a target feature (the last token is verified this step)
        if st is None or st.known_end != len(seq) - 1 or st.num_pending == 0:
            return Proposal([])
        if not seq.params.greedy and seq.request_id not in self.generators:
            self.generators[seq.request_id] = draft_generator(seq)
        keep = len(st.kv) + st.num_pending - 1  # after the proposal: all target rows but the last
        hidden, logits = self._first(st, seq)
        last_feature = st.pending[0][-1:].clone()  # not a view that would keep every caught-up row alive
        tokens, probs = [], []
        position = len(seq) - 1
        for step in range(k):
            token, q = self._draw(seq, logits[-1])
            tokens.append(token)
            probs.append(q)
            if step + 1 < k:
                hidden, logits = self.head.step(self._embed([token]), hidden[-1:], torch.tensor([position]), st.kv)
                position += 1
        st.kv.truncate(keep)
        st.pending, st.num_pending = [last_feature], 1
        return Proposal(tokens, None if probs[0] is None else torch.stack(probs))

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[Proposal]:
        # one request at a time: each has a dense KV of its own length (the policy keeps big batches plain)
        return [self._propose_one(seq, k) if k > 0 else Proposal([]) for seq, k in batch]

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.request_id, None)
        self.generators.pop(seq.request_id, None)

    def catch_up_tokens(self, seq: Sequence) -> int:
        st = self.states.get(seq.request_id)
        return len(seq) - 1 if st is None else max(0, len(seq) - 1 - st.origin - len(st.kv))
