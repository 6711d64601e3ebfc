"""A flat decoder for the LLaMA family and its relatives (LLaMA, Mistral, Qwen2, Qwen3, Gemma 3, and the
mixture-of-experts Qwen3-MoE and Mixtral), written for paged,
continuous batching. The families differ in pieces the config picks, not in code paths: full or sliding-window
attention per layer, optional per-head q/k norm, the RMSNorm variant (w or 1 + w), the MLP's activation, a rope
per layer type, norms around the attention and MLP outputs (Gemma's sandwich), scaled embeddings, final logit
soft-capping, a routed MoE block in place of the MLP.

All scheduled tokens of a step are flattened into one [T] batch; per-sequence metadata (positions, cache slots,
block tables, attention groups) tells attention which cached K/V each query sees. A sequence may bring any
number of new tokens: a prefill chunk, one decode token, or several draft tokens to verify, and the caller
picks which rows get logits (last token per sequence, or every token for scoring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from qtoolkit.kernels.cpu_build import engine_ops
from torch import nn
from transformers.activations import ACT2FN

from ..errors import ModelSourceError
from .decode_plan import DecodePlan, build_plan, cache_key
from .kv_quant import StaticKVScales, dequantize, quantize
from .moe import MoEConfig, SparseMoE

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "mixtral")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")  # per-head norm of q and k before RoPE
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types names
# families whose config has `use_sliding_window`: without it their sliding_window is ignored (as transformers does)
USE_SLIDING_WINDOW_FLAG = ("qwen2", "qwen3", "qwen3_moe")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # per layer FULL or SLIDING (empty: all FULL); a SLIDING layer's query sees its last `sliding_window` positions
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    local_rope_theta: float | None = None  # sliding layers' own rope base (Gemma 3's rope_local_base_freq)
    local_rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    unit_offset_norm: bool = False  # Gemma: RMSNorm weight applied as (1 + w), computed in fp32
    sandwich_norms: bool = False  # Gemma: RMSNorm on the attention and MLP outputs too
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (default head_dim)
    # tanh soft-capping of the logits (Gemma). transformers 5.17's Gemma 3 reads attn_logit_softcapping but never
    # applies it, so the engine does not either
    final_logit_softcapping: float | None = None

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types and self.layer_types[i] == SLIDING else None

    def layer_rope(self, i: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of layer i's rotary embedding."""
        if self.local_rope_theta is not None and self.layer_window(i) is not None:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling
    moe: MoEConfig | None = None  # routed experts on the sparse layers (Qwen3-MoE, Mixtral)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelSourceError(f"model_type {model_type!r} is not supported by the engine: use one of "
                                   f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if cfg.get("use_bidirectional_attention"):
            raise ModelSourceError("bidirectional attention (an embedding model) is not supported by the engine: "
                                   "use a causal language model")
        gemma = model_type == "gemma3_text"
        rope_types = rope_by_layer_type(cfg)
        global_rope, local_rope = rope_types.get(FULL, {}), rope_types.get(SLIDING)
        theta = global_rope.get("rope_theta", cfg.get("rope_theta", 1e6 if gemma else 10000.0))
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        layer_types, window = layer_types_and_window(model_type, cfg)
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or (256 if gemma else cfg["hidden_size"] // heads),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
            qkv_bias=cfg.get("attention_bias", model_type == "qwen2"), mlp_bias=cfg.get("mlp_bias", False),
            rope_scaling=rope_scaling_of(global_rope),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            layer_types=layer_types, sliding_window=window,
            local_rope_theta=None if local_rope is None else float(local_rope.get("rope_theta", 10000.0)),
            local_rope_scaling=None if local_rope is None else rope_scaling_of(local_rope),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or
            ("gelu_pytorch_tanh" if gemma else "silu"),
            unit_offset_norm=gemma, sandwich_norms=gemma, qk_norm=model_type in QK_NORM_MODEL_TYPES,
            embed_scale=gemma, moe=MoEConfig.from_hf(cfg),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256) if gemma else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
        )


