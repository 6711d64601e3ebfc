"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a dense router picks top-k experts per token, and only those run.

Routing follows transformers 5.17 exactly: softmax over the router logits in float32, top-k, then the top-k
probabilities renormalised to sum to 1 (Mixtral always; Qwen3-MoE when `norm_topk_prob`). Each expert is a
SwiGLU MLP whose Linears are the engine's own (dense, INT4/INT8 packed, FP8), so every expert matmul goes through
kernels.dispatch like any other layer: on CPU the AVX2/aten paths, on CUDA the Triton kernels reading the packed
weights (dequantize-then-cuBLAS only for group sizes the Triton kernel does not take).

Tokens are grouped by expert: one sort of the flat (token, slot) assignments, then one batched call per expert
that received any token, its output scaled by the routing weight and added back with index_add_. Experts are
visited in increasing index, the order transformers adds them in, so fp32 sums are bit-for-bit the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # decoder layers whose MLP is the MoE block; the others stay dense
    # Qwen3-MoE casts the routing weights to the activations' dtype before scaling; Mixtral scales in float32
    weights_in_act_dtype: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MoEConfig | None:
        """The MoE settings of a qwen3_moe or mixtral config.json; None for dense families."""
        model_type = cfg.get("model_type")
        layers = cfg["num_hidden_layers"]
        # transformers 5 writes num_local_experts for both; Qwen's own configs say num_experts
        experts = cfg.get("num_local_experts", cfg.get("num_experts"))
        if model_type == "mixtral":
            return cls(num_experts=experts or 8, top_k=cfg.get("num_experts_per_tok", 2),
                       intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                       sparse_layers=tuple(range(layers)), weights_in_act_dtype=False)
        if model_type == "qwen3_moe":
            experts, step = 128 if experts is None else experts, cfg.get("decoder_sparse_step", 1) or 1
            dense = set(cfg.get("mlp_only_layers") or [])
            sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
            return cls(num_experts=experts, top_k=cfg.get("num_experts_per_tok", 8),
                       intermediate_size=cfg.get("moe_intermediate_size", 768),
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse,
                       weights_in_act_dtype=True)
        return None


def route(logits: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k]), as transformers computes them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, config.top_k, dim=-1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(nn.Module):
    """Router + experts. `gate` (the router, [E, hidden]) and each expert's Linears are set by the loader."""

    def __init__(self, config: MoEConfig, experts: list[nn.Module]):
        super().__init__()
        self.config = config
        self.gate: nn.Module | None = None
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        weights, experts = route(self.gate.forward(x), c)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # assignments grouped by expert, in token order within one
        counts = torch.bincount(flat, minlength=c.num_experts).tolist()  # one host sync per layer
        scale = weights.flatten().index_select(0, order).unsqueeze(1)
        tokens = order // c.top_k
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows, w = tokens[start:start + n], scale[start:start + n]
            start += n
            y = self.experts[e].forward(x.index_select(0, rows))
            y = y * w.to(y.dtype) if c.weights_in_act_dtype else (y * w).to(x.dtype)
            out.index_add_(0, rows, y)
        return out
