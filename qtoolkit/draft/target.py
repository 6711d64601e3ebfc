"""The target as a teacher, in plain transformers: its hidden states at the three aux layers, its final hidden
state (its next-token logits over any vocabulary subset are one matmul away), and its token embedding.

transformers' `hidden_states[j]` (output_hidden_states) is the residual stream entering decoder layer j, which is
what vLLM taps for EAGLE-3 aux layer id j; the engine exposes the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from ..errors import ModelSourceError


@dataclass
class Features:
    aux: torch.Tensor  # [T, 3 * hidden] low | middle | high
    final: torch.Tensor  # [T, hidden] after the target's final norm: logits = final @ lm_head.T
    greedy: torch.Tensor | None = None  # [T] the target's argmax over its full vocabulary (held-out rows only)


class Teacher:
    def __init__(self, path: str, aux_layer_ids: tuple[int, int, int], device: torch.device):
        try:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              use_safetensors=True).eval().to(device)
        except (OSError, ValueError) as e:
            raise ModelSourceError(f"transformers cannot load {path} as a causal LM ({str(e).splitlines()[0]}): "
                                   "pass a dense or compressed-tensors model folder") from None
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.device = device
        self.aux_layer_ids = aux_layer_ids
        self.embed_weight = self.model.get_input_embeddings().weight
        self.lm_head_weight = self.model.get_output_embeddings().weight

    @torch.inference_mode()
    def features(self, token_ids: list[int], greedy: bool = False) -> Features:
        ids = torch.tensor([token_ids], device=self.device)
        out = self.model.model(ids, output_hidden_states=True)
        hs = out.hidden_states
        aux = torch.cat([hs[j][0] for j in self.aux_layer_ids], dim=-1)
        final = out.last_hidden_state[0]
        top = (final @ self.lm_head_weight.T).argmax(-1) if greedy else None
        return Features(aux.clone(), final.clone(), top)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_weight[ids]
