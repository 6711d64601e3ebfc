"""The target's own quantized copy as its draft (`self-int4`, `self-fp8`): same weights rounded to a cheaper
format in memory, so it shares the tokenizer, embeddings and norms and agrees with the target most of the time.

Quantization uses the project's reference quantizer (RTN, exactly what `qtool quantize` writes for these
schemes) and the kernels' Linear modules, so the draft runs the same quantized matmuls a shipped checkpoint would.
"""

from __future__ import annotations

import torch
from qtoolkit.kernels.reference import quantize_weight
from torch import nn

from ...model.llama import LlamaModel, RMSNorm
from ...model.moe import SparseMoE
from ...model.quant_linear import DenseLinear, make_linear
from ..speculative_spec import SpeculativeConfigError

# Group 32 with zero points lines up with the default model's Q4_1 blocks (scale + min per 32 weights), so the
# draft agrees with the target: on 4 mixed prompts at batch 1, 33 of 36 drafts are accepted vs 6 of 12 for
# symmetric group 32, and group 64 diverges within tokens (counts without a result file in measurements/).
INT4_SCHEME = {"format": "pack-quantized",
               "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}
FP8_SCHEME = {"format": "float-quantized",
              "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                    "strategy": "token"}}
SCHEMES = {"int4": INT4_SCHEME, "fp8": FP8_SCHEME}
# The INT4 draft's head stays INT8 per channel, as in the default model's GGUF (Q4_1 layers, Q8_0 output): an
# INT4 head cost acceptance on summarization prompts (0.73 with it vs 0.9 with INT8, measured at batch 1), and
# the INT8 head adds ~0.5 ms to a ~10 ms draft step.
HEAD_SCHEMES = {"int4": {"format": "pack-quantized",
                         "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}},
                "fp8": FP8_SCHEME}


def _dense_weight(module: nn.Module, name: str) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise SpeculativeConfigError(f"cannot make a quantized self-draft: {name} of the target is already "
                                     "quantized; use --speculative self-skip (its own layers, any checkpoint) or "
                                     "serve the full-precision model")
    return weight


def quantize_copy(target: LlamaModel, kind: str) -> LlamaModel:
    """A LlamaModel sharing the target's embeddings and norms, its Linears (lm_head included) quantized."""
    if kind not in SCHEMES:
        raise SpeculativeConfigError(f"self-draft format {kind!r} is unknown: use self-int4 or self-fp8")
    scheme = SCHEMES[kind]

    def quantized(module: nn.Module, name: str, scheme: dict = scheme) -> nn.Module:
        weight = _dense_weight(module, name).float()
        bias = getattr(module, "bias", None)
        return make_linear(quantize_weight(weight, scheme), scheme, None if bias is None else bias.float())

    draft = LlamaModel(target.config, torch.float32)
    draft.embed_tokens = nn.Parameter(target.embed_tokens.float(), requires_grad=False)
    norms = dict(target.named_modules())
    for name, norm in draft.named_modules():  # every norm the family has (q/k norms, Gemma's sandwich included)
        if isinstance(norm, RMSNorm):
            norm.weight = nn.Parameter(norms[name].weight.float(), requires_grad=False)
    for i, (src, dst) in enumerate(zip(target.layers, draft.layers, strict=True)):
        dst.attn.qkv_proj = quantized(src.attn.qkv_proj, f"layer {i} qkv_proj")
        dst.attn.o_proj = quantized(src.attn.o_proj, f"layer {i} o_proj")
        if isinstance(src.mlp, SparseMoE):  # the router stays dense, as in a quantized checkpoint
            dst.mlp.gate = DenseLinear(_dense_weight(src.mlp.gate, f"layer {i} router").float())
        pairs = zip(src.mlp.experts, dst.mlp.experts, strict=True) if isinstance(src.mlp, SparseMoE) else \
            [(src.mlp, dst.mlp)]
        for s_mlp, d_mlp in pairs:
            d_mlp.gate_up_proj = quantized(s_mlp.gate_up_proj, f"layer {i} gate_up_proj")
            d_mlp.down_proj = quantized(s_mlp.down_proj, f"layer {i} down_proj")
    # the tied head is a fifth of an fp32 step's bytes: quantizing it too is what makes the draft cheap
    draft.lm_head = quantized(target.lm_head, "lm_head", HEAD_SCHEMES[kind])
    draft.cast_rope()
    return draft.eval().bind_submodules()
