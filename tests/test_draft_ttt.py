"""Training-time test unrolls the head exactly as chain drafting runs it: step s of row i equals drafting with
the head's KV cache after a prefill of rows 0..i from target features."""

from __future__ import annotations

import pytest
import torch
from test_draft_format import make_head, target_config

from qtoolkit.draft.head import DraftKV
from qtoolkit.draft.ttt import Batch, acceptance, distill_loss, unroll


def test_unrolled_steps_equal_chain_drafting_with_the_kv_cache():
    target = target_config(hidden=64, layers=4, vocab=300)
    head = make_head(target, draft_vocab=50)
    torch.manual_seed(1)
    T, steps = 9, 4
    embed = torch.randn(300, 64)
    batch = Batch(ids=torch.randint(0, 300, (2, T)), aux=torch.randn(2, T, 192), final=torch.randn(2, T, 64),
                  valid=torch.ones(2, T, dtype=torch.bool), first_row=torch.zeros(2, dtype=torch.long))
    logits = unroll(head, embed, batch, steps)
    for b in range(2):
        ids = batch.ids[b]
        for i in (0, 3, T - 1 - steps):
            kv = DraftKV.empty(head.config)
            rows = torch.arange(i + 1)
            out, lg = head.step(embed[ids[rows + 1]], head.fuse(batch.aux[b, :i + 1]), rows, kv)
            hidden, chain = out[-1:], [lg[-1]]
            for s in range(1, steps):
                out, lg = head.step(embed[ids[i + 1 + s]][None], hidden, torch.tensor([i + s]), kv)
                hidden = out
                chain.append(lg[0])
            for s in range(steps):
                assert torch.allclose(logits[s][b, i], chain[s], atol=1e-4), (b, i, s)


def test_soft_cross_entropy_at_the_teacher_is_its_entropy_and_acceptance_counts_chains():
    batch = Batch(ids=torch.randint(0, 300, (1, 6)), aux=torch.randn(1, 6, 192), final=torch.randn(1, 6, 64),
                  valid=torch.ones(1, 6, dtype=torch.bool), first_row=torch.zeros(1, dtype=torch.long))
    rows = torch.randn(50, 64)
    teacher_logits = batch.final @ rows.T  # row t predicts token t+1; draft row i of step 0 predicts i+2
    _, per_step = distill_loss([teacher_logits[:, 1:]], batch, rows)
    p = torch.softmax(teacher_logits[:, 1:], -1)
    entropy = -(p * torch.log_softmax(teacher_logits[:, 1:], -1)).sum(-1)
    assert abs(per_step[0] - float(entropy.mean())) < 1e-4
    _, worse = distill_loss([torch.zeros(1, 5, 50)], batch, rows)
    assert worse[0] > per_step[0]
    hits = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    a = acceptance(hits, torch.tensor([True, True, True]))
    assert a["per_position"] == pytest.approx([2 / 3, 1.0, 0.5, 1.0])
    assert abs(a["acceptance_length"] - (1 + (2 + 0 + 4) / 3)) < 1e-6
