"""Draft-model proposer (Leviathan et al.): a cheaper model with the target's vocabulary runs k autoregressive
steps per sequence, batched over all speculating sequences, in a paged KV cache of its own.

Each target sequence has a shadow sequence here holding the draft's KV. Nothing is rolled back eagerly: at the
next proposal the shadow is compared with the target's tokens, and its computed count and blocks are cut back
to the longest common prefix (the accepted tokens), so rejected drafts' slots are freed and overwritten.
"""

from __future__ import annotations

import time

import torch

from ...model.llama import LlamaModel
from ..block_manager import BlockManager
from ..model_runner import ModelRunner
from ..params import SamplingParams
from ..sampler import warped_probs
from ..sequence import Sequence
from .base import Proposal

GREEDY = SamplingParams()


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


def draft_steps(runner: ModelRunner, active: list[tuple[int, Sequence, Sequence, int]], out: list[Proposal],
                generators: dict[str, torch.Generator]) -> None:
    """k autoregressive draft steps, batched: `active` holds (index into out, target sequence, the sequence the
    draft feeds, k); each step feeds every fed sequence's unseen tokens and appends one draft token to it."""
    draft_probs: dict[int, list[torch.Tensor]] = {}
    step = 0
    while active:
        work = [(fed, len(fed) - fed.num_computed_tokens) for _, _, fed, _ in active]
        logits = runner.run(work, [1] * len(work))
        tokens, probs = sample_drafts(logits, [seq for _, seq, _, _ in active], generators)
        still = []
        for (i, seq, fed, k), (_, n), token, q in zip(active, work, tokens, probs, strict=True):
            fed.num_computed_tokens += n
            fed.token_ids.append(token)
            out[i].tokens.append(token)
            if q is not None:
                draft_probs.setdefault(i, []).append(q)
            if step + 1 < k:
                still.append((i, seq, fed, k))
        active = still
        step += 1
    for i, rows in draft_probs.items():
        out[i].draft_probs = torch.stack(rows)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, name: str = "draft"):
        self.name = name
        self.model = model
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.shadows: dict[str, Sequence] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.last_used: dict[str, float] = {}

    def _shadow(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = self.shadows[seq.request_id] = Sequence(seq.request_id, seq.token_ids, GREEDY)
            if not seq.params.greedy:
                self.generators[seq.request_id] = draft_generator(seq)
        keep = min(shadow.num_computed_tokens, common_prefix(shadow.token_ids, seq.token_ids))
        # the last token must always be fed, so a fully matching shadow still recomputes it
        keep = min(keep, len(seq) - 1)
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = keep
        self.blocks.shrink(shadow, keep)
        self.last_used[seq.request_id] = time.monotonic()
        return shadow

    def _reserve(self, shadow: Sequence, num_tokens: int, keep: set[str]) -> bool:
        """Blocks for `num_tokens` draft KV slots, evicting shadows of sequences not in this step (LRU)."""
        while not self.blocks.can_grow(shadow, num_tokens):
            idle = [r for r in self.shadows if r not in keep]
            if not idle:
                return False
            self.release_id(min(idle, key=self.last_used.__getitem__))
        self.blocks.grow(shadow, num_tokens)
        return True

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Sequence, int]]) -> list[Proposal]:
        out = [Proposal([]) for _ in batch]
        active: list[tuple[int, Sequence, Sequence, int]] = []  # (index, target seq, shadow, k)
        in_step = {seq.request_id for seq, k in batch if k > 0}
        for i, (seq, k) in enumerate(batch):
            if k <= 0:
                continue
            shadow = self._shadow(seq)
            # KV for every token fed: the sequence so far plus the first k-1 drafts (the k-th is never fed)
            if self._reserve(shadow, len(seq) + k - 1, in_step):
                active.append((i, seq, shadow, k))
        draft_steps(self.runner, active, out, self.generators)
        return out

    def release_id(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.blocks.release(shadow)
        self.generators.pop(request_id, None)
        self.last_used.pop(request_id, None)

    def release(self, seq: Sequence) -> None:
        self.release_id(seq.request_id)

    def catch_up_tokens(self, seq: Sequence) -> int:
        shadow = self.shadows.get(seq.request_id)
        done = 0 if shadow is None else min(shadow.num_computed_tokens, common_prefix(shadow.token_ids, seq.token_ids))
        return max(0, len(seq) - 1 - done)
