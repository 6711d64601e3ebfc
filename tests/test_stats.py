"""Paired CIs (bootstrap, Tango, Newcombe, t), pass@k and the llama.cpp-style token statistics on data with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from qtoolkit.evals.stats.paired import bootstrap_ci, paired_delta, pass_at_k, token_item_record, token_stats


def test_bootstrap_ci_is_seeded_and_covers_the_mean():
    rng = np.random.default_rng(1)
    x = rng.normal(0.3, 1.0, size=200)
    a, b = bootstrap_ci(x, seed=7), bootstrap_ci(x, seed=7)
    assert a == b
    assert a[0] < x.mean() < a[1]
    se = x.std(ddof=1) / math.sqrt(x.size)
    assert a[1] - a[0] == pytest.approx(2 * 1.96 * se, rel=0.2)


def test_weighted_bootstrap_uses_ratio_of_sums():
    ci = bootstrap_ci([1.0, 3.0], [3.0, 1.0], seed=0, n_resamples=4000, method="percentile")
    assert 1.0 <= ci[0] <= 1.5 and 2.5 <= ci[1] <= 3.0


def test_paired_delta_removes_shared_item_difficulty():
    rng = np.random.default_rng(0)
    difficulty = rng.normal(0, 5, size=100)  # large per-item spread shared by both models
    base = difficulty
    cand = difficulty + 0.1 + rng.normal(0, 0.01, size=100)
    d = paired_delta(cand, base, seed=0)
    assert d["delta"] == pytest.approx(0.1, abs=0.01)
    assert 0.09 < d["ci95"][0] < d["ci95"][1] < 0.11  # an unpaired CI would span about ±1.4
    with pytest.raises(ValueError):
        paired_delta([1.0], [1.0, 2.0], seed=0)


def test_pass_at_k_matches_the_closed_form():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    assert pass_at_k(5, 5, 5) == 1.0


def _scores(logits: torch.Tensor, targets: torch.Tensor):
    lp = torch.log_softmax(logits, -1)
    return lp.gather(1, targets.view(-1, 1)).squeeze(1), lp


def test_identical_models_give_zero_kld_and_unit_ratio():
    torch.manual_seed(0)
    logits, targets = torch.randn(50, 32), torch.randint(0, 32, (50,))
    t, lp = _scores(logits, targets)
    rec = token_item_record(t, t, lp, lp)
    s = token_stats([rec, rec], seed=0)
    assert s["kld"]["mean_pm"][0] == pytest.approx(0.0, abs=1e-6) and s["kld"]["max"] == pytest.approx(0.0, abs=1e-6)
    assert s["ppl_ratio"]["mean_pm"][0] == pytest.approx(1.0)
    assert s["same_top1"]["mean_pm"][0] == 1.0
    assert s["delta_p"]["mean_pm"][0] == pytest.approx(0.0, abs=1e-6)


def test_kld_matches_torch_and_grows_with_noise():
    torch.manual_seed(0)
    base, targets = torch.randn(200, 64), torch.randint(0, 64, (200,))
    tb, lb = _scores(base, targets)
    out = []
    for noise in (0.1, 1.0):
        tc, lc = _scores(base + noise * torch.randn_like(base), targets)
        rec = token_item_record(tc, tb, lc, lb)
        ref = torch.nn.functional.kl_div(lc, lb, log_target=True, reduction="none").sum(-1)
        assert np.allclose(rec["kld"], ref.numpy(), rtol=1e-3, atol=1e-6)
        out.append(token_stats([rec], seed=0))
    assert out[0]["kld"]["mean_pm"][0] < out[1]["kld"]["mean_pm"][0]
    assert out[0]["same_top1"]["mean_pm"][0] > out[1]["same_top1"]["mean_pm"][0]
    s = out[1]
    assert s["kld"]["median"] <= s["kld"]["p90"] <= s["kld"]["p99"] <= s["kld"]["max"]
    assert s["ppl_ratio"]["mean_pm"][0] == pytest.approx(s["ppl_candidate"] / s["ppl_baseline"])


def test_missing_distributions_are_reported_not_guessed():
    t = torch.tensor([-1.0, -2.0, -0.5])
    s = token_stats([token_item_record(t, t + 0.1)], seed=0)
    assert "kld" not in s and "same_top1" not in s
    assert len(s["not_computed"]) == 2
    assert s["ln_ppl_ratio"]["mean_pm"][0] == pytest.approx(0.1, abs=1e-5)  # the baseline is better


def test_bca_matches_scipy_and_is_not_the_percentile_interval():
    from scipy.stats import bootstrap

    x = np.random.default_rng(3).gamma(3.0, size=20)  # skewed but without lone outliers (a lumpy bootstrap)
    ours = bootstrap_ci(x, seed=1, n_resamples=8000, method="bca")
    ref = bootstrap((x,), np.mean, method="BCa", n_resamples=8000, random_state=1).confidence_interval
    assert ours == pytest.approx([ref.low, ref.high], rel=0.02)
    assert ours != pytest.approx(bootstrap_ci(x, seed=1, n_resamples=8000, method="percentile"), rel=0.01)


def test_paired_delta_names_its_method_and_coverage():
    rng = np.random.default_rng(0)
    base = rng.normal(1.0, 0.2, size=8)
    d = paired_delta(base + rng.normal(0.05, 0.02, size=8), base, [50, 60, 70, 80, 90, 100, 110, 120], seed=0)
    assert set(d) >= {"candidate", "baseline", "delta", "ci95", "items", "ci_method", "ci_coverage", "ci_reliable"}
    assert d["ci_reliable"] is True and d["ci_coverage"] >= 0.93 and d["ci_method"]
    assert d["ci95"][0] < d["delta"] < d["ci95"][1]
    tiny = paired_delta([1.0, 2.0], [1.5, 1.0], seed=0)
    assert tiny["ci_reliable"] is False and tiny["ci_coverage"] is None  # below the simulated sizes


def test_binary_deltas_never_collapse_to_a_point():
    # 8 problems failed by both models: the old percentile bootstrap said [0, 0]
    d = paired_delta([0] * 8, [0] * 8, seed=0)
    assert d["delta"] == 0 and "Tango" in d["ci_method"]
    assert d["ci95"][0] == pytest.approx(-0.3244, abs=1e-3) and d["ci95"][1] == pytest.approx(0.3244, abs=1e-3)
    one = paired_delta([1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], seed=0)  # one flip out of 8
    assert one["ci95"][0] < -0.125 < one["ci95"][1] and one["ci95"][1] > 0
    assert paired_delta([True] * 40, [True] * 40, seed=0)["ci95"][1] < d["ci95"][1]  # more items, narrower


def test_ratio_over_rounds_reports_its_coverage():
    from qtoolkit.evals.stats.paired import ratio_over_rounds

    r = ratio_over_rounds([13.9, 12.1, 11.1, 15.4, 14.9], [10.0] * 5)
    assert r["ci_reliable"] is True and r["ci_coverage"] >= 0.93 and "round" in r["ci_method"]
    assert ratio_over_rounds([12.0], [10.0])["ci_reliable"] is False


def test_token_statistics_are_clustered_by_item():
    """Two items whose tokens disagree as blocks: the item interval is far wider than the token `±`."""
    lo = token_item_record(torch.full((200,), -1.0), torch.full((200,), -1.0))
    hi = token_item_record(torch.full((200,), -1.5), torch.full((200,), -1.0))
    rng = np.random.default_rng(0)
    recs = []
    for i in range(8):
        r = dict(hi if i % 2 else lo)
        r["kld"] = (rng.lognormal(-4, 1, 200) * (3 if i % 2 else 1)).tolist()
        recs.append(r)
    s = token_stats(recs, seed=0)
    for key in ("kld", "ln_ppl_ratio", "ppl_ratio", "delta_p"):
        assert {"ci95", "ci_method", "ci_coverage", "ci_reliable"} <= set(s[key])
    kld = s["kld"]
    assert kld["ci95"][1] - kld["ci95"][0] > 5 * 2 * 1.96 * kld["mean_pm"][1]
    assert kld["ci95"][0] < kld["mean_pm"][0] < kld["ci95"][1]


def test_identical_outputs_on_most_items_are_not_vouched_for():
    """7 of 8 summaries identical: the ROUGE delta rests on one item, so no interval keeps its coverage."""
    d = paired_delta([0.3] * 7 + [0.1], [0.3] * 7 + [0.4], seed=0)
    assert d["ci_reliable"] is False
    assert all(math.isfinite(x) for x in d["ci95"]) and d["ci95"][0] < d["delta"] < d["ci95"][1]
    # a spread of differing items is vouched for from 32 items (below that a ROUGE-L drop on its bound skews the
    # deltas past every interval's coverage: measurements/2026-12-04/issue39/ci-coverage.json)
    fine = paired_delta(np.linspace(0.1, 0.5, 32), np.linspace(0.1, 0.5, 32)[::-1], seed=0)
    assert fine["ci_reliable"] is True
