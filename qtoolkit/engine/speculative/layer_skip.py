"""Self-speculation by layer skipping (`self-skip`, `self-skip:K`): K of the target's own layers (its first
ceil(K/2) and last floor(K/2)), its final norm and its LM head are the draft. Draft & Verify (Zhang et al. 2023)
and SWIFT (Xia et al. 2024) skip middle layers of an untrained target this way; LayerSkip's early exit (Elhoushi
et al. 2024, first K layers only) needs a model trained for it. On SmolLM2-135M, teacher-forced over a code and
a summarization answer, the draft's argmax matched the target's on 22% of tokens keeping the first and last 10
of 30 layers, 6-8% keeping 16 (first 16, or first and last 8), 0-1% keeping the first 12 and last 4: a model
this small needs most of its depth, so the cost model mostly turns the draft off there.

Nothing is copied or trained, so any target drafts this way, a quantized checkpoint included (its quantized
layers are the draft's), at no extra memory. The kept layers are the target's modules and read and write their
own slices of the target's KV cache: for the context they hold exactly what the draft would have computed (layer
i < K sees the same inputs in both), so the draft needs no prefill and no cache of its own. Its K/V writes for
drafted positions land in the slots the engine reserved for verification, which the target overwrites layer by
layer before reading (as for shared_kv.py).

`self-skip` leaves K to the engine: a few depths are drafted from in turn and DepthChooser (policy.py) keeps the
one whose measured acceptance and draft-step cost give the largest expected speedup; `self-skip:K` pins K.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ...model.llama import LlamaModel
from ..model_runner import ModelRunner
from ..sequence import Sequence
from ..speculative_spec import SpeculativeConfigError
from .base import Proposal
from .policy import DepthChooser, SpeculationPolicy
from .shared_kv import SharedKVDraftProposer

# the depths `self-skip` tries, as fractions of the target's layers: below half the depth an untrained draft
# rarely agrees with its target, and past four fifths a draft step costs most of a target step
AUTO_DEPTH_FRACTIONS = (0.5, 0.65, 0.8)


def auto_depths(num_layers: int) -> list[int]:
    """The K values `self-skip` chooses among for a target of `num_layers` layers."""
    return sorted({min(num_layers - 1, max(1, round(f * num_layers))) for f in AUTO_DEPTH_FRACTIONS})


def kept_layers(num_layers: int, depth: int) -> list[int]:
    """The target layers a draft of `depth` layers keeps: the first ceil(depth/2) and the last floor(depth/2)
    (the last layers map the residual stream onto the vocabulary; skipping them costs most agreement)."""
    head = -(-depth // 2)
    return list(range(head)) + list(range(num_layers - (depth - head), num_layers))


def skip_view(target: LlamaModel, keep: list[int]) -> LlamaModel:
    """A LlamaModel made of the target's layers `keep` (in order), embeddings, final norm and head: the same
    module objects, so no weight is copied and a quantized target's kernels serve the draft too."""
    c = target.config
    config = replace(c, num_layers=len(keep),
                     layer_types=[c.layer_types[i] for i in keep] if c.layer_types else [])
    # a one-layer, one-position shell (cheap to build), then the target's modules and rope tables put in
    view = LlamaModel(replace(config, num_layers=1, layer_types=config.layer_types[:1], max_position_embeddings=1),
                      target.dtype)
    view.config = config
    view.layers = nn.ModuleList(target.layers[i] for i in keep)
    view.rope_index = [target.rope_index[i] for i in keep]
    view.rope_cos, view.rope_sin = target.rope_cos, target.rope_sin
    view.embed_tokens = target.embed_tokens
    view.norm = target.norm
    view.lm_head = target.lm_head
    return view.eval().bind_submodules()


class LayerSkipProposer:
    catch_up_cost = 0.0  # the kept layers' cache is the target's: nothing to catch up on

    def __init__(self, target: LlamaModel, target_runner: ModelRunner, name: str, depths: list[int]):
        layers = target.config.num_layers
        bad = [d for d in depths if not 1 <= d < layers]
        if bad:
            raise SpeculativeConfigError(f"--speculative {name}: the target has {layers} layers, so a layer-skipping "
                                         f"draft keeps 1 to {layers - 1} of them (got {bad[0]})")
        self.name = name
        self.drafts = {d: SharedKVDraftProposer(skip_view(target, keep), target_runner, name=name, layer_ids=keep)
                       for d in depths for keep in [kept_layers(layers, d)]}
        self.chooser = DepthChooser(depths)
        self.depth = self.chooser.depths[-1]  # the depth that drafted the last proposal
        self.model = self.drafts[self.depth].model  # what the Speculator reads the draft's context bound from

    def bind_policy(self, policy: SpeculationPolicy) -> None:
        """The engine's policy: its verification cost and k range weigh the depths."""
        self.chooser.policy = policy

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Sequence, int]]) -> list[Proposal]:
        self.depth = self.chooser.pick()
        return self.drafts[self.depth].propose(batch)

    def feedback(self, proposed: int, accepted: int) -> None:
        """One sequence's verification of the last proposal."""
        self.chooser.record(self.depth, proposed, accepted)

    def observe_step(self, propose_seconds: float, draft_steps: int, verify_seconds: float) -> None:
        """The last proposal's time (draft_steps sequential draft forwards) against its verification."""
        if draft_steps > 0:
            self.chooser.observe(self.depth, propose_seconds / draft_steps, verify_seconds)

    def release(self, seq: Sequence) -> None:
        for draft in self.drafts.values():
            draft.release(seq)

    def catch_up_tokens(self, seq: Sequence) -> int:
        return 0
