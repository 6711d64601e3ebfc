"""A flat LLaMA-family decoder (LLaMA, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) written for paged, continuous batching.

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

from ..errors import ModelSourceError
from .moe import MoEConfig, SparseMoE

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")  # RMSNorm over each head's q and k before RoPE


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
    qk_norm: bool = False
    moe: MoEConfig | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelSourceError(f"model_type {model_type!r} is not supported by the engine: use one of "
                                   f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        _refuse_window(cfg, model_type)
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5 nests rope settings here
        legacy = cfg.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", model_type == "qwen2"), mlp_bias=cfg.get("mlp_bias", False),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            qk_norm=model_type in QK_NORM_MODEL_TYPES, moe=MoEConfig.from_hf(cfg),
        )


def _refuse_window(cfg: dict[str, Any], model_type: str) -> None:
    """Qwen3 and Mixtral configs may ask for sliding-window attention, which this decoder does not run: refuse
    rather than attend over the full context (Qwen3's window only applies with use_sliding_window)."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None
    if model_type in ("qwen3", "qwen3_moe", "mixtral") and window is not None \
            and window < cfg.get("max_position_embeddings", 2048):
        raise ModelSourceError(f"{model_type} with sliding_window={window} needs sliding-window attention, which "
                               "the engine does not run for this family: use a config without a window")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary frequencies, computed exactly as transformers does (so fp32 logits match it bit for bit)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (rotate-half convention), cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim ** -0.5
        self.qkv_proj: nn.Module | None = None  # fused q|k|v, set by the loader
        self.o_proj: nn.Module | None = None
        # per-head norms over [tokens, heads, head_dim] before RoPE (Qwen3); weights set by the loader
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_cache = self.v_cache = torch.empty(0)  # [num_blocks, block_size, kv_heads, D], set by the runner

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, H, Hk, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # .forward: no hooks here, and ~3 us a call saved
        if self.q_norm is not None:
            qkv = self._qk_norm(qkv)
        ops = engine_ops() if self.k_cache.device.type == "cpu" and qkv.dtype == self.k_cache.dtype else None
        if ops is not None:
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

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """q|k|v with q and k normalised per head; v passes through."""
        T, H, Hk, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(qkv[:, :H * D].view(T, H, D)).view(T, H * D)
        k = self.k_norm(qkv[:, H * D:(H + Hk) * D].view(T, Hk, D)).view(T, Hk * D)
        return torch.cat((q, k, qkv[:, (H + Hk) * D:]), dim=-1)

    def _attend(self, q: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        if g.row_seq is not None:
            return engine_ops().paged_attention(q[g.rows], self.k_cache, self.v_cache, g.block_table, g.row_seq,
                                                g.row_last, self.scale)
        S, Q, Hk, G, D = g.num_seqs, g.q_len, self.num_kv_heads, self.group, self.head_dim
        qg = q[g.rows] if g.gather is None else q[g.rows].index_select(0, g.gather)
        # GQA without repeating K/V: the G query heads sharing a KV head become G*Q query rows
        qg = qg.reshape(S, Q, Hk, G, D).permute(0, 2, 3, 1, 4).reshape(S, Hk, G * Q, D)
        blocks = g.block_table.flatten()
        L = g.block_table.shape[1] * self.k_cache.shape[1]
        k = self.k_cache.index_select(0, blocks).view(S, L, Hk, D).transpose(1, 2)
        v = self.v_cache.index_select(0, blocks).view(S, L, Hk, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=self.scale)
        return o.view(S, Hk, G, Q, D).permute(0, 3, 1, 2, 4).reshape(S * Q, Hk * G * D)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj: nn.Module | None = None  # fused gate|up, set by the loader
        self.down_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        ops = engine_ops() if not gate_up.is_cuda and gate_up.dim() == 2 else None
        if ops is not None:
            return self.down_proj.forward(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the same op order as transformers' LlamaRMSNorm, in the activations' dtype
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None means x is the residual."""
        ops = engine_ops() if not x.is_cuda and x.dtype in (torch.float32, torch.bfloat16) else None
        if ops is not None:
            out, res = ops.add_rms_norm(x.contiguous(), residual, self.weight, self.eps)
            return out, res
        residual = x if residual is None else residual + x
        return self(residual), residual


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
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer)

    def forward(self, x, residual, cos, sin, batch):
        h, residual = self.input_norm.add_forward(x, residual)
        h, residual = self.post_attn_norm.add_forward(self.attn.forward(h, cos, sin, batch), residual)
        return self.mlp.forward(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.embed_tokens = nn.Parameter(torch.empty(0), requires_grad=False)  # [V, hidden], set by the loader
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = None
        freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), rope_inv_freq(config))
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)

    def cast_rope(self) -> None:
        self.rope_cos, self.rope_sin = self.rope_cos.to(self.dtype), self.rope_sin.to(self.dtype)

    def bind_submodules(self) -> LlamaModel:
        """Copy every submodule reference into its parent's instance dict, so `self.attn` and the like are plain
        attribute reads instead of nn.Module.__getattr__ calls (~800 a decode step, ~6% of a batch-1 INT4 step).
        Safe to keep: nn.Module.__setattr__ drops the copy whenever a submodule is reassigned."""
        for module in self.modules():
            module.__dict__.update(module._modules)
        return self

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs the scheduled tokens; returns float32 logits [rows, vocab] for batch.logits_rows."""
        x = F.embedding(batch.input_ids, self.embed_tokens).to(self.dtype)  # a bf16 table may feed fp32 layers
        cos = self.rope_cos.index_select(0, batch.positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, batch.positions).unsqueeze(1)
        residual = None
        for layer in self.layers:
            x, residual = layer.forward(x, residual, cos, sin, batch)
        if batch.logits_rows is not None:
            x, residual = x.index_select(0, batch.logits_rows), residual.index_select(0, batch.logits_rows)
        return self.lm_head.forward(self.norm.add_forward(x, residual)[0]).float()
