"""A sweep's answer: candidates ranked by cost, a Pareto plot, and one line saying which to ship (or why none).

The ranking table gives per candidate its verdict (the single sign-off's), its reading at its share of the
family-wise error, the linear weights' bytes against bf16, the full stack's throughput over the baseline with its
interval, and the gate closest to (or furthest past) its limit. "Cheapest" is the fewest weight bytes; the
recommendation is the cheapest candidate that passes at its family-wise share, so the chance that any false PASS
reaches it is at most 5% (qtoolkit/signoff/family.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from ..bench.memory import PeakMemory
from ..io import write_json, write_text
from ..provenance import provenance
from . import verdicts
from .config import EndpointSweepSignoffConfig, SweepSignoffConfig
from .family import NAME as FAMILY_METHOD
from .judge import Gate
from .policy import Policy
from .report import fmt, html_report, png, table_cell
from .speed import speed_limit

RECOMMENDED = "RECOMMENDED"


@dataclass(frozen=True)
class Bought:
    """What a deployment buys with a candidate, over the baseline: capacity at the policy's SLO when it sets one
    (`what` "capacity"), else per-stream decode at the top tier ("decode"), else the full stack's throughput
    ("full_stack"); > 1 favours the candidate."""

    what: str
    ratio: float | None
    ci: tuple[float, float] | None = None
    concurrency: int = 0
    slo: str | None = None

    def words(self) -> str:
        ci = f" [{fmt(self.ci[0], 3)}, {fmt(self.ci[1], 3)}]" if self.ci else ""
        if self.what == "capacity":
            return f"{fmt(self.ratio, 3)}x{ci} the requests/s at {self.slo or 'the SLO'}"
        if self.what == "decode":
            return f"decodes {fmt(self.ratio, 3)}x{ci} as fast per stream at c={self.concurrency}"
        return f"full stack {fmt(self.ratio, 3)}x{ci} the baseline's throughput"

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "ratio": self.ratio, "ci": None if self.ci is None else list(self.ci),
                "concurrency": self.concurrency, **({"slo": self.slo} if self.slo else {})}


@dataclass(frozen=True)
class Row:
    """One candidate in the ranking."""

    name: str
    verdict: str
    family_verdict: str
    family_alpha: float
    linear_ratio: float | None  # linear weights' bytes / bf16
    throughput: Bought | None
    worst_gate: str | None
    worst_fraction: float | None  # the gate's judged CI end as a fraction of its limit (> 1: past it)
    worst_quality_fraction: float | None
    reasons: list[str]
    error: str | None
    folder: str = ""  # the candidate's single sign-off folder (its report.md is included in the sweep's)
    family: dict[str, Any] | None = None  # FamilyJudgement.to_json()

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__) | {"throughput": None if self.throughput is None else self.throughput.to_json()}


def limit_fraction(g: Gate, policy: Policy) -> float | None:
    """How far a gate's judged figure (its worst CI end) is towards its limit: 1 on it, > 1 past it."""
    if g.judged is None:
        return None
    if g.task == "throughput":
        limit = speed_limit(g.metric, policy) or getattr(policy.throughput, g.metric, None)
        return limit / g.judged if limit and g.judged > 0 else None
    if g.task == "memory":
        limit = getattr(policy.memory, g.metric, None)
        return g.judged / limit if limit else None
    bounds = policy.tasks.get(g.task) or policy.tasks.get("custom")  # a workload file's task: the custom bounds
    bound = bounds.get(g.metric) if bounds else None
    if bound is None:
        return None
    if bound.max is not None and bound.max > 0:
        return g.judged / bound.max
    if bound.min is not None and g.judged > 0:
        return bound.min / g.judged
    return None


def worst_gate(gates: list[Gate], policy: Policy, quality_only: bool = False) -> tuple[str | None, float | None]:
    # a gate without evidence (HumanEval pass@1 where the baseline solves too little) judges nothing
    scored = [(f, g.name) for g in gates if g.verdict != verdicts.NO_EVIDENCE
              and (f := limit_fraction(g, policy)) is not None
              and (not quality_only or g.task not in ("throughput", "memory"))]
    if not scored:
        return None, None
    f, name = max(scored)
    return name, f


