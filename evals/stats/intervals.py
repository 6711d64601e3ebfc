"""Vectorized 95% intervals for a (weighted) mean of per-item values, one sample per row.

Every function takes `v` [runs, n] (and `w` [runs, n] token weights, or None) and returns (lo, hi) arrays of
shape [runs]. The sign-off calls them with one row; the coverage harness (evals/stats/coverage.py) calls the very same
code with thousands of simulated rows, so what is measured is what ships. The point estimate is always the ratio
of sums sum(w v) / sum(w), the figure the gates read as "mean".

Bootstrap resamples are multinomial counts shared by all rows (rows are independent samples, so sharing the
draws biases nothing) and every resampled statistic is a matrix product: 2,000 runs x 2,000 resamples of 164
items take well under a second. scipy.stats.bootstrap(method="BCa") computes the same BCa interval, but one
sample per call (seconds per 2,000 simulated runs at n = 8, minutes at 164) and it returns NaN with a warning on
an all-equal sample; tests/test_stats.py checks the two agree.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import norm
from scipy.stats import t as student_t

Interval = tuple[np.ndarray, np.ndarray]


def resample_counts(n: int, n_resamples: int, seed: int) -> np.ndarray:
    """[n_resamples, n] multinomial counts: how often each item appears in each bootstrap resample."""
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=n_resamples).astype(np.float64)


def _weights(v: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    return np.ones_like(v) if w is None else np.broadcast_to(w, v.shape).astype(np.float64)


def point_and_se(v: np.ndarray, w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ratio-of-sums mean and its linearized standard error (s / sqrt(n) when unweighted)."""
    w = _weights(v, w)
    sw = w.sum(-1)
    m = (w * v).sum(-1) / sw
    n = v.shape[-1]
    var = (w ** 2 * (v - m[..., None]) ** 2).sum(-1) / sw ** 2 * n / max(n - 1, 1)
    return m, np.sqrt(var)