def rope_by_layer_type(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rope settings per layer type: transformers >= 5 nests them in rope_parameters (per layer type for Gemma 3);
    older configs keep rope_theta / rope_scaling at the top level and Gemma 3's local base in rope_local_base_freq."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    if FULL in params or SLIDING in params:
        return {k: dict(v) for k, v in params.items() if isinstance(v, dict)}
    ropes = {FULL: {**legacy, **params}}
    if "rope_local_base_freq" in cfg or cfg.get("model_type") == "gemma3_text":
        ropes[SLIDING] = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    return ropes


def rope_scaling_of(rope: dict[str, Any]) -> dict[str, Any] | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    return None if kind == "default" else {**rope, "rope_type": kind}


def layer_types_and_window(model_type: str, cfg: dict[str, Any]) -> tuple[list[str], int | None]:
    """Which layers attend through a sliding window, following each family's transformers config class."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window", 4096 if model_type == "mistral" else None)  # MistralConfig's default
    if model_type in USE_SLIDING_WINDOW_FLAG and not cfg.get("use_sliding_window", False):
        window = None
    types = cfg.get("layer_types")
    if types is None:
        if model_type in ("mistral", "mixtral", "qwen3_moe"):  # one window on every layer (no max_window_layers)
            types = [SLIDING] * n
        elif model_type == "gemma3_text":
            pattern = cfg.get("sliding_window_pattern", 6)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        elif model_type in USE_SLIDING_WINDOW_FLAG:
            first = cfg.get("max_window_layers", 28)
            types = [SLIDING if i >= first else FULL for i in range(n)]
        else:
            types = [FULL] * n
    if len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        raise ModelSourceError(f"layer_types {types} is not supported by the engine: give {n} entries, each "
                               f"{FULL!r} or {SLIDING!r}")
    if window is None or SLIDING not in types:
        return [FULL] * n, None
    if int(window) <= 0:
        raise ModelSourceError(f"sliding_window {window} must be a positive number of tokens")
    return list(types), int(window)


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Rotary frequencies, computed exactly as transformers does (so fp32 logits match it bit for bit)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelSourceError(f"rope scaling {kind!r} is not supported by the engine: use default, linear or llama3")


@dataclass
class AttentionGroup:
    """Sequences whose attention runs as one padded SDPA call.

    Their tokens are the contiguous rows `rows` of the flat batch. Queries are laid out [S, Q]; when sequences
    bring different numbers of tokens, `gather` (S*Q indices into `rows`, pads repeat a real row) builds that
    layout and `scatter` (indices into S*Q) picks the real rows back out.
    """

    rows: slice
    num_seqs: int
    q_len: int
    block_table: torch.Tensor  # [S, max_blocks] int64, padded with block 0
    mask: torch.Tensor | None = None  # [S, 1, G*Q, max_blocks*block_size] bool, True = may attend
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # the same per sliding window size
    gather: torch.Tensor | None = None
    scatter: torch.Tensor | None = None
    # paged path (engine_ops.paged_attention, no padding): each row's sequence and newest visible position
    row_seq: torch.Tensor | None = None
    row_last: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) for each token's K/V
    groups: list[AttentionGroup]
    logits_rows: torch.Tensor | None  # rows that get logits; None = all
    # EAGLE-3 taps: the residual stream entering each of these layers, for every row, is left in `aux`
    # ([T, len(aux_layers) * hidden], in aux_layers order); nothing is captured when empty
    aux_layers: tuple[int, ...] = ()
    aux: torch.Tensor | None = None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (rotate-half convention), cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = config.layer_window(layer)  # None: full causal attention
        self.qkv_proj: nn.Module | None = None  # fused q|k|v, set by the loader
        self.o_proj: nn.Module | None = None
        # per-head norms over [tokens, heads, head_dim] before RoPE (Qwen3, Gemma 3); weights set by the loader
        norm = norm_class(config)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_cache = self.v_cache = torch.empty(0)  # [num_blocks, block_size, kv_heads, D], set by the runner
        # a quantized cache (set by the runner): kv_kind "fp8" (E4M3 bytes as uint8) or "int8", with one fp32 scale
        # per slot and KV head in k_scales / v_scales [num_blocks, block_size, kv_heads]
        self.kv_kind: str | None = None
        self.k_scales = self.v_scales = torch.empty(0)
        self.kv_calibrated: StaticKVScales | None = None  # a checkpoint's k_scale / v_scale, set by the loader
        self.kv_static: StaticKVScales | None = None  # the calibrated scales the cache uses (runner's choice)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, H, Hk, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # .forward: no hooks here, and ~3 us a call saved
        if self.q_norm is not None:
            qkv = self._qk_norm(qkv)
        ops = engine_ops() if self.k_cache.device.type == "cpu" and qkv.dtype == self.k_cache.dtype else None
        if self.kv_kind is not None:
            q = self._rope_and_cache_quantized(qkv, cos, sin, batch)
        elif ops is not None:
            q = ops.rope_and_cache(qkv.contiguous(), cos, sin, self.k_cache, self.v_cache, batch.slot_mapping, H, Hk)
        else:
            qk = apply_rope(qkv[:, :(H + Hk) * D].view(T, H + Hk, D), cos, sin)  # q and k rotated in one go
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + Hk) * D:].view(T, Hk, D)
            self.k_cache.view(-1, Hk, D).index_copy_(0, batch.slot_mapping, k)
            self.v_cache.view(-1, Hk, D).index_copy_(0, batch.slot_mapping, v)
        if len(batch.groups) == 1 and batch.groups[0].scatter is None:
            return self.o_proj.forward(self._attend(q, batch.groups[0]))
        out = torch.empty(T, H * D, dtype=x.dtype)
        for group in batch.groups:
            o = self._attend(q, group)
            out[group.rows] = o if group.scatter is None else o.index_select(0, group.scatter)
        return self.o_proj.forward(out)

    def _rope_and_cache_quantized(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  batch: ForwardBatch) -> torch.Tensor:
        """Rotated q [T, H, D]; the rotated k and v go into the cache quantized (kv_quant.py's operations)."""
        T, H, Hk, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        static = self.kv_static
        ops = engine_ops() if self.k_cache.device.type == "cpu" else None
        if ops is not None:
            return ops.rope_and_cache_quant(qkv.contiguous(), cos, sin, self.k_cache, self.v_cache, self.k_scales,
                                            self.v_scales, batch.slot_mapping, H, Hk, self.kv_kind == "fp8",
                                            None if static is None else static.k, None if static is None else static.v)
        qk = apply_rope(qkv[:, :(H + Hk) * D].view(T, H + Hk, D), cos, sin)
        v = qkv[:, (H + Hk) * D:].view(T, Hk, D)
        for x, cache, scales, fixed in ((qk[:, H:], self.k_cache, self.k_scales, static and static.k),
                                        (v, self.v_cache, self.v_scales, static and static.v)):
            values, scale = quantize(x, self.kv_kind, fixed)
            cache.view(-1, Hk, D).index_copy_(0, batch.slot_mapping, values)
            scales.view(-1, Hk).index_copy_(0, batch.slot_mapping, scale)
        return qk[:, :H]

    def _cached(self, which: str, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The K or V cache's `blocks` [n, block_size, kv_heads, D] in `dtype` (dequantized when quantized)."""
        cache = self.k_cache if which == "k" else self.v_cache
        values = cache.index_select(0, blocks)
        if self.kv_kind is None:
            return values
        scales = (self.k_scales if which == "k" else self.v_scales).index_select(0, blocks)
        return dequantize(values, scales, self.kv_kind, dtype)

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """q|k|v with q and k normalised per head; v passes through."""
        T, H, Hk, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, :H * D].view(T, H, D)).view(T, H * D)
        k = self.k_norm(qkv[:, H * D:(H + Hk) * D].view(T, Hk, D)).view(T, Hk * D)
        return torch.cat((q, k, qkv[:, (H + Hk) * D:]), dim=-1)

    def _attend(self, q: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        if g.row_seq is not None:
            scaled = self.kv_kind is not None
            return engine_ops().paged_attention(q[g.rows], self.k_cache, self.v_cache, g.block_table, g.row_seq,
                                                g.row_last, self.scale, self.window or 0,
                                                self.k_scales if scaled else None, self.v_scales if scaled else None)
        S, Q, Hk, G, D = g.num_seqs, g.q_len, self.num_kv_heads, self.group, self.head_dim
        qg = q[g.rows] if g.gather is None else q[g.rows].index_select(0, g.gather)
        # GQA without repeating K/V: the G query heads sharing a KV head become G*Q query rows
        qg = qg.reshape(S, Q, Hk, G, D).permute(0, 2, 3, 1, 4).reshape(S, Hk, G * Q, D)
        blocks = g.block_table.flatten()
        L = g.block_table.shape[1] * self.k_cache.shape[1]
        k = self._cached("k", blocks, q.dtype).view(S, L, Hk, D).transpose(1, 2)
        v = self._cached("v", blocks, q.dtype).view(S, L, Hk, D).transpose(1, 2)
        mask = g.mask if self.window is None else g.window_masks[self.window]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        return o.view(S, Hk, G, Q, D).permute(0, 3, 1, 2, 4).reshape(S * Q, Hk * G * D)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        # SwiGLU runs fused; any other gate activation (Gemma's gelu-tanh GeGLU) is transformers' own function
        self.act = None if config.hidden_act == "silu" else ACT2FN[config.hidden_act]
        self.gate_up_proj: nn.Module | None = None  # fused gate|up, set by the loader
        self.down_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        ops = engine_ops() if not gate_up.is_cuda and gate_up.dim() == 2 and self.act is None else None
        if ops is not None:
            return self.down_proj.forward(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj.forward((F.silu(gate) if self.act is None else self.act(gate)) * up)


class RMSNorm(nn.Module):
    """x / rms(x) * w. The engine loads w and never trains it; the EAGLE-3 draft head trains it (requires_grad)."""

    def __init__(self, dim: int, eps: float, requires_grad: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the same op order as transformers' LlamaRMSNorm, in the activations' dtype
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))

    def fused_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The weight add_rms_norm multiplies by, or None where the fused op would not give this norm's math."""
        return self.weight if x.dtype in (torch.float32, torch.bfloat16) else None

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None means x is the residual."""
        weight = None if x.is_cuda else self.fused_weight(x)
        ops = engine_ops() if weight is not None else None
        if ops is not None:
            out, res = ops.add_rms_norm(x.contiguous(), residual, weight, self.eps)
            return out, res
        residual = x if residual is None else residual + x
        return self(residual), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the stored weight w is applied as (1 + w), the whole norm in fp32, cast back once."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self._unit: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight it was made from, 1 + weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def fused_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        # fp32 only: the fused op multiplies by a weight in x's dtype, and a bf16 (1 + w) would round
        if x.dtype != torch.float32:
            return None
        if self._unit is None or self._unit[0] is not self.weight:
            self._unit = (self.weight, 1.0 + self.weight.float())
        return self._unit[1]


def norm_class(config: ModelConfig) -> type[RMSNorm]:
    return GemmaRMSNorm if config.unit_offset_norm else RMSNorm


def make_mlp(config: ModelConfig, layer: int) -> nn.Module:
    """The layer's MLP: dense SwiGLU, or the MoE block on the config's sparse layers (experts are SwiGLU MLPs)."""
    moe = config.moe
    if moe is None or layer not in moe.sparse_layers:
        return MLP(config)
    expert = replace(config, intermediate_size=moe.intermediate_size)
    return SparseMoE(moe, [MLP(expert) for _ in range(moe.num_experts)])


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        norm = norm_class(config)
        self.input_norm = norm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.post_attn_norm = norm(config.hidden_size, config.rms_norm_eps)  # the MLP's input norm
        self.mlp = make_mlp(config, layer)
        # Gemma's sandwich: norms on the attention and MLP outputs before each joins the residual
        self.attn_out_norm = norm(config.hidden_size, config.rms_norm_eps) if config.sandwich_norms else None
        self.mlp_out_norm = norm(config.hidden_size, config.rms_norm_eps) if config.sandwich_norms else None

    def forward(self, x, residual, cos, sin, batch):
        h, residual = self.input_norm.add_forward(x, residual)
        h = self.attn.forward(h, cos, sin, batch)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        h, residual = self.post_attn_norm.add_forward(h, residual)
        h = self.mlp.forward(h)
        return (h if self.mlp_out_norm is None else self.mlp_out_norm(h)), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.embed_tokens = nn.Parameter(torch.empty(0), requires_grad=False)  # [V, hidden], set by the loader
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = norm_class(config)(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = None
        # one cos/sin table per distinct rope (Gemma 3: local and global layers); layer i reads rope_index[i]
        ropes = [config.layer_rope(i) for i in range(config.num_layers)]
        keys = [(theta, repr(scaling)) for theta, scaling in ropes]
        distinct = list(dict.fromkeys(keys))
        self.rope_index = [distinct.index(k) for k in keys]
        positions = torch.arange(config.max_position_embeddings).float()
        freqs = torch.stack([torch.outer(positions, rope_inv_freq(config.head_dim, *ropes[keys.index(k)]))
                             for k in distinct])  # [ropes, positions, D/2]
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)
        # the C++ layer loop of decode/verify steps (model/decode_plan.py): built at the first step that can use
        # it, dropped when the model's modules or KV caches change; False = this model cannot have one
        self.decode_plan: DecodePlan | None | bool = None

    def cast_rope(self) -> None:
        self.rope_cos, self.rope_sin = self.rope_cos.to(self.dtype), self.rope_sin.to(self.dtype)

    def bind_submodules(self) -> LlamaModel:
        """Copy every submodule reference into its parent's instance dict, so `self.attn` and the like are plain
        attribute reads instead of nn.Module.__getattr__ calls (~800 a decode step, ~6% of a batch-1 INT4 step).
        Safe to keep: nn.Module.__setattr__ drops the copy whenever a submodule is reassigned."""
        for module in self.modules():
            module.__dict__.update(module._modules)
        self.decode_plan = None
        return self

    def _plan_for(self, batch: ForwardBatch, rows: int) -> DecodePlan | None:
        """The C++ layer loop when this step can take it: short rows, all in the paged attention group, rows
        within every Linear's GEMV limit."""
        if len(batch.groups) != 1 or batch.groups[0].row_seq is None:
            return None
        plan = self.decode_plan
        if plan is False:
            return None
        if plan is None or plan.cache_key != cache_key(self):
            plan = self.decode_plan = build_plan(self) or False
            if plan is False:
                return None
        return plan if rows <= plan.max_rows else None

    def _apply(self, fn, recurse=True):  # .to() and the like replace tensors a plan holds
        self.decode_plan = None
        return super()._apply(fn, recurse)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer loop in Python (every family, every step): cos/sin [ropes, T, 1, D/2]."""
        residual = None
        taps: dict[int, torch.Tensor] = {}
        for i, (layer, r) in enumerate(zip(self.layers, self.rope_index, strict=True)):
            if i in batch.aux_layers:
                taps[i] = x if residual is None else x + residual
            x, residual = layer.forward(x, residual, cos[r], sin[r], batch)
        if taps:
            batch.aux = torch.cat([taps[i] for i in batch.aux_layers], dim=-1)
        return x, residual

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs the scheduled tokens; returns float32 logits [rows, vocab] for batch.logits_rows."""
        x = F.embedding(batch.input_ids, self.embed_tokens).to(self.dtype)  # a bf16 table may feed fp32 layers
        if self.config.embed_scale:  # the scale rounded to the activations' dtype first, as transformers does
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=self.dtype)
        cos = self.rope_cos.index_select(1, batch.positions)  # [ropes, T, D/2]
        sin = self.rope_sin.index_select(1, batch.positions)
        plan = self._plan_for(batch, x.shape[0]) if x.dtype == torch.float32 and not x.is_cuda else None
        if plan is not None:
            g = batch.groups[0]
            x, residual, *taps = plan.plan.run(x, cos, sin, batch.slot_mapping, g.block_table, g.row_seq,
                                               g.row_last, list(batch.aux_layers))
            if taps:
                batch.aux = torch.cat(taps, dim=-1)
        else:
            x, residual = self._layers(x, cos.unsqueeze(2), sin.unsqueeze(2), batch)
        if batch.logits_rows is not None:
            x, residual = x.index_select(0, batch.logits_rows), residual.index_select(0, batch.logits_rows)
        logits = self.lm_head.forward(self.norm.add_forward(x, residual)[0])
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