def ranked(rows: list[Row]) -> list[Row]:
    """Recommendable first, then PASS, INCONCLUSIVE, FAIL, ERROR: the passing ones by what a deployment buys
    (the lower end of the capacity or decode interval, highest first; a point when there is no interval) and then
    the fewest weight bytes, the others nearest their limits first (the candidate to look at next)."""
    order = {verdicts.PASS: 1, verdicts.INCONCLUSIVE: 2, verdicts.FAIL: 3, verdicts.ERROR: 4}
    inf = float("inf")

    def bought(r: Row) -> float:
        t = r.throughput
        value = (t.ci[0] if t.ci else t.ratio) if t is not None else None
        return -value if value is not None else inf

    def key(r: Row) -> tuple[int, float, float]:
        first = 0 if r.family_verdict == verdicts.PASS else order.get(r.verdict, 4)
        if first <= 1:
            return first, bought(r), r.linear_ratio if r.linear_ratio is not None else inf
        return first, r.worst_fraction if r.worst_fraction is not None else inf, 0.0
    return sorted(rows, key=key)


def recommendation(rows: list[Row]) -> tuple[str | None, str, int]:
    """(the candidate to ship or None, the line that says so, the exit code: 0 one is recommended, 1 every
    candidate fails, 3 none passes and one is undecided, 2 none passes and one could not be judged)."""
    ship = [r for r in ranked(rows) if r.family_verdict == verdicts.PASS]
    if ship:
        r = ship[0]
        return r.name, (f"ship `{r.name}`: quality passes every gate{_speed(r)} (linear weights "
                        f"{fmt(r.linear_ratio, 3)}x of bf16; judged at {r.family_alpha:.2%} of the 5% family-wise "
                        "error; the passing candidate that buys the most, then the cheapest)"), 0
    alone = [r for r in rows if r.verdict == verdicts.PASS]
    judged = [r for r in rows if r.verdict != verdicts.ERROR]
    closest = min(judged, key=lambda r: r.worst_fraction if r.worst_fraction is not None else float("inf"),
                  default=None)
    if alone:
        r = alone[0]
        return None, (f"none recommended: `{r.name}` passes on its own but not at its {r.family_alpha:.2%} share "
                      f"of the 5% family-wise error ({r.family_verdict}); draw more items (--max-items) in this "
                      "sweep. Signing it off again alone would reuse this sweep's evidence without the family's "
                      "correction: a choice made after seeing several candidates' results needs the sweep's "
                      "share, not a fresh 5%"), 3
    why = ""
    if closest is not None:
        what = closest.reasons[0] if closest.reasons else f"gate {closest.worst_gate}"
        why = f": the closest is `{closest.name}` because {what}"
    if any(r.verdict == verdicts.INCONCLUSIVE for r in rows):
        return None, f"none passes yet{why}", 3
    if all(r.verdict == verdicts.FAIL for r in rows):
        return None, f"none passes{why}", 1
    return None, f"none passes and some could not be judged{why}", 2


def _speed(r: Row) -> str:
    return f", {r.throughput.words()}" if r.throughput and r.throughput.ratio is not None else ""


def pareto_plot(rows: list[Row]) -> str | None:
    """Cost (weight bytes vs bf16) against what a deployment buys (capacity at the SLO, else decode per stream,
    with its interval), the marker saying whether quality passes; without any speed figure, against the worst
    quality gate's CI end as a fraction of its limit."""
    pts = [r for r in rows if r.linear_ratio is not None and r.throughput and r.throughput.ratio is not None]
    if not pts:
        return _quality_plot(rows)
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    for r in pts:
        t = r.throughput
        assert t is not None and t.ratio is not None
        ok = r.verdict == verdicts.PASS
        color = "#1a7f37" if r.family_verdict == verdicts.PASS else "#9a6700" if ok else "#cf222e"
        yerr = [[t.ratio - t.ci[0]], [t.ci[1] - t.ratio]] if t.ci else None
        ax.errorbar([r.linear_ratio], [t.ratio], yerr=yerr, fmt="o" if ok else "x", color=color, capsize=3)
        ax.annotate(f"{r.name} ({r.verdict})", (r.linear_ratio, t.ratio), fontsize=8, xytext=(5, 4),
                    textcoords="offset points")
    ax.axhline(1.0, color="#57606a", linestyle="--", linewidth=1)
    first = pts[0].throughput
    assert first is not None
    ax.set_xlabel("linear weight bytes / bf16 (cost)")
    ax.set_ylabel(f"capacity at {first.slo or 'the SLO'} / baseline's" if first.what == "capacity"
                  else "decode per stream / baseline's" if first.what == "decode" else "throughput / baseline's")
    ax.set_title("candidates: cost against what a deployment buys (x = a gate does not pass)", fontsize=9)
    return png(fig)


