"""The speed gates: the candidate deployment against the baseline deployment under the same serving configuration
(continuous batching, speculation when the run has a proposer, the same KV budget), at every tier the policy names.

- decode: TPOT ratio baseline / candidate (per round: each side's median TPOT over the round's requests), its
  lower bound at least `throughput.min_decode_speedup`;
- prefill: TTFT ratio baseline / candidate (per round: medians), non-inferiority: its lower bound at least
  1 - `throughput.prefill_margin`;
- capacity: candidate / baseline of the highest open-loop request rate whose p99s meet `throughput.capacity.slo`
  (per round: each server's estimate from the paired search, bench/capacity.py), lower bound at least
  `throughput.capacity.min_ratio`; measured once per sign-off, not per tier (arrivals are open-loop).

Only the recipe differs between the two systems, so a gain of the batching or speculation layer is never credited
to the recipe (the ablation shows those layers, each with its interval, as the explanation).

Rounds: both systems serve each round's fresh requests back to back (interleaved), so a round's ratio carries
that round's drift on both sides; the interval is Student's t on the log ratios over rounds. While a gate is
undecided more rounds are measured, up to a budget (`qtool signoff --max-rounds`), looks at the round counts
`round_looks` plans. The error is spent over the looks as the quality gates spend it (error_spending: Lan-DeMets
Pocock-type), with the whole 5% (1 - the bench's level: a sweep's family-wise share) rather than the
quality gates' 3%: the t-interval on log-normal round ratios holds its level (the quality gates spend less
because KLD intervals undercover), and qtoolkit/signoff/speed_simulation.py measures the false PASS rate with the
truth exactly on the bound (measurements/2026-12-04/issue40/speed-gate-false-pass.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..bench.ablation import AblationBench, SpeedLooks
from ..bench.capacity import CapacityPlan, CapacityRounds, round_looks
from ..bench.loop import TierRecord
from ..evals.stats.paired import ratio_over_rounds
from . import verdicts
from .error_spending import ALPHA, Design, plan
from .policy import Policy

DECODE, PREFILL, CAPACITY = "decode", "prefill", "capacity"
# (figure, the gate's metric name) per kind: what a round's ratio is made of
KINDS = {DECODE: ("rounds_tpot", "decode_tpot_ratio"), PREFILL: ("rounds_ttft", "prefill_ttft_ratio"),
         CAPACITY: ("estimates_rps", "capacity_ratio")}


def speed_design(looks: tuple[int, ...] | list[int], alpha: float = ALPHA) -> Design:
    """The error-spending design over the looks, spending `alpha` (5%, or a sweep's family-wise share); one
    look: a plain (1 - alpha) interval."""
    return plan(tuple(looks), alpha)


@dataclass(frozen=True)
class SpeedRatio:
    """One speed figure at one tier: the geometric mean of the per-round ratios (baseline / candidate), its
    interval at `level` over `rounds` rounds, and the interval's method and simulated coverage."""

    kind: str
    concurrency: int
    ratio: float | None
    ci: tuple[float, float] | None
    rounds: int
    level: float
    method: str | None = None
    coverage: float | None = None
    reliable: bool | None = None
    per_round: tuple[float, ...] = ()

    @classmethod
    def of(cls, kind: str, tier: TierRecord, pair: tuple[str, str], level: float) -> SpeedRatio:
        """baseline / candidate of the pair's per-round medians; no figure when a round lacks one."""
        figures = getattr(tier, KINDS[kind][0]) or {}
        return cls.over_rounds(kind, tier.concurrency, figures.get(pair[0]) or [], figures.get(pair[1]) or [],
                               level)

    @classmethod
    def over_rounds(cls, kind: str, concurrency: int, base: list[float | None], cand: list[float | None],
                    level: float) -> SpeedRatio:
        """The ratio in the direction where > 1 favours the candidate (times: baseline / candidate; capacity:
        candidate / baseline) over the rounds both sides measured; no figure when a round lacks one."""
        n = min(len(base), len(cand))
        values = list(zip(base[:n], cand[:n], strict=True))
        if n == 0 or any(b is None or c is None or not b > 0 or not c > 0 or not math.isfinite(b + c)
                         for b, c in values):
            return cls(kind, concurrency, None, None, n, level)
        num, den = ([c for _, c in values], [b for b, _ in values]) if kind == CAPACITY else \
            ([b for b, _ in values], [c for _, c in values])
        r = ratio_over_rounds(num, den, confidence=level)  # type: ignore[arg-type]
        ci = r.get("ci95")
        return cls(kind, concurrency, r["ratio"], None if ci is None else (ci[0], ci[1]), n, level,
                   r.get("ci_method"), r.get("ci_coverage"), r.get("ci_reliable"), tuple(r["per_round"]))

    @property
    def complete(self) -> bool:
        """Both interval ends are finite numbers: only then can the gate pass."""
        return self.ci is not None and all(x is not None and math.isfinite(x) for x in self.ci)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "concurrency": self.concurrency, "ratio": self.ratio,
                "ci": None if self.ci is None else list(self.ci), "level": self.level, "rounds": self.rounds,
                "ci_method": self.method, "ci_coverage": self.coverage, "ci_reliable": self.reliable,
                "per_round": list(self.per_round)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SpeedRatio:
        ci = d.get("ci")
        return cls(d["kind"], int(d["concurrency"]), d.get("ratio"), None if ci is None else (ci[0], ci[1]),
                   int(d["rounds"]), float(d["level"]), d.get("ci_method"), d.get("ci_coverage"),
                   d.get("ci_reliable"), tuple(d.get("per_round") or ()))


def bench_level(bench: AblationBench, alpha: float | None = None) -> tuple[float, int]:
    """(the level the speed gates judge at, rounds measured) from bench.json's speed_rounds: the level of the
    look the rounds stopped at; a bench without further looks: its own rounds at 1 - alpha (default: the
    bench's own level)."""
    looks = bench.speed_rounds
    planned = tuple(looks.looks) if looks else ()
    rounds = int((looks.rounds if looks else None) or bench.rounds or 1)
    design = speed_design(planned if planned else (rounds,), 1 - bench.level if alpha is None else alpha)
    return design.level_at(rounds), rounds


# the share of the speed gates' error the capacity gate spends: a search's estimate is heavy-tailed when a
# server's p99 moves by half from probe to probe, and the t-interval on 5 rounds then undercovers (simulated false
# PASS 5.8% at the bound spending 5%; at 3%, 4.2%: measurements/2026-12-05/issue40d/capacity-gate-false-pass.json),
# as the quality gates spend 3% for their KLD intervals
CAPACITY_SPEND = 0.6


def capacity_ratio(capacity: CapacityRounds, alpha: float = ALPHA) -> SpeedRatio:
    """candidate / baseline capacity at the SLO over the paired search's rounds, at the level of the look the
    rounds stopped at (CAPACITY_SPEND x `alpha` spent over the plan's looks)."""
    base, cand = capacity.pair
    level = speed_design(capacity.plan.looks, CAPACITY_SPEND * alpha).level_at(len(capacity.rounds))
    return SpeedRatio.over_rounds(CAPACITY, 0, capacity.estimates(base), capacity.estimates(cand), level)


def capacity_decided(capacity: CapacityRounds, policy: Policy) -> bool:
    """Whether more rounds could not change the capacity gate: it PASSes or FAILs, or has no evidence."""
    fig = capacity_ratio(capacity)
    return fig.ratio is None or _judge_speed(fig, policy).verdict in (verdicts.PASS, verdicts.FAIL)


def capacity_plan(policy: Policy) -> CapacityPlan | None:
    """What the bench measures for the capacity gate, when the policy sets one."""
    c = policy.throughput.capacity
    return None if c is None else CapacityPlan(c.slo.slo(), c.rounds, c.requests_per_probe,
                                               max_rounds=c.max_rounds,
                                               decided=lambda rounds: capacity_decided(rounds, policy))


@dataclass(frozen=True)
class SpeedPlan:
    """What the bench measures for the speed and capacity gates, local or deployment: the speed gates' looks (rounds
    at every tier, more while undecided), the capacity searches, and the part of the policy that decides how much
    is measured (the bench step's reuse key)."""

    speed: SpeedLooks | None
    capacity: CapacityPlan | None
    inputs: dict[str, Any]

    @classmethod
    def of(cls, policy: Policy, rounds: int, max_rounds: int | None) -> SpeedPlan:
        throughput = policy.throughput
        speed, inputs = None, {}
        if throughput.min_decode_speedup is not None or throughput.prefill_margin is not None:
            looks = round_looks(rounds, max_rounds)
            speed = SpeedLooks(looks, lambda bench: not undecided(bench, policy))
            # how many rounds get measured depends on the speed bounds
            inputs |= {"speed_looks": list(looks), "speed_bounds": throughput.model_dump(
                include={"min_decode_speedup", "prefill_margin", "tiers"})}
        if (capacity := throughput.capacity) is not None:
            # what the searches measure: `required` only judges them, and so does the bound unless it decides how
            # many rounds are measured (max_rounds)
            judged_only = {"required"} | ({"min_ratio", "max_rounds"} if capacity.max_rounds is None else set())
            inputs["capacity"] = capacity.model_dump(exclude=judged_only)
        return cls(speed, capacity_plan(policy), inputs)


def speed_ratios(bench: AblationBench | None, policy: Policy, alpha: float | None = None) -> list[SpeedRatio]:
    """Every speed figure the policy gates, at every tier it names (every bench tier when it names none)."""
    bench = bench or AblationBench([])
    level, _ = bench_level(bench, alpha)
    pair = tuple(bench.speed_rounds.pair) if bench.speed_rounds else ()
    tiers = {t.concurrency: t for t in bench.tiers}
    # no bench (its step failed or was skipped): one gate per kind without a tier, never a silent absence
    wanted = policy.throughput.tiers or sorted(tiers) or [0]
    kinds = [k for k, attr in ((DECODE, "min_decode_speedup"), (PREFILL, "prefill_margin"))
             if getattr(policy.throughput, attr) is not None]
    out = []
    for c in wanted:
        for kind in kinds:
            tier = tiers.get(c)
            out.append(SpeedRatio(kind, c, None, None, 0, level) if tier is None or len(pair) != 2
                       else SpeedRatio.of(kind, tier, (pair[0], pair[1]), level))
    if policy.throughput.capacity is not None:
        spend = 1 - bench.level if alpha is None else alpha  # the whole error (a sweep's share) over its looks
        out.append(capacity_ratio(bench.capacity, spend) if bench.capacity is not None
                   else SpeedRatio(CAPACITY, 0, None, None, 0, 1 - spend))
    return out


def judge_speed(fig: SpeedRatio, policy: Policy) -> verdicts.Judgement:
    """PASS when the lower end is within the bound, FAIL when the upper end is below it, else INCONCLUSIVE;
    a missing or non-finite end never passes. The detail names the level actually used. A capacity gate the
    policy marks `required: false` is shown and can FAIL, but its INCONCLUSIVE holds no verdict."""
    j = _judge_speed(fig, policy)
    capacity = policy.throughput.capacity
    if fig.kind == CAPACITY and capacity is not None and not capacity.required:
        j.required = False
    return j


def _judge_speed(fig: SpeedRatio, policy: Policy) -> verdicts.Judgement:
    minimum = speed_limit(KINDS[fig.kind][1], policy)
    assert minimum is not None
    where = f" at concurrency {fig.concurrency}" if fig.concurrency else ""
    if fig.ratio is None and fig.kind == CAPACITY:
        return verdicts.Judgement(verdicts.NO_EVIDENCE, "not measured: some round of the paired search found no "
                                  "capacity for a server (it met the SLO at no rate down to an eighth of its "
                                  "start or missed it with requests barely overlapping, or met it at every rate "
                                  "tried): see bench.json's capacity sweeps; on a loaded "
                                  "machine run again, else set throughput.capacity.slo to what this hardware meets")
    if fig.ratio is None:
        return verdicts.Judgement(verdicts.NO_EVIDENCE, f"not measured{where}: the bench has no paired rounds of "
                                  "this tier (add the tier to --concurrency, and --rounds 3 or more)")
    if not fig.complete:
        return verdicts.Judgement(verdicts.INCONCLUSIVE, f"{fig.ratio:.3g}{where} from {fig.rounds} round(s), no "
                                  f"finite interval to judge against min {minimum:g}: pass --rounds 3 or more")
    lo, hi = fig.ci  # type: ignore[misc]
    j = verdicts.judge_interval(fig.ratio, lo, hi, max_=None, min_=minimum, n_text=f", {fig.rounds} rounds")
    j.detail += f"{where} (the {fig.level:.2%} interval over {fig.rounds} paired rounds, point {fig.ratio:.3g}x)"
    return verdicts.with_interval_method(j, fig.method, fig.coverage, fig.reliable, "rounds")


def undecided(bench: AblationBench, policy: Policy) -> bool:
    """Whether another look could change a speed gate: some gate INCONCLUSIVE and none FAILed."""
    # the capacity gate's rounds are measured after these, and extended by their own looks (capacity_decided)
    js = [judge_speed(f, policy).verdict for f in speed_ratios(bench, policy) if f.kind != CAPACITY]
    return verdicts.FAIL not in js and any(v == verdicts.INCONCLUSIVE for v in js)


def speed_limit(metric: str, policy: Policy) -> float | None:
    """The bound a speed gate's lower end is held to, from its metric name (decode_tpot_ratio@c8); None for
    another metric."""
    kind = next((k for k, (_, name) in KINDS.items() if metric.split("@")[0] == name), None)
    t = policy.throughput
    if kind == DECODE:
        return t.min_decode_speedup
    if kind == PREFILL and t.prefill_margin is not None:
        return 1 - t.prefill_margin
    if kind == CAPACITY and t.capacity is not None:
        return t.capacity.min_ratio
    return None


def speed_gate_name(fig: SpeedRatio) -> str:
    """The gate's metric: decode_tpot_ratio@c8; without a bench tier (concurrency 0) the kind alone."""
    return KINDS[fig.kind][1] + (f"@c{fig.concurrency}" if fig.concurrency else "")


def headline(figs: list[SpeedRatio], slo_text: str | None) -> str:
    """One sentence in the user's units: "Decode 3.0x faster per stream at c=1 [2.6, 3.4], ...; first token
    0.9x as soon ...; 1.2x the requests/s at p99 TTFT <= 2000 ms [1.0, 1.4]"."""

    def at(f: SpeedRatio) -> str:
        ci = f" [{f.ci[0]:.2f}, {f.ci[1]:.2f}]" if f.complete and f.ci else " (no interval)"
        return f"{f.ratio:.2f}x" + (f" at c={f.concurrency}" if f.concurrency else "") + ci

    said = []
    for kind, words in ((DECODE, "Decode {} per stream"), (PREFILL, "first token {}"),
                        (CAPACITY, "{} the requests/s at " + (slo_text or "the SLO"))):
        these = [f for f in figs if f.kind == kind and f.ratio is not None]
        if these:
            said.append(words.format(", ".join(at(f) for f in these)))
    if not said:
        return "**No speed figure was measured.**"
    text = "; ".join(said)
    return f"**{text[0].upper()}{text[1:]}** (baseline / candidate times, candidate / baseline capacity: > 1 " \
           "favours the candidate)."


def speed_answer(figs: list[SpeedRatio], pair: list[str] | None, slo_text: str | None = None) -> list[str]:
    """The report's first lines: the speed answers in the user's units, each with its interval and level."""
    if not figs:
        return []

    def one(f: SpeedRatio) -> str:
        where = f" at c={f.concurrency}" if f.concurrency else ""
        if f.ratio is None:
            return f"not measured{where}"
        ci = f" [{f.ci[0]:.2f}, {f.ci[1]:.2f}]" if f.complete and f.ci else " (no interval)"
        return f"{f.ratio:.2f}x{where}{ci}"

    levels = sorted({f"{f.level:.2%}" for f in figs if f.ratio is not None and f.kind != CAPACITY})
    rounds = sorted({f.rounds for f in figs if f.ratio is not None and f.kind != CAPACITY})
    parts = []
    for kind, what in ((DECODE, "Decode (TPOT, baseline / candidate; > 1 = each stream faster)"),
                       (PREFILL, "First token (TTFT, baseline / candidate; > 1 = sooner)")):
        these = [f for f in figs if f.kind == kind]
        if these:
            parts.append(f"- {what}: " + "; ".join(one(f) for f in these))
    served = f"`{pair[1]}` against `{pair[0]}`" if pair else "candidate against baseline"
    cap = [f for f in figs if f.kind == CAPACITY]
    capacity = (f"- Capacity (requests/s meeting {slo_text or 'the SLO'}, candidate / baseline, open-loop, "
                f"{cap[0].rounds} paired searches at {cap[0].level:.0%}): {one(cap[0])}") if cap else \
        ("- Capacity at an SLO: not gated by this policy (set `throughput.capacity`, or `qtool bench serve --slo "
         "ttft_ms=...,tpot_ms=...` measures it per server).")
    return ["## Speed, as a deployment sees it", "", headline(figs, slo_text), "",
            f"{served}: the same serving configuration, only the recipe differs. Intervals at "
            f"{', '.join(levels) or '-'} over {', '.join(map(str, rounds)) or '-'} paired rounds "
            "(the level of the look the rounds stopped at).", "", *parts, capacity, ""]
