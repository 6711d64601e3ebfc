"""Draft-model proposer (Leviathan et al.): a cheaper model with the target's vocabulary runs k autoregressive
steps per sequence, batched over all speculating sequences, in a paged KV cache of its own.

Each target request has a KV handle here (handle.py) holding the draft's KV. Nothing is rolled back eagerly: at
the next proposal the handle's tokens are compared with the target's, and its computed count and blocks are cut
back to the longest common prefix (the accepted tokens), so rejected drafts' slots are freed and overwritten.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...model.llama import LlamaModel
from ..block_manager import BlockManager
from ..model_runner import ModelRunner
from ..sampler import warped_probs
from ..sequence import Sequence
from .base import Proposal
from .handle import KVHandle


def draft_generator(seq: Sequence) -> torch.Generator:
    """The draft's own stream of randomness for a sampled request, seeded from it so seeded runs repeat."""
    gen = torch.Generator()
    gen.manual_seed(seq.params.seed + 1 if seq.params.seed is not None else int(gen.seed()))
    return gen


def sample_drafts(logits: torch.Tensor, seqs: list[Sequence],
                  generators: dict[str, torch.Generator]) -> tuple[list[int], list[torch.Tensor | None]]:
    """Greedy rows take the argmax; sampled rows draw from their warped distribution q, which is kept for the
    rejection test."""
    tokens = logits.argmax(dim=-1).tolist()
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        q = warped_probs(logits.index_select(0, torch.tensor(rows)), [seqs[i].params for i in rows])
        for j, i in enumerate(rows):
            tokens[i] = int(torch.multinomial(q[j], 1, generator=generators[seqs[i].request_id]))
            probs[i] = q[j]
    return tokens, probs


@dataclass
class Drafting:
    """One request during k draft steps: where its proposal goes, its draft-side KV and the tokens fed next."""

    index: int  # into the proposals being built
    seq: Sequence
    kv: KVHandle
    k: int
    feed: list[int]  # the committed tokens the draft has not seen, then each step's draft token


def draft_steps(runner: ModelRunner, active: list[Drafting], out: list[Proposal],
                generators: dict[str, torch.Generator]) -> None:
    """k autoregressive draft steps, batched: each step feeds every request's unseen tokens and drafts one more."""
    draft_probs: dict[int, list[torch.Tensor]] = {}
    step = 0
    while active:
        logits = runner.forward([a.kv.feed(a.feed) for a in active])
        tokens, probs = sample_drafts(logits, [a.seq for a in active], generators)
        for a, token, q in zip(active, tokens, probs, strict=True):
            a.kv.computed(a.feed)
            a.feed = [token]
            out[a.index].tokens.append(token)
            if q is not None:
                draft_probs.setdefault(a.index, []).append(q)
        step += 1
        active = [a for a in active if step < a.k]
    for i, rows in draft_probs.items():
        out[i].draft_probs = torch.stack(rows)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    catch_up_cost = 1.0  # a draft model's catch-up token costs about what the target's prefill token does

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, name: str = "draft"):
        self.name = name
        self.model = model
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.handles: dict[str, KVHandle] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.last_used: dict[str, float] = {}

    def _handle(self, seq: Sequence) -> tuple[KVHandle, list[int]]:
        """The request's draft KV cut back to what still matches its tokens, and the tokens to feed next."""
        kv = self.handles.get(seq.request_id)
        if kv is None:
            kv = self.handles[seq.request_id] = KVHandle()
            if not seq.params.greedy:
                self.generators[seq.request_id] = draft_generator(seq)
        # the last token must always be fed, so a fully matching handle still recomputes it
        keep = min(common_prefix(kv.token_ids, seq.token_ids), len(seq) - 1)
        kv.truncate(keep)
        self.blocks.shrink(kv, keep)
        self.last_used[seq.request_id] = time.monotonic()
        return kv, seq.token_ids[keep:]

    def _reserve(self, kv: KVHandle, num_tokens: int, keep: set[str]) -> bool:
        """Blocks for `num_tokens` draft KV slots, evicting handles of requests not in this step (LRU)."""
        while not self.blocks.can_grow(kv, num_tokens):
            idle = [r for r in self.handles if r not in keep]
            if not idle:
                return False
            self.release_id(min(idle, key=self.last_used.__getitem__))
        self.blocks.grow(kv, num_tokens)
        return True

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Sequence, int]]) -> list[Proposal]:
        out = [Proposal([]) for _ in batch]
        active: list[Drafting] = []
        in_step = {seq.request_id for seq, k in batch if k > 0}
        for i, (seq, k) in enumerate(batch):
            if k <= 0:
                continue
            kv, feed = self._handle(seq)
            # KV for every token fed: the sequence so far plus the first k-1 drafts (the k-th is never fed)
            if self._reserve(kv, len(seq) + k - 1, in_step):
                active.append(Drafting(i, seq, kv, k, feed))
        draft_steps(self.runner, active, out, self.generators)
        return out

    def release_id(self, request_id: str) -> None:
        kv = self.handles.pop(request_id, None)
        if kv is not None:
            self.blocks.release(kv)
        self.generators.pop(request_id, None)
        self.last_used.pop(request_id, None)

    def release(self, seq: Sequence) -> None:
        self.release_id(seq.request_id)

    def catch_up_tokens(self, seq: Sequence) -> int:
        kv = self.handles.get(seq.request_id)
        done = 0 if kv is None else common_prefix(kv.token_ids, seq.token_ids)
        return max(0, len(seq) - 1 - done)
