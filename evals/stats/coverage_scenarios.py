"""Simulated paired samples with a known true mean, in the shapes the sign-off's gates meet.

Each scenario draws `runs` independent samples of `n` items at once (numpy, one row per sample) and knows the
population value the interval is meant to contain. `calibrated` scenarios make the shipped table: the spread
the default model's fp8-dynamic eval shows at 8 items (measurements/2026-12-01/README.md) and wider ones;
`stress` ones are only measured, to show where an interval stops holding. Shapes:

- kld (and kld-heavy, a wider spread between items): per-token KLD, clustered by item (an item effect times a
  per-token lognormal), averaged over variable token counts: item means and token weights, as token_stats sees;
- nll: per-item mean NLL deltas on a reference text, token-weighted, with a skewed item effect;
- bounded (and bounded-sparse, most outputs identical): ROUGE-like scores in [0, 1], the candidate's a
  perturbed copy of the baseline's or the same when both models wrote the same text;
- binary: pass/fail with correlated pairs (the candidate flips some of the baseline's outcomes);
- rounds: log-normal (or heavier, t-distributed) per-round speedup ratios over 2-10 rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Sample:
    v: np.ndarray  # [runs, n] per-item values (deltas), or log ratios for rounds
    w: np.ndarray | None = None  # [runs, n] token weights
    cand: np.ndarray | None = None  # binary shapes: [runs, n] pass/fail per side
    base: np.ndarray | None = None
    token_se: np.ndarray | None = None  # kld: the token-iid standard error llama.cpp prints (the `±`)


@dataclass(frozen=True)
class Scenario:
    name: str
    shape: str
    kind: str  # calibrated | stress
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> str:  # "kld-heavy" is drawn like "kld", only with other parameters
        return self.shape.split("-")[0]

    def draw(self, rng: np.random.Generator, runs: int, n: int) -> Sample:
        return DRAW[self.family](rng, runs, n, **self.params)

    def truth(self) -> float:
        return TRUTH[self.family](**self.params)


def _lognormal_mean1(rng, sigma: float, size) -> np.ndarray:
    return rng.lognormal(-sigma ** 2 / 2, sigma, size=size)


def _tokens(rng, runs: int, n: int, lo: int, hi: int) -> np.ndarray:
    return rng.integers(lo, hi + 1, size=(runs, n))


def draw_kld(rng, runs, n, mean, item_sigma, token_sigma, tokens=(40, 300)) -> Sample:
    t = _tokens(rng, runs, n, *tokens)
    u = mean * _lognormal_mean1(rng, item_sigma, (runs, n))
    tmax = int(t.max())
    sums, sq = np.zeros((runs, n)), np.zeros((runs, n))
    for r0 in range(0, runs, 100):  # bounded memory: 100 runs x n items x tmax tokens at a time
        sl = slice(r0, r0 + 100)
        mask = np.arange(tmax)[None, None, :] < t[sl, :, None]
        tok = u[sl, :, None] * _lognormal_mean1(rng, token_sigma, (mask.shape[0], n, tmax)) * mask
        sums[sl], sq[sl] = tok.sum(-1), (tok ** 2).sum(-1)
    total = t.sum(1)
    mean_tok = sums.sum(1) / total
    var_tok = (sq.sum(1) - total * mean_tok ** 2) / (total - 1)
    return Sample(sums / t, t.astype(np.float64), token_se=np.sqrt(np.maximum(var_tok, 0) / total))


def draw_nll(rng, runs, n, mean, item_sd, item_skew, token_sd, tokens=(20, 200)) -> Sample:
    t = _tokens(rng, runs, n, *tokens)
    if item_skew > 0:
        raw = _lognormal_mean1(rng, item_skew, (runs, n)) - 1.0
        effect = raw / np.sqrt(np.expm1(item_skew ** 2))
    else:
        effect = rng.standard_normal((runs, n))
    noise = rng.standard_t(3, size=(runs, n)) / np.sqrt(3) * token_sd / np.sqrt(t)  # mean of t3 token noise
    return Sample(mean + item_sd * effect + noise, t.astype(np.float64))


def _rouge_pairs(rng, size, a, b, same, near, shift, sd) -> tuple[np.ndarray, np.ndarray]:
    """Baseline ~ Beta(a, b); the candidate's output is identical (p = same), diverges late (p = near: a
    small change) or early (a large shifted change), clipped to [0, 1]."""
    base = rng.beta(a, b, size=size)
    u = rng.random(size)
    change = np.where(u < same + near, rng.normal(0.0, 0.01, size=size), rng.normal(shift, sd, size=size))
    return np.where(u < same, base, np.clip(base + change, 0.0, 1.0)), base


def draw_bounded(rng, runs, n, **p) -> Sample:
    cand, base = _rouge_pairs(rng, (runs, n), **p)
    return Sample(cand - base)


def _binary_pairs(rng, size, p_base, flip_pass, flip_fail) -> tuple[np.ndarray, np.ndarray]:
    base = rng.random(size) < p_base
    flip = rng.random(size) < np.where(base, flip_pass, flip_fail)
    return base ^ flip, base


def draw_binary(rng, runs, n, **p) -> Sample:
    cand, base = _binary_pairs(rng, (runs, n), **p)
    return Sample(cand.astype(np.float64) - base, cand=cand, base=base)


def draw_rounds(rng, runs, n, log_mean, log_sd, df=None) -> Sample:
    z = rng.standard_normal((runs, n)) if df is None else rng.standard_t(df, (runs, n)) / np.sqrt(df / (df - 2))
    return Sample(log_mean + log_sd * z)


def _mc_truth(draw, **p) -> float:
    """Population mean by a 4M-item Monte Carlo (error ~1e-3 of the spread: far below any interval width)."""
    cand, base = draw(np.random.default_rng(12345), (2_000_000,), **p)
    return float(np.mean(cand.astype(np.float64) - base))


DRAW = {"kld": draw_kld, "nll": draw_nll, "bounded": draw_bounded, "binary": draw_binary, "rounds": draw_rounds}
TRUTH = {
    "kld": lambda mean, **_: mean,
    "nll": lambda mean, **_: mean,
    "bounded": lambda **p: _mc_truth(_rouge_pairs, **p),
    "binary": lambda p_base, flip_pass, flip_fail: p_base * -flip_pass + (1 - p_base) * flip_fail,
    "rounds": lambda log_mean, **_: log_mean,
}