def _quality_plot(rows: list[Row]) -> str | None:
    pts = [r for r in rows if r.linear_ratio is not None and r.worst_quality_fraction is not None]
    if not pts:
        return None
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    for r in pts:
        ok = r.verdict == verdicts.PASS
        ax.scatter([r.linear_ratio], [r.worst_quality_fraction], marker="o" if ok else "x", s=60,
                   color="#1a7f37" if r.family_verdict == verdicts.PASS else "#9a6700" if ok else "#cf222e")
        ax.annotate(f"{r.name} ({r.verdict})", (r.linear_ratio, r.worst_quality_fraction), fontsize=8,
                    xytext=(5, 4), textcoords="offset points")
    ax.axhline(1.0, color="#cf222e", linestyle="--", linewidth=1)
    ax.set_xlabel("linear weight bytes / bf16 (cost)")
    ax.set_ylabel("worst quality gate: CI end / its limit")
    ax.set_title("candidates: cost against quality (1 = on the limit; x = does not pass)")
    return png(fig)


def _markdown(verdict: str, line: str, rows: list[Row], peak: PeakMemory) -> str:
    lines = [f"# Release sign-off over {len(rows)} candidates: {verdict}", "", f"**{line}**", "",
             "| rank | candidate | verdict | at its family share | linear bytes vs bf16 | what it buys over the "
             "baseline (capacity at the SLO; else decode per stream; else full stack) | worst gate | its CI end / "
             "limit |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(ranked(rows), 1):
        tp = _speed(r).removeprefix(", ") or "-"
        lines.append(f"| {i} | `{table_cell(r.name)}` | {r.verdict} | {r.family_verdict} at {r.family_alpha:.2%} | "
                     f"{fmt(r.linear_ratio, 3)} | {table_cell(tp)} | {table_cell(r.worst_gate or '-')} | "
                     f"{fmt(r.worst_fraction, 3)} |")
    lines += ["", f"Family-wise error: {FAMILY_METHOD}. A candidate's verdict is its single sign-off's (gates at 95%); "
              "the recommendation reads the same evidence again at the candidate's share, so the chance that any "
              "false PASS reaches it is at most 5% (simulated with three candidates on the bound: "
              f"{verdicts.AT_BOUND}). A rerun of this command keeps that protection: its finished steps are "
              "reused and judged again at the same shares. Signing off one candidate alone afterwards does not: "
              "`qtool signoff` refuses a sweep's candidate folder, and a fresh folder would judge at a full 5% a "
              "candidate chosen after seeing the others.", "",
              f"Peak memory of the whole process tree (this process, its servers and sandboxes): "
              f"{peak.rss_bytes / 2**30:.2f} GiB of RSS summed over {peak.processes} processes at its peak"
              + (f"; {peak.pss_peak.bytes / 2**30:.2f} GiB of PSS (a page shared between processes counted once)"
                 if peak.pss else "") + ".", ""]
    for r in rows:
        if r.error:
            lines.append(f"- `{r.name}` could not be judged: {table_cell(r.error)}")
    for r in rows:
        md = Path(r.folder) / "report.md"
        if r.folder and md.is_file():  # the candidate's own report, its headings one level down
            body = "\n".join("#" + x if x.startswith("#") else x for x in md.read_text().splitlines())
            lines += ["", f"# Candidate `{r.name}`", "", body]
    return "\n".join(lines)


def write_sweep_reports(out: Path, cfg: SweepSignoffConfig | EndpointSweepSignoffConfig, policy: Policy,
                        rows: list[Row], recipes: list[str], model: dict[str, Any], peak: PeakMemory,
                        ) -> dict[str, Any]:
    name, line, code = recommendation(rows)
    verdict = RECOMMENDED if name else next(v for v, c in verdicts.EXIT_CODES.items() if c == code)
    data = {**provenance(model=model, policy={"name": policy.name, "path": policy.source},
                         recipes=recipes),
            "verdict": verdict, "recommended": name, "line": line, "exit_code": code,
            "family_wise": {"method": FAMILY_METHOD, "alpha": 0.05},
            "candidates": [r.to_json() | {"report": str(Path("candidates") / r.name / "report.html")}
                           for r in rows],
            "ranking": [r.name for r in ranked(rows)], "peak_memory": peak.to_json(),
            "config": {k: v for k, v in cfg.to_json().items() if k != "baseline_generations"}}
    md = _markdown(verdict, line, rows, peak)
    write_json(out / "report.json", data)
    write_text(out / "report.md", md)
    html = html_report("PASS" if name else verdict, md, {"pareto": pareto_plot(rows)})
    write_text(out / "report.html", html)
    return data