def _boot(v: np.ndarray, w: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Point estimates [runs] and resampled means [runs, B], centred on the point (better conditioned)."""
    m, _ = point_and_se(v, w)
    d = v - m[:, None]
    sw = w @ counts.T
    return m, (w * d) @ counts.T / sw


def percentile(v, w, counts, confidence: float = 0.95) -> Interval:
    """The bootstrap percentile interval (what the sign-off used before: too narrow at small n)."""
    m, delta = _boot(v, _weights(v, w), counts)
    a = (1 - confidence) / 2
    lo, hi = np.quantile(delta, [a, 1 - a], axis=1)
    return m + lo, m + hi


def _row_quantiles(sorted_rows: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Linear-interpolated quantile of each row at its own level (levels [runs])."""
    b = sorted_rows.shape[1]
    pos = np.clip(levels, 0.0, 1.0) * (b - 1)
    i = np.floor(pos).astype(int)
    j = np.minimum(i + 1, b - 1)
    g = pos - i
    rows = np.arange(sorted_rows.shape[0])
    return sorted_rows[rows, i] * (1 - g) + sorted_rows[rows, j] * g


def bca_parts(v, w, counts) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What a BCa interval at any level is read from: the point [runs], the sorted resampled deltas [runs, B],
    the bias correction z0 and the acceleration [runs] (the jackknife's)."""
    w = _weights(v, w)
    m, delta = _boot(v, w, counts)
    b = delta.shape[1]
    share = ((delta < 0).sum(1) + 0.5 * (delta == 0).sum(1)) / b
    z0 = norm.ppf(np.clip(share, 0.5 / b, 1 - 0.5 / b))
    swv, sw = (w * v).sum(-1, keepdims=True), w.sum(-1, keepdims=True)
    jack = (swv - w * v) / np.maximum(sw - w, 1e-300)  # leave-one-out means [runs, n]
    u = jack.mean(1, keepdims=True) - jack
    den = 6 * (u ** 2).sum(1) ** 1.5
    acc = np.divide((u ** 3).sum(1), den, out=np.zeros_like(den), where=den > 0)
    return m, np.sort(delta, axis=1), z0, acc


def bca_from_parts(parts: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], confidence: float) -> Interval:
    m, srt, z0, acc = parts
    ends = []
    for zq in norm.ppf([(1 - confidence) / 2, (1 + confidence) / 2]):
        level = norm.cdf(z0 + (z0 + zq) / (1 - acc * (z0 + zq)))
        ends.append(m + _row_quantiles(srt, level))
    return ends[0], ends[1]


def bca(v, w, counts, confidence: float = 0.95) -> Interval:
    """Bias-corrected and accelerated bootstrap (Efron 1987); acceleration from the jackknife."""
    return bca_from_parts(bca_parts(v, w, counts), confidence)


def studentized_parts(v, w, counts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The point and standard error [runs] and the resampled t statistics [runs, B] a bootstrap-t reads."""
    w = _weights(v, w)
    m, se = point_and_se(v, w)
    d = v - m[:, None]
    n = v.shape[1]
    sw = w @ counts.T
    delta = (w * d) @ counts.T / sw
    s2 = ((w ** 2 * d ** 2) @ counts.T - 2 * delta * ((w ** 2 * d) @ counts.T)
          + delta ** 2 * ((w ** 2) @ counts.T)) / sw ** 2 * n / max(n - 1, 1)
    se_star = np.sqrt(np.maximum(s2, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(se_star > 0, delta / se_star, np.where(delta == 0, 0.0, np.sign(delta) * np.inf))
    return m, se, t


def studentized(v, w, counts, confidence: float = 0.95) -> Interval:
    """Bootstrap-t: quantiles of (mean* - mean) / se* replace Student's t (captures skew, wider at small n)."""
    m, se, t = studentized_parts(v, w, counts)
    a = (1 - confidence) / 2
    # order statistics, not interpolation: a resample with se* = 0 gives t* = +-inf, which must stay infinite
    q_lo, q_hi = np.quantile(t, [a, 1 - a], axis=1, method="inverted_cdf")
    with np.errstate(invalid="ignore"):
        lo, hi = m - q_hi * se, m - q_lo * se
    return np.where(se > 0, lo, m), np.where(se > 0, hi, m)


def t_interval(v, w=None, counts=None, confidence: float = 0.95) -> Interval:
    """Student's t on the (linearized) standard error, n - 1 degrees of freedom."""
    m, se = point_and_se(v, w)
    half = student_t.ppf((1 + confidence) / 2, max(v.shape[1] - 1, 1)) * se
    return m - half, m + half


def newcombe_paired(cand: np.ndarray, base: np.ndarray, confidence: float = 0.95) -> Interval:
    """Newcombe's hybrid score interval (1998, method 10) for a difference of paired proportions, cand - base.

    Built from the two Wilson score intervals and the phi correlation of the 2x2 table with Newcombe's continuity
    correction: ad - bc is shrunk towards 0 by n/2 when positive (and phi is 0 when the table has an empty
    margin). Without it an all-concordant sample (no item flips) has phi = 1 and the interval collapses to the
    point 0: 8 items that agree would PASS any drop bound. With it that sample still gives a real interval.
    """
    cand, base = np.asarray(cand, dtype=bool), np.asarray(base, dtype=bool)
    n = cand.shape[-1]
    a = (cand & base).sum(-1).astype(np.float64)
    b = (cand & ~base).sum(-1).astype(np.float64)
    c = (~cand & base).sum(-1).astype(np.float64)
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, confidence)
    l2, u2 = wilson(a + c, n, confidence)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    corrected = np.where(cross > n / 2, cross - n / 2, np.minimum(cross, 0.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        phi = np.where(den > 0, corrected / np.sqrt(den), 0.0)
    lo_half = np.sqrt(np.maximum((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    hi_half = np.sqrt(np.maximum((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return p1 - p2 - lo_half, p1 - p2 + hi_half


def _discordant(cand: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(b, c, n): items only the candidate passes, items only the baseline passes, items per row."""
    cand, base = np.asarray(cand, dtype=bool), np.asarray(base, dtype=bool)
    return ((cand & ~base).sum(-1).astype(np.float64), (~cand & base).sum(-1).astype(np.float64), cand.shape[-1])


def tango_z(b: np.ndarray, c: np.ndarray, n: int, delta: np.ndarray | float) -> np.ndarray:
    """Tango's (1998) score statistic for H0: p_cand - p_base = delta, from the discordant counts b and c.

    (b - c - n delta) / sqrt(n (2 q + delta (1 - delta))), with q the maximum likelihood estimate of the share of
    items only the baseline passes under H0 (the root of Tango's quadratic). It falls as delta grows, so the
    interval is {delta : -z < T(delta) < z}. A table with no spread under H0 (variance 0) scores 0 where the
    numerator is 0 and +-inf elsewhere.
    """
    delta = np.asarray(delta, dtype=np.float64)
    qa = 2.0 * n
    qb = -b - c + (2.0 * n - b + c) * delta
    qc = -c * delta * (1 - delta)
    q = (np.sqrt(np.maximum(qb * qb - 4 * qa * qc, 0.0)) - qb) / (2 * qa)
    var = n * (2 * q + delta * (1 - delta))
    num = b - c - n * delta
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(var > 0, num / np.sqrt(np.maximum(var, 1e-300)),
                        np.where(num == 0, 0.0, np.sign(num) * np.inf))


def tango_critical(cand: np.ndarray, base: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the smallest one-sided error at which tango_paired's upper end is at or below `bound`, and at
    which its lower end is at or above it: Phi(T(bound)) and 1 - Phi(T(bound)), as T falls with delta (what the
    at-bound simulation reads instead of bisecting the interval's level)."""
    b, c, n = _discordant(cand, base)
    t = tango_z(b, c, n, bound)
    return norm.cdf(t), norm.sf(t)


def tango_paired(cand: np.ndarray, base: np.ndarray, confidence: float = 0.95) -> Interval:
    """Tango's asymptotic score interval (Stat Med 1998; 17: 891) for a difference of paired proportions.

    Each end is where the score statistic (tango_z) reaches the normal quantile, by bisection (60 halvings of
    [-1, 1]: below 1e-17, far under any gate's resolution; the returned end is the bracket's outer side, so it
    never excludes a delta the statistic keeps). It spends its error on the discordant pairs under the tested
    difference, not on two marginal Wilson intervals as Newcombe's does, so its one-sided errors sit closer to
    nominal at the policy's bound (evals/stats/at_bound.py) and a clear regression FAILs sooner. It is never a
    point: with no discordant pair it is +-z^2 / (n + z^2) (n = 8 at 95%: +-0.32).
    """
    b, c, n = _discordant(cand, base)
    z = norm.ppf((1 + confidence) / 2)
    ends = []
    for target, outer_is_low in ((z, True), (-z, False)):
        lo, hi = np.full(b.shape, -1.0), np.full(b.shape, 1.0)
        for _ in range(60):
            mid = (lo + hi) / 2
            above = tango_z(b, c, n, mid) > target  # mid lies below the root
            lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
        ends.append(lo if outer_is_low else hi)
    return ends[0], ends[1]


def wilson(k: np.ndarray, n: int, confidence: float = 0.95) -> Interval:
    """Wilson score interval for k successes out of n."""
    z = norm.ppf((1 + confidence) / 2)
    p = np.asarray(k, dtype=np.float64) / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


BOOTSTRAP_METHODS = {"percentile": percentile, "bca": bca, "studentized": studentized, "t": t_interval}
# paired pass/fail: (cand [runs, n] bool, base [runs, n] bool, confidence) -> interval of cand - base
PAIRED_BINARY_METHODS = {"newcombe": newcombe_paired, "tango": tango_paired}
