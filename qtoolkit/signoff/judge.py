"""The gates of one sign-off: every bound of the policy against the figure it names in the step outputs.

Quality gates read typed task summaries (evals/summary.py); throughput gates the ablation's top concurrency
tier; memory gates the quantize report's totals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..evals.summary import RoundsRatio, TaskSummary
from ..quantize.report import QuantizeReport
from . import gates as verdicts
from .policy import METRICS, Policy, metric_figure, read_metric


@dataclass
class Gate:
    name: str
    passed: bool
    detail: str
    point: float | None = None
    judged: float | None = None
    verdict: str = ""  # PASS | FAIL | INCONCLUSIVE | NO EVIDENCE (qtoolkit/signoff/gates.py)
    required: bool = True
    resolution: str = ""  # the smallest violation the gate could detect at the sample size used
    ci_method: str | None = None
    ci_coverage: float | None = None  # simulated coverage of that method at this sample size

    @classmethod
    def of(cls, name: str, j: verdicts.Judgement, point: float | None = None, judged: float | None = None) -> Gate:
        return cls(name, j.verdict == verdicts.PASS, j.detail, point, judged, j.verdict, j.required, j.resolution,
                   j.ci_method, j.ci_coverage)
    state: str | None = None  # "not measurable": the deployment cannot give the figure (an INCONCLUSIVE gate)



def undecided_and_failed(policy: Policy, evals: dict[str, Any] | None,
                         skip: Callable[[Gate], bool] = lambda g: False) -> tuple[list[str], list[str]]:
    """After one look of the sequential draw (qtoolkit/signoff/sequential.py): the required quality gates still
    INCONCLUSIVE or without evidence, and those that failed. `skip` leaves out gates that more items cannot
    decide (a figure an endpoint does not give)."""
    quality = [g for g in evaluate_gates(policy, evals, None, None)
               if g.name.split(".")[0] in policy.tasks and not skip(g)]
    undecided = (verdicts.INCONCLUSIVE, verdicts.NO_EVIDENCE)
    return ([g.name for g in quality if g.required and g.verdict in undecided],
            [g.name for g in quality if g.verdict == verdicts.FAIL])


def evaluate_gates(policy: Policy, evals: dict[str, Any] | None, ablation: dict[str, Any] | None,
                   quant: QuantizeReport | None) -> list[Gate]:
    gates: list[Gate] = []
    tasks = (evals or {}).get("tasks", {})
    for task, bounds in policy.tasks.items():
        entry = tasks.get(task) or {}
        summary = None if entry.get("summary") is None else TaskSummary.from_json(entry["summary"])
        for metric_name, bound in bounds.items():
            name = f"{task}.{metric_name}"
            if summary is None:
                gates.append(Gate(name, False, f"no {task} evaluation results", verdict=verdicts.NO_EVIDENCE,
                                  required=bound.required))
                continue
            metric = METRICS[task][metric_name]
            point, judged = read_metric(summary, metric)
            j = verdicts.judge_quality(metric_figure(summary, metric), metric.sign, metric.worst == "point",
                                       max_=bound.max, min_=bound.min, min_share=bound.min_baseline_share,
                                       required=bound.required)
            gates.append(Gate.of(name, j, point, judged))
    tiers = (ablation or {}).get("tiers") or []
    top = tiers[-1] if tiers else {}  # throughput is judged at the highest concurrency tier
    where = f" at concurrency {top['concurrency']}" if top else ""
    for attr, key in (("min_speedup", "total_speedup"), ("min_quantization_speedup", "quantization_speedup")):
        limit = getattr(policy.throughput, attr)
        if limit is None:
            continue
        point = judged = top.get(key)
        how, lo, hi = "", None, None
        rounds = RoundsRatio.from_json(top.get(f"{key}_rounds"))
        if rounds is not None and rounds.ci.complete:  # like the quality gates: the CI end worst for the candidate
            lo, hi = rounds.ci.bounds
            point, judged = rounds.ratio, lo
            how = f" (lower 95% bound over {rounds.rounds} rounds)"
        j = verdicts.judge_interval(point, lo, hi, max_=None, min_=limit,
                                    n_text=f", {rounds.rounds} rounds" if lo is not None else "")
        if lo is None and point is not None:
            # a timing on this machine moves by 10-20% between runs: one round bounds none of that noise
            j = verdicts.Judgement(verdicts.INCONCLUSIVE, f"{point:.3g} from one round, no interval to judge "
                                   f"against min {limit:g}: pass --rounds 3 or more", j.resolution)
        j.detail += where + how
        if lo is not None:
            j = verdicts.with_interval_method(j, rounds.ci.method, rounds.ci.coverage, rounds.ci.reliable, "rounds")
        gates.append(Gate.of(f"throughput.{attr}", j, point, judged))
    t = quant.totals if quant else None
    for attr, figure in (("max_linear_ratio_vs_bf16", t.linear_ratio_vs_bf16 if t else None),
                         ("max_checkpoint_bytes", t.checkpoint_bytes if t else None)):
        limit = getattr(policy.memory, attr)
        if limit is not None:
            j = verdicts.judge_interval(figure, None, None, max_=limit, min_=None)
            gates.append(Gate.of(f"memory.{attr}", j, figure, figure))
    return gates
