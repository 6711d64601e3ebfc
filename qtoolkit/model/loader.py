"""Build a LlamaModel from a ModelSource folder: dense fp32/bf16/fp16 safetensors or a compressed-tensors
checkpoint (each Linear matched to its config group by `targets` / `ignore`). GGUF sources arrive here already
converted to a safetensors folder by the resolver. Pickle weights are never read.
"""

from __future__ import annotations

from typing import Any

import torch
from compressed_tensors.utils import is_match, match_targets
from qtoolkit.kernels import cpu as cpu_paths
from safetensors import safe_open
from torch import nn

from ..errors import ModelSourceError
from . import quant_linear
from .kv_quant import StaticKVScales
from .llama import DecoderLayer, LlamaModel, ModelConfig
from .moe import SparseMoE
from .quant_linear import DenseLinear
from .sources import ModelSource

# "auto" means float32 for dense weights on an AVX2 CPU: it has no native bf16 compute, so torch's bf16 matmuls
# fall behind fp32 once a batch makes a step compute-bound, and a serving engine lives at batch >= 8; fp32 also
# reproduces transformers' greedy output token for token. bf16 wins at batch 1, where a step only streams weights
# (measurements/2026-11-30/decode-batch1-int4-vs-bf16-fp32-idle.json: 30.1 vs 17.5 tok/s): ask for it with
# dtype="bfloat16" for single-stream latency.
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float32
    if dtype not in DTYPES:
        raise ModelSourceError(f"dtype {dtype!r} is not supported: use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def read_tensors(source: ModelSource) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.path.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


# The engine matches by checkpoint tensor names, without the transformers modules: every candidate is a Linear,
# so a meta-device Linear (no storage) stands in for class targets such as "Linear".
_LINEAR = nn.Linear(1, 1, bias=False, device="meta")


def config_group_for(qconfig: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The compressed-tensors config group that quantizes Linear `name`, or None when it stays dense.

    Matching is compressed-tensors' own (`is_match` for `ignore`, `match_targets` for the most specific target:
    exact name, then `re:` regex, then class), as llm-compressor applies a recipe and vLLM loads the checkpoint;
    a later group naming the same target wins, as in `apply_quantization_config`. A group without its own
    `format` takes the checkpoint's global one, as vLLM does for older llm-compressor checkpoints."""
    if is_match(name, _LINEAR, qconfig.get("ignore") or []):
        return None
    target_to_group: dict[str, dict[str, Any]] = {}
    for group in (qconfig.get("config_groups") or {}).values():
        for target in group.get("targets") or []:
            target_to_group[target] = group
    matched = match_targets(name, _LINEAR, target_to_group)
    if not matched:
        return None
    group = target_to_group[matched[0]]
    if not group.get("format") and qconfig.get("format"):
        group = {**group, "format": qconfig["format"]}
    return group


def dense_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in the model's dtype, except that bf16 checkpoint weights under fp32 activations stay bf16 when
    the CPU ops can read them: the GEMV widens them exactly in registers, so the math is the same while a step
    streams half the bytes (the tied 49152 x 576 head of a quantized default model: 57 MB instead of 113)."""
    if weight.dtype == torch.bfloat16 and dtype == torch.float32 and cpu_paths.dense_fast_ok(weight):
        return weight.contiguous()
    return weight.to(dtype)


class LinearFactory:
    """Makes (and fuses) the Linear modules of one checkpoint, dense or quantized."""

    def __init__(self, tensors: dict[str, torch.Tensor], qconfig: dict[str, Any] | None, dtype: torch.dtype):
        self.tensors, self.qconfig, self.dtype = tensors, qconfig, dtype
        # module name -> {tensor suffix: tensor}: a MoE checkpoint holds ~10^5 tensors, too many to scan per Linear
        self.by_module: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            module, _, suffix = key.rpartition(".")
            self.by_module.setdefault(module, {})[suffix] = value
        self.quant_linear = None
        if qconfig is not None:
            if qconfig.get("quant_method", "compressed-tensors") != "compressed-tensors":
                raise ModelSourceError(f"quantization method {qconfig.get('quant_method')!r} is not supported: "
                                       "use a compressed-tensors checkpoint made by `qtool quantize`")
            self.quant_linear = quant_linear

    def has(self, name: str) -> bool:
        return name in self.by_module

    def _parts(self, name: str) -> dict[str, torch.Tensor]:
        parts = self.by_module.get(name)
        if not parts:
            raise ModelSourceError(f"checkpoint has no tensors for {name}: the folder is incomplete or not a "
                                   "LLaMA-family model")
        return parts

    def dense(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        """A dense Linear whose forward goes through kernels.dispatch (the AVX2 GEMV at small batches)."""
        return DenseLinear(dense_weight(weight, self.dtype), None if bias is None else bias.to(self.dtype))


    def make(self, names: list[str]) -> nn.Module:
        """One Linear for the concatenated outputs of `names` (fused QKV / gate-up cut per-op overhead)."""
        parts = [self._parts(n) for n in names]
        groups = [config_group_for(self.qconfig, n) if self.qconfig else None for n in names]
        if all(g is None for g in groups):
            weight = torch.cat([p["weight"] for p in parts]) if len(parts) > 1 else parts[0]["weight"]
            biases = [p.get("bias") for p in parts]
            bias = None if biases[0] is None else torch.cat(biases)
            return self.dense(weight, bias)
        if any(g is None for g in groups) or any(g != groups[0] for g in groups):
            raise ModelSourceError(f"{', '.join(names)} are quantized with different schemes: quantize them "
                                   "with one config group (the engine fuses them)")
        mods = []
        for p, g in zip(parts, groups, strict=True):
            tensors = {k: v for k, v in p.items() if k != "bias"}
            mods.append(self.quant_linear.make_linear(tensors, g, p.get("bias")))
        return self.quant_linear.fuse_linears(mods) if len(mods) > 1 else mods[0]


def layer_norm_names(layer: DecoderLayer, p: str, attn: str) -> list[tuple[nn.Module, str]]:
    """Each RMSNorm of a decoder layer with its checkpoint tensor. With Gemma's sandwich norms transformers'
    post_attention_layernorm is the attention output's norm and pre_feedforward_layernorm the MLP's input norm."""
    if layer.attn_out_norm is None:
        norms = [(layer.input_norm, "input_layernorm"), (layer.post_attn_norm, "post_attention_layernorm")]
    else:
        norms = [(layer.input_norm, "input_layernorm"), (layer.attn_out_norm, "post_attention_layernorm"),
                 (layer.post_attn_norm, "pre_feedforward_layernorm"),
                 (layer.mlp_out_norm, "post_feedforward_layernorm")]
    named = [(norm, p + name + ".weight") for norm, name in norms]
    if layer.attn.q_norm is not None:
        named += [(layer.attn.q_norm, attn + "q_norm.weight"), (layer.attn.k_norm, attn + "k_norm.weight")]
    return named


def load_model(source: ModelSource, dtype: str = "auto") -> LlamaModel:
    config = ModelConfig.from_hf(source.config)
    torch_dtype = resolve_dtype(dtype)
    tensors = read_tensors(source)
    factory = LinearFactory(tensors, source.quantization_config, torch_dtype)
    model = LlamaModel(config, torch_dtype)

    def take(name: str, dense: bool = False) -> torch.Tensor:
        if name not in tensors:
            raise ModelSourceError(f"checkpoint is missing {name}: the folder is incomplete or not a LLaMA-family "
                                   "model")
        return dense_weight(tensors[name], torch_dtype) if dense else tensors[name].to(torch_dtype)

    model.embed_tokens = nn.Parameter(take("model.embed_tokens.weight", dense=True), requires_grad=False)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        for norm, name in layer_norm_names(layer, p, attn):
            norm.weight = nn.Parameter(take(name), requires_grad=False)
        layer.attn.qkv_proj = factory.make([attn + "q_proj", attn + "k_proj", attn + "v_proj"])
        layer.attn.o_proj = factory.make([attn + "o_proj"])
        layer.attn.kv_calibrated = calibrated_kv_scales(tensors, attn, source.quantization_config,
                                                        config.num_kv_heads)
        if isinstance(layer.mlp, SparseMoE):
            load_moe(layer.mlp, factory, p)
            continue
        mlp = p + "mlp."
        layer.mlp.gate_up_proj = factory.make([mlp + "gate_proj", mlp + "up_proj"])
        layer.mlp.down_proj = factory.make([mlp + "down_proj"])
    model.norm.weight = nn.Parameter(take("model.norm.weight"), requires_grad=False)
    if config.tie_word_embeddings or "lm_head.weight" not in tensors and "lm_head.weight_packed" not in tensors:
        model.lm_head = factory.dense(model.embed_tokens, None)  # shares the embedding's storage
    else:
        model.lm_head = factory.make(["lm_head"])
    model.cast_rope()
    return model.eval().bind_submodules()


def calibrated_kv_scales(tensors: dict[str, torch.Tensor], attn: str, qconfig: dict[str, Any] | None,
                         num_kv_heads: int) -> StaticKVScales | None:
    """A layer's calibrated KV cache scales, where compressed-tensors writes them and vLLM reads them:
    `<layer>.self_attn.k_scale` / `v_scale` (one per tensor, or one per KV head), for the config's
    `kv_cache_scheme` (8-bit float: an FP8 cache, 8-bit int: an int8 one). None when the checkpoint has none."""
    scheme = (qconfig or {}).get("kv_cache_scheme")
    k, v = tensors.get(attn + "k_scale"), tensors.get(attn + "v_scale")
    if not scheme or k is None or v is None:
        return None
    kind = "fp8" if scheme.get("type", "float") == "float" else "int8"
    heads = []
    for name, scale in ((attn + "k_scale", k), (attn + "v_scale", v)):
        flat = scale.float().flatten()
        if flat.numel() not in (1, num_kv_heads) or not bool(torch.isfinite(flat).all() and (flat > 0).all()):
            raise ModelSourceError(f"{name} holds {flat.numel()} values: give one positive finite scale, or one "
                                   f"per KV head ({num_kv_heads})")
        heads.append(flat.expand(num_kv_heads).contiguous())
    return StaticKVScales(k=heads[0], v=heads[1], kind=kind)


# Per-expert Linear names: (gate, up, down). Qwen3-MoE and llm-compressor's outputs (Mixtral included) use the
# first; Mixtral's original checkpoints the second (w1 = gate, w3 = up, w2 = down).
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def load_moe(moe: SparseMoE, factory: LinearFactory, layer_prefix: str) -> None:
    """Router and experts of one MoE layer, from `mlp.` (Qwen3-MoE, transformers' in-memory names) or
    `block_sparse_moe.` (Mixtral), per expert or as transformers 5's fused 3-D `experts.gate_up_proj`
    [E, 2I, H] / `experts.down_proj` [E, H, I] (dense only: compressed-tensors quantizes 2-D Linears)."""
    prefix = next((layer_prefix + b for b in ("mlp.", "block_sparse_moe.") if factory.has(layer_prefix + b + "gate")),
                  None)
    if prefix is None:
        raise ModelSourceError(f"checkpoint has no MoE router for {layer_prefix}mlp.gate: the folder is incomplete "
                               "or its layers are not those of its config.json")
    router = factory.by_module[prefix + "gate"]
    # a dense router stays dense whatever the config groups match (llm-compressor lists it in `ignore`)
    dense = "weight" in router and "weight_scale" not in router
    moe.gate = factory.dense(router["weight"], None) if dense else factory.make([prefix + "gate"])
    fused = factory.by_module.get(prefix + "experts", {})
    for e, expert in enumerate(moe.experts):
        if "gate_up_proj" in fused and "down_proj" in fused:
            expert.gate_up_proj = factory.dense(fused["gate_up_proj"][e], None)
            expert.down_proj = factory.dense(fused["down_proj"][e], None)
            continue
        base = f"{prefix}experts.{e}."
        names = next((n for n in EXPERT_NAMES if factory.has(base + n[0])), EXPERT_NAMES[0])
        expert.gate_up_proj = factory.make([base + names[0], base + names[1]])
        expert.down_proj = factory.make([base + names[2]])
