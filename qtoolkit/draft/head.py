"""The EAGLE-3 draft head: one decoder layer fed with the target's token embedding and a fusion of three of the
target's hidden states, predicting over a reduced draft vocabulary.

Module names follow vLLM's EAGLE-3 checkpoint (vllm/model_executor/models/llama_eagle3.py): `fc`, `midlayer.*`,
`norm`, `lm_head`, and the `d2t` / `t2d` vocabulary maps, so `save_head` writes a folder vLLM serves as is.

Conventions, all vLLM's:
- aux layer id j is the residual stream entering target decoder layer j (the output of layer j-1; transformers'
  `hidden_states[j]` with output_hidden_states); the three are concatenated low, middle, high and fused by `fc`.
- the draft row at position i pairs the fused target feature of position i with the embedding of token i+1 and
  predicts token i+2; later chain steps feed the head's own output hidden back with the sampled token's embedding
  at position i+1, i+2, ...
- the midlayer's residual takes the hidden state before `hidden_norm`; its output (before `norm`) is what is fed
  back, and logits are lm_head(norm(out)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..model.llama import RMSNorm, apply_rope, rope_inv_freq


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    draft_vocab_size: int
    vocab_size: int  # the target's
    target_hidden_size: int
    aux_layer_ids: tuple[int, int, int]

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int,
                    aux_layer_ids: tuple[int, int, int] | None = None) -> Eagle3Config:
        """A head shaped like one layer of the target (qtoolkit.model.llama.ModelConfig); the hidden size must be the
        target's because the head consumes the target's own token embeddings."""
        t = target_config
        ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(t.num_layers)
        return cls(hidden_size=t.hidden_size, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
                   head_dim=t.head_dim, intermediate_size=t.intermediate_size, rms_norm_eps=t.rms_norm_eps,
                   rope_theta=t.rope_theta, max_position_embeddings=t.max_position_embeddings,
                   draft_vocab_size=int(draft_vocab_size), vocab_size=t.vocab_size,
                   target_hidden_size=t.hidden_size, aux_layer_ids=ids)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default taps (2, L//2, L-3) where the target has at least 6 layers; a spread low/middle/high over
    layers 1..L-1 for tinier ones (id 0, the bare embedding, is never tapped, as in vLLM)."""
    if num_layers >= 6:
        return 2, num_layers // 2, num_layers - 3
    top = max(1, num_layers - 1)
    return 1, max(1, min(top, num_layers // 2)), top


@dataclass
class DraftKV:
    """The head's own KV cache for one sequence: k, v [length, num_kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    def __len__(self) -> int:
        return int(self.k.shape[0])

    def truncate(self, n: int) -> None:
        """Drop positions >= n (rejected drafts)."""
        self.k, self.v = self.k[:n], self.v[:n]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = torch.cat([self.k, k]), torch.cat([self.v, v])

    @classmethod
    def empty(cls, config: Eagle3Config, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> DraftKV:
        shape = (0, config.num_key_value_heads, config.head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, requires_grad=True)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, requires_grad=True)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, requires_grad=True)
        self.mlp = MLP(c)


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, requires_grad=True)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # target_id = draft_id + d2t[draft_id] (vLLM's offsets); t2d marks target ids the draft can propose
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[:c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # not a buffer: .to(bfloat16) would round the rotary frequencies; positions rotate in fp32 always
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, None)
        # the head's own token embeddings where its checkpoint carries them (speculators' heads do); None: the
        # target's, which the head shares (vLLM's layout, and heads `qtool train-draft` writes)
        self.embed_tokens: torch.Tensor | None = None

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Install the draft vocabulary: draft id i proposes target id draft_to_target[i]."""
        ids = draft_to_target.to(torch.int64).cpu()
        if ids.shape != (self.config.draft_vocab_size,) or len(set(ids.tolist())) != len(ids):
            raise ValueError(f"draft vocabulary needs {self.config.draft_vocab_size} distinct target ids")
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, 3 * target_hidden] (low | middle | high aux states) -> [T, hidden]."""
        return self.fc(aux)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hk, D] of T new rows, RoPE applied at `positions`."""
        c, m = self.config, self.midlayer
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)
        T = x.shape[0]
        q = m.self_attn.q_proj(x).view(T, c.num_attention_heads, c.head_dim)
        k = m.self_attn.k_proj(x).view(T, c.num_key_value_heads, c.head_dim)
        v = m.self_attn.v_proj(x).view(T, c.num_key_value_heads, c.head_dim)
        cos, sin = self.rope(positions)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output [T, H * D] and the rows' input hidden -> (output hidden, logits over the draft vocab)."""
        m = self.midlayer
        residual = m.self_attn.o_proj(attn) + hidden
        out = m.mlp(m.post_attention_layernorm(residual)) + residual
        return out, self.lm_head(self.norm(out))

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: DraftKV
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run T new rows causally after kv's past (appending their K/V to kv): (output hidden, logits)."""
        q, k, v = self.qkv(embeds, hidden, positions)
        past = len(kv)
        kv.append(k.to(kv.k.dtype), v.to(kv.v.dtype))
        T, total = q.shape[0], len(kv)
        mask = torch.ones(T, total, dtype=torch.bool, device=q.device).tril(diagonal=past)
        attn = attend(q, kv.k.to(q.dtype), kv.v.to(q.dtype), mask)
        return self.finish(attn.reshape(T, -1), hidden)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] over k, v [S, Hk, D] with mask [T, S] (True = may attend) -> [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)
