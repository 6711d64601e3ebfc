"""Training-time test (EAGLE-3): the head unrolled over its own outputs, as chain drafting runs it.

Row i of a sequence drafts from position i: step 0 pairs the target's fused feature at i with token i+1 and
predicts token i+2; step s feeds step s-1's output hidden back with token i+1+s at position i+s and predicts
token i+2+s. Step s of row i attends to step 0's keys at positions 0..i (what the draft cache holds from target
features) and to its own chain's keys of steps 1..s, which is what a draft step sees at inference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .head import Eagle3Head


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] token ids (pads repeat the last token)
    aux: torch.Tensor  # [B, T, 3 * target_hidden]
    final: torch.Tensor  # [B, T, hidden] the target's normed final hidden
    valid: torch.Tensor  # [B, T] bool, real tokens
    first_row: torch.Tensor  # [B] rows before this are not scored (a held-out prompt)
    greedy: torch.Tensor | None = None  # [B, T] target argmax over the full vocabulary


def unroll(head: Eagle3Head, embed: torch.Tensor, batch: Batch, steps: int) -> list[torch.Tensor]:
    """Draft logits [B, T-1, draft_vocab] per step; row i of step s predicts token i+2+s."""
    B, T = batch.ids.shape
    R = T - 1
    c = head.config
    rows = torch.arange(R, device=batch.ids.device)
    hidden = head.fuse(batch.aux[:, :R])
    keys0 = vals0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    causal = rows[None, :] <= rows[:, None]  # [R, R] key j visible to row i
    group = c.num_attention_heads // c.num_key_value_heads
    out_logits = []
    for s in range(steps):
        tok = batch.ids[:, (rows + 1 + s).clamp(max=T - 1)]
        pos = (rows + s).expand(B, R)
        q, k, v = head.qkv(embed[tok].reshape(B * R, -1), hidden.reshape(B * R, -1), pos.reshape(-1))
        q = q.view(B, R, c.num_attention_heads, c.head_dim)
        k = k.view(B, R, c.num_key_value_heads, c.head_dim).repeat_interleave(group, dim=2)
        v = v.view(B, R, c.num_key_value_heads, c.head_dim).repeat_interleave(group, dim=2)
        if s == 0:
            keys0, vals0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        scale = c.head_dim ** -0.5
        scores = torch.einsum("bihd,bjhd->bhij", q, keys0) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        extra = [torch.einsum("bihd,bihd->bhi", q, dk)[..., None] * scale for dk in diag_k]
        probs = torch.softmax(torch.cat([scores, *extra], dim=-1), dim=-1)
        attn = torch.einsum("bhij,bjhd->bihd", probs[..., :R], vals0)
        for r, dv in enumerate(diag_v):
            attn = attn + probs[..., R + r].permute(0, 2, 1)[..., None] * dv
        out, logits = head.finish(attn.reshape(B * R, -1), hidden.reshape(B * R, -1))
        hidden = out.view(B, R, -1)
        out_logits.append(logits.view(B, R, -1))
    return out_logits


def step_mask(batch: Batch, s: int) -> torch.Tensor:
    """[B, T-1] rows of step s that have a real target token (i+2+s is a real position)."""
    B, T = batch.ids.shape
    rows = torch.arange(T - 1, device=batch.ids.device)
    target = (rows + 1 + s).clamp(max=T - 1)
    ok = (rows + 1 + s < T)[None, :] & batch.valid[:, target]
    return ok & (rows[None, :] >= batch.first_row[:, None])


def distill_loss(logits: list[torch.Tensor], batch: Batch, teacher_head: torch.Tensor, decay: float = 0.8
                 ) -> tuple[torch.Tensor, list[float]]:
    """Soft cross-entropy against the target's next-token distribution over the draft vocabulary, per step;
    teacher_head [draft_vocab, hidden] are the target's LM head rows of the draft tokens."""
    R = batch.ids.shape[1] - 1
    with torch.no_grad():
        teacher = torch.softmax(batch.final @ teacher_head.T, dim=-1)  # [B, T, N]: row t predicts token t+1
    total, per_step = 0.0, []
    for s, lg in enumerate(logits):
        mask = step_mask(batch, s)
        target = teacher[:, 1 + s:1 + s + R]
        if target.shape[1] < R:
            target = F.pad(target, (0, 0, 0, R - target.shape[1]))
        ce = -(target * F.log_softmax(lg, dim=-1)).sum(-1)
        loss = (ce * mask).sum() / mask.sum().clamp(min=1)
        per_step.append(float(loss.detach()))
        total = total + decay ** s * loss
    return total, per_step


def chain_hits(head: Eagle3Head, logits: list[torch.Tensor], batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits [B, T-1, k] draft token == target greedy token per step, rows [B, T-1] with a full k-step chain)."""
    R, k = batch.ids.shape[1] - 1, len(logits)
    rows = torch.arange(R, device=batch.ids.device)
    hits = []
    for s, lg in enumerate(logits):
        proposed = head.to_target(lg.argmax(-1))
        truth = batch.greedy[:, (rows + 1 + s).clamp(max=R)]
        hits.append(proposed == truth)
    return torch.stack(hits, dim=-1), step_mask(batch, k - 1)


def acceptance(hits: torch.Tensor, rows: torch.Tensor) -> dict:
    """Per-position conditional acceptance and the mean tokens per verification step (accepted + 1)."""
    h = hits[rows]  # [n, k]
    lead = h.int().cumprod(dim=-1)  # 1 while every earlier draft was accepted
    reached = torch.cat([torch.ones_like(lead[:, :1]), lead[:, :-1]], dim=-1)
    per_pos = [float(lead[:, s].sum() / reached[:, s].sum().clamp(min=1)) for s in range(h.shape[1])]
    return {"rows": int(h.shape[0]), "per_position": per_pos,
            "acceptance_length": float(1 + lead.sum(-1).float().mean()) if len(h) else float("nan")}
