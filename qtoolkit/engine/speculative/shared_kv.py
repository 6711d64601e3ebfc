"""A self-draft that reads the target's KV cache: no draft prefill, no second cache.

A quantized copy of the target has the target's layer shapes, so its attention can read the target's cache as it
is. The draft attends over the context the target already computed and writes K/V only for the tokens it feeds
(the last accepted token and its own drafts), into the slots the engine has just reserved for verification. The
verification pass writes the target's K/V into those same slots, layer by layer, before any of them is read, so the
target never sees a draft value; slots of rejected drafts are rolled back with the sequence as before.

Against a draft with its own cache (draft.py) this removes the draft's prefill: a 250-token summarization prompt
cost the INT4 draft about as long to catch up on as the fp32 target took to prefill it, which made a self-draft a
loss at batch 1 before a 50-token answer.
"""

from __future__ import annotations

import torch

from ...model.llama import LlamaModel
from ..model_runner import ModelRunner
from ..sequence import Sequence
from .base import Proposal
from .draft import Drafting, draft_generator, draft_steps
from .handle import KVHandle


def shares_kv_layout(draft: LlamaModel, target: LlamaModel) -> bool:
    """Whether the draft's attention can read the target's cache: same layers, KV heads, head size, dtype and
    sliding windows (blocks the target frees outside its windows are gone for the draft too)."""
    a, b = draft.config, target.config
    return ((a.num_layers, a.num_kv_heads, a.head_dim, a.vocab_size) == (b.num_layers, b.num_kv_heads, b.head_dim,
                                                                         b.vocab_size)
            and draft.dtype == target.dtype
            and [a.layer_window(i) for i in range(a.num_layers)] == [b.layer_window(i) for i in range(b.num_layers)])


class SharedKVDraftProposer:
    catch_up_cost = 0.0  # never behind: the target's cache already holds the context

    def __init__(self, model: LlamaModel, target_runner: ModelRunner, name: str, layer_ids: list[int] | None = None):
        """`layer_ids`: the target layer behind each of the draft's layers when the draft is a subset of the
        target's own layers (layer_skip.py); they read and write their own slices of the target's cache."""
        self.name = name
        self.model = model
        self.runner = ModelRunner(model, target_runner.num_blocks, target_runner.block_size, shared=target_runner,
                                  layer_ids=layer_ids)
        self.generators: dict[str, torch.Generator] = {}

    def _drafting(self, index: int, seq: Sequence, k: int) -> Drafting:
        """The target sequence as the draft feeds it: its blocks (only read and written in the reserved slots,
        never grown or freed here) and computed prefix."""
        if not seq.params.greedy and seq.request_id not in self.generators:
            self.generators[seq.request_id] = draft_generator(seq)
        done = seq.num_computed_tokens
        view = KVHandle(block_table=seq.block_table, num_computed_tokens=done, token_ids=seq.token_ids[:done])
        return Drafting(index, seq, view, k, seq.token_ids[done:])

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Sequence, int]]) -> list[Proposal]:
        """k autoregressive draft steps, batched over the sequences; the engine has reserved blocks for
        len(seq) + k positions, and the draft writes at most len(seq) + k - 1 of them."""
        out = [Proposal([]) for _ in batch]
        draft_steps(self.runner, [self._drafting(i, seq, k) for i, (seq, k) in enumerate(batch) if k > 0], out,
                    self.generators)
        return out

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.request_id, None)

    def catch_up_tokens(self, seq: Sequence) -> int:
        return 0  # the target's cache already holds the context
