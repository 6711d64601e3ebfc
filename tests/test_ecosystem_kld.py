"""llama.cpp's --kl-divergence statistics: its labels, its percentile set and units, computed independently."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from qtoolkit.evals.perplexity import PerplexityTask
from qtoolkit.evals.stats.kld import llama_cpp_stats
from qtoolkit.evals.stats.paired import token_item_record

LLAMA_CPP_LABELS = [
    "Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))",
    "Mean PPL(Q)/PPL(base)", "Mean PPL(Q)-PPL(base)",
    "Mean KLD", "Maximum KLD", "99.9% KLD", "99.0% KLD", "95.0% KLD", "90.0% KLD", "Median KLD", "10.0% KLD",
    "5.0% KLD", "1.0% KLD", "0.1% KLD", "Minimum KLD",
    "Mean Δp", "Maximum Δp", "99.9% Δp", "99.0% Δp", "95.0% Δp", "90.0% Δp", "75.0% Δp", "Median Δp", "25.0% Δp",
    "10.0% Δp", "5.0% Δp", "1.0% Δp", "0.1% Δp", "Minimum Δp", "RMS Δp", "Same top p",
]


def _records(seed: int = 0, items: int = 3, tokens: int = 200, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(items):
        base = torch.randn(tokens, vocab, generator=g) * 2
        cand = base + 0.3 * torch.randn(tokens, vocab, generator=g)
        lb, lc = base.log_softmax(-1), cand.log_softmax(-1)
        target = torch.randint(0, vocab, (tokens,), generator=g)
        idx = torch.arange(tokens)
        out.append((token_item_record(lc[idx, target], lb[idx, target], lc, lb), lc, lb, target))
    return out


def test_labels_and_values_match_an_independent_computation():
    data = _records()
    s = llama_cpp_stats([r for r, *_ in data])
    assert [k for k in LLAMA_CPP_LABELS if k not in s] == []
    lc = torch.cat([d[1] for d in data]).double()
    lb = torch.cat([d[2] for d in data]).double()
    tgt = torch.cat([d[3] for d in data])
    kld = (lb.exp() * (lb - lc)).sum(-1).numpy()  # KL(base || Q) per token, as llama.cpp
    idx = torch.arange(tgt.numel())
    pq, pb = lc[idx, tgt].exp().numpy(), lb[idx, tgt].exp().numpy()
    assert s["tokens"] == 600
    assert s["Mean KLD"][0] == pytest.approx(kld.mean(), rel=1e-3)
    assert s["99.0% KLD"] == pytest.approx(np.percentile(kld, 99), rel=1e-3)
    assert s["Median KLD"] == pytest.approx(np.median(kld), rel=1e-3)
    assert s["Minimum KLD"] <= s["1.0% KLD"] <= s["Median KLD"] <= s["99.9% KLD"] <= s["Maximum KLD"]
    assert s["Mean Δp"][0] == pytest.approx(100 * (pq - pb).mean(), abs=1e-3)  # percent, as llama.cpp prints
    assert s["RMS Δp"][0] == pytest.approx(100 * np.sqrt(((pq - pb) ** 2).mean()), rel=1e-3)
    same = (lc.argmax(-1) == lb.argmax(-1)).double().mean().item()
    assert s["Same top p"][0] == pytest.approx(100 * same)
    cor = np.corrcoef(np.log(pq), np.log(pb))[0, 1]
    assert s["Cor(ln(PPL(Q)), ln(PPL(base)))"] == pytest.approx(100 * cor, rel=1e-3)
    ppl_q, ppl_b = math.exp(-np.log(pq).mean()), math.exp(-np.log(pb).mean())
    assert s["Mean PPL(Q)/PPL(base)"][0] == pytest.approx(ppl_q / ppl_b, rel=1e-4)
    assert s["Mean PPL(Q)-PPL(base)"][0] == pytest.approx(ppl_q - ppl_b, rel=1e-3)
    assert all(math.isfinite(v[1]) for k, v in s.items() if k.startswith("Mean "))


def test_identical_models_give_zero_divergence():
    rec, _, lb, _ = _records(items=1)[0]
    same = dict(rec, nll_candidate=rec["nll_baseline"], kld=[0.0] * rec["tokens"],
                same_top1=[1] * rec["tokens"])
    s = llama_cpp_stats([same])
    assert s["Maximum KLD"] == 0 and s["Mean Δp"][0] == 0 and s["Same top p"][0] == 100.0
    assert s["Cor(ln(PPL(Q)), ln(PPL(base)))"] == pytest.approx(100.0)


def test_perplexity_summary_carries_the_llama_cpp_block():
    data = _records(items=2)
    records = [{"id": f"code/{i}", "text_set": "code", "token_record": r} for i, (r, *_) in enumerate(data)]
    out = PerplexityTask().summarize(records, seed=0)
    block = out["code"]["llama_cpp"]
    assert block["Mean KLD"][0] == pytest.approx(out["code"]["kld"]["mean_pm"][0], rel=1e-6)
    assert "Same top p" in block and "units" in block


def test_no_kld_block_without_distributions():
    rec, *_ = _records(items=1)[0]
    s = llama_cpp_stats([{k: v for k, v in rec.items() if k not in ("kld", "same_top1")}])
    assert "Mean KLD" not in s and "Same top p" not in s and "Mean Δp" in s
