"""Self-distillation of an EAGLE-3 head: soft targets are the target's own next-token distribution over the
draft vocabulary, features its hidden states at the three aux layers, on the corpus of qtoolkit/draft/corpus.py,
with training-time-test unrolling (qtoolkit/draft/ttt.py). Resumable from its output folder; CPU by default,
CUDA when present; stops at a time budget and reports held-out acceptance per draft position."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..progress import bar, status
from .batches import Item, collate, epoch_batches
from .data import KINDS
from .head import Eagle3Head
from .state import save_state
from .ttt import acceptance, chain_hits, distill_loss, unroll

EVAL_K = 4  # chain length the held-out acceptance is reported at


@dataclass
class LoopArgs:
    ttt_steps: int = 4
    epochs: int = 3
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    time_budget_s: float = 3000.0
    eval_every: int = 100
    checkpoint_every_s: float = 300.0
    seed: int = 0


@dataclass
class LoopState:
    epoch: int = 0
    batch: int = 0  # next batch of the epoch
    step: int = 0
    elapsed_s: float = 0.0  # training seconds over every run
    history: list[dict[str, Any]] = field(default_factory=list)


def init_head(head: Eagle3Head, teacher: Any, vocab: torch.Tensor) -> None:
    """The draft's LM head starts as the target's rows of the draft tokens, its final norm as the target's."""
    head.set_vocab(vocab)
    with torch.no_grad():
        head.lm_head.weight.copy_(teacher.lm_head_weight[vocab.to(teacher.lm_head_weight.device)])
        head.norm.weight.copy_(teacher.model.model.norm.weight)


@torch.no_grad()
def evaluate(head: Eagle3Head, embed: torch.Tensor, heldout: dict[str, list[Item]], device: torch.device,
             k: int = EVAL_K, batch_size: int = 8) -> dict[str, dict]:
    """Per workload: conditional acceptance per draft position and tokens per verification step at chain k,
    from the rows after each held-out prompt (the target's own greedy text)."""
    head.eval()
    out = {}
    for kind in KINDS:
        hits, rows = [], []
        for i in range(0, len(heldout.get(kind, [])), batch_size):
            b = collate(heldout[kind][i:i + batch_size], device, scored_from_prompt=True)
            h, r = chain_hits(head, unroll(head, embed, b, k), b)
            hits.append(h.reshape(-1, k).cpu())
            rows.append(r.reshape(-1).cpu())
        out[kind] = acceptance(torch.cat(hits), torch.cat(rows)) if hits else {"rows": 0}
    head.train()
    return out


def postfix(loss: float, acc: dict[str, dict]) -> dict[str, str]:
    fields = {"loss": f"{loss:.3f}"}
    for kind, a in acc.items():
        if a.get("rows"):
            fields[kind[:4]] = "/".join(f"{x:.2f}" for x in a["per_position"]) + f" L{a['acceptance_length']:.2f}"
    return fields


def train_loop(head: Eagle3Head, opt: torch.optim.Optimizer, embed: torch.Tensor, teacher_rows: torch.Tensor,
               train: list[Item], heldout: dict[str, list[Item]], args: LoopArgs, state: LoopState,
               folder: Path, device: torch.device) -> LoopState:
    lengths = [len(it.sample.token_ids) for it in train]
    per_epoch = len(epoch_batches(len(train), args.batch_size, lengths, args.seed))
    total = per_epoch * args.epochs
    progress = bar(total=total, initial=min(state.step, total), desc="train-draft", unit="batch")
    start, last_ckpt, acc, loss_ema = time.monotonic(), time.monotonic(), {}, None
    base_elapsed = state.elapsed_s
    head.train()
    try:
        while state.epoch < args.epochs:
            batches = epoch_batches(len(train), args.batch_size, lengths, args.seed + state.epoch)
            while state.batch < len(batches):
                if base_elapsed + time.monotonic() - start >= args.time_budget_s:
                    status(f"time budget of {args.time_budget_s:.0f} s reached at step {state.step}")
                    return state
                batch = collate([train[i] for i in batches[state.batch]], device)
                loss, _ = distill_loss(unroll(head, embed, batch, args.ttt_steps), batch, teacher_rows)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opt.step()
                state.batch, state.step = state.batch + 1, state.step + 1
                value = float(loss.detach())
                loss_ema = value if loss_ema is None else 0.95 * loss_ema + 0.05 * value
                if state.step % args.eval_every == 0:
                    acc = evaluate(head, embed, heldout, device)
                    state.history.append({"step": state.step, "loss": loss_ema, "heldout": acc})
                progress.update(1)
                progress.set_postfix(postfix(loss_ema, acc), refresh=False)
                state.elapsed_s = base_elapsed + time.monotonic() - start
                if time.monotonic() - last_ckpt >= args.checkpoint_every_s:
                    save_state(folder, head, opt, counters(state, args))
                    last_ckpt = time.monotonic()
            state.epoch, state.batch = state.epoch + 1, 0
        return state
    finally:
        state.elapsed_s = base_elapsed + time.monotonic() - start
        progress.close()


def counters(state: LoopState, args: LoopArgs) -> dict[str, Any]:
    return {"epoch": state.epoch, "batch": state.batch, "step": state.step, "elapsed_s": state.elapsed_s,
            "history": state.history, "loop": vars(args)}
