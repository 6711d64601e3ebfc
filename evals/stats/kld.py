"""Token statistics under the names and percentile set of llama.cpp's `llama-perplexity --kl-divergence`.

llama.cpp (tools/perplexity/perplexity.cpp) prints three blocks; the keys here are its labels with the padding
collapsed, and its units: PPLs and KLD as numbers, Δp, "Same top p" and the correlation in percent.
- Perplexity statistics: Mean PPL(Q), Mean PPL(base), Cor(ln(PPL(Q)), ln(PPL(base))) (the Pearson correlation of
  the per-token log-probabilities of the two models), Mean ln(PPL(Q)/PPL(base)), Mean PPL(Q)/PPL(base),
  Mean PPL(Q)-PPL(base).
- KL divergence statistics: Mean KLD, Maximum KLD, 99.9% / 99.0% / 95.0% / 90.0% KLD, Median KLD,
  10.0% / 5.0% / 1.0% / 0.1% KLD, Minimum KLD.
- Token probability statistics: Mean Δp, Maximum Δp, 99.9% ... 0.1% Δp, Minimum Δp, RMS Δp, Same top p, where
  Δp = p_Q(correct token) - p_base(correct token).
"Mean" entries are [value, ±] with ± the standard error over tokens, as llama.cpp prints them. Percentiles are
numpy's linear-interpolated quantiles over all tokens (llama.cpp reads a sorted array at the nearest rank; on
thousands of tokens the two agree to the printed digits). What differs is which tokens are scored: see
"Perplexity method" in docs/eval.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def _sem(x: np.ndarray) -> float:
    return float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan


def _label(p: float, what: str) -> str:
    return f"Median {what}" if p == 50.0 else f"{p:.1f}% {what}"


def _distribution(x: np.ndarray, what: str, percentiles: tuple[float, ...], scale: float) -> dict[str, Any]:
    out: dict[str, Any] = {f"Mean {what}": [float(x.mean()) * scale, _sem(x) * scale],
                           f"Maximum {what}": float(x.max()) * scale}
    out.update({_label(p, what): float(np.percentile(x, p)) * scale for p in percentiles})
    out[f"Minimum {what}"] = float(x.min()) * scale
    return out


def llama_cpp_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp's --kl-divergence summary over all tokens of `records` (stats.token_item_record dicts)."""
    records = [r for r in records if r.get("tokens")]
    if not records:
        return {}
    nll_q = np.concatenate([np.asarray(r["nll_candidate"], dtype=np.float64) for r in records])
    nll_b = np.concatenate([np.asarray(r["nll_baseline"], dtype=np.float64) for r in records])
    n = nll_q.size
    ppl_q, ppl_b = math.exp(nll_q.mean()), math.exp(nll_b.mean())
    ln_ratio = nll_q - nll_b
    cov = np.cov(nll_q, nll_b) if n > 1 else np.full((2, 2), math.nan)
    # PPL(Q)-PPL(base) by the delta method, with the two models' correlation (both score the same tokens)
    diff_var = (ppl_q ** 2 * cov[0, 0] + ppl_b ** 2 * cov[1, 1] - 2 * ppl_q * ppl_b * cov[0, 1]) / n
    cor = float(np.corrcoef(nll_q, nll_b)[0, 1]) if n > 1 and nll_q.std() > 0 and nll_b.std() > 0 else math.nan
    out: dict[str, Any] = {
        "tokens": int(n),
        "units": "KLD and PPL as numbers; Δp, Same top p and Cor(...) in percent, as llama-perplexity prints them",
        "Mean PPL(Q)": [ppl_q, ppl_q * _sem(nll_q)],
        "Mean PPL(base)": [ppl_b, ppl_b * _sem(nll_b)],
        "Cor(ln(PPL(Q)), ln(PPL(base)))": 100.0 * cor,
        "Mean ln(PPL(Q)/PPL(base))": [float(ln_ratio.mean()), _sem(ln_ratio)],
        "Mean PPL(Q)/PPL(base)": [math.exp(ln_ratio.mean()), math.exp(ln_ratio.mean()) * _sem(ln_ratio)],
        "Mean PPL(Q)-PPL(base)": [ppl_q - ppl_b, math.sqrt(diff_var) if diff_var >= 0 else math.nan],
    }
    if all("kld" in r for r in records):
        kld = np.concatenate([np.asarray(r["kld"], dtype=np.float64) for r in records])
        out.update(_distribution(kld, "KLD", KLD_PERCENTILES, 1.0))
    dp = np.exp(-nll_q) - np.exp(-nll_b)
    out.update(_distribution(dp, "Δp", DP_PERCENTILES, 100.0))
    rms = float(np.sqrt((dp ** 2).mean()))
    out["RMS Δp"] = [100.0 * rms, 100.0 * _sem(dp ** 2) / (2 * rms) if rms > 0 else math.nan]  # delta method
    if all("same_top1" in r for r in records):
        same = np.concatenate([np.asarray(r["same_top1"], dtype=np.float64) for r in records])
        p = float(same.mean())
        out["Same top p"] = [100.0 * p, 100.0 * math.sqrt(p * (1 - p) / same.size)]
    return out
