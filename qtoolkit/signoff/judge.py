"""The gates of one sign-off: every bound of the policy against the figure it names in the step outputs.

Quality gates read typed task summaries (evals/summary.py); the speed gates bench.json's paired rounds at every
tier (speed.py); the older throughput gates the ablation's top concurrency tier; memory gates the quantize
report's totals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..bench.ablation import AblationBench, AblationTable
from ..bench.deployment import ThroughputTable
from ..evals.results import EvalResults
from ..evals.summary import RoundsRatio
from ..quantize.report import QuantizeReport, QuantizeSummary
from . import verdicts
from .policy import METRICS, Policy, metric_figure, read_metric
from .speed import judge_speed, speed_gate_name, speed_ratios


@dataclass
class Gate:
    """One bound of the policy judged against the figure it names: `task` is a quality task, `throughput` or
    `memory`, and `metric` the bound's name under it in the policy."""

    task: str
    metric: str
    passed: bool
    detail: str
    point: float | None = None
    judged: float | None = None
    verdict: str = ""  # PASS | FAIL | INCONCLUSIVE | NO EVIDENCE (qtoolkit/signoff/verdicts.py)
    required: bool = True
    resolution: str = ""  # the smallest violation the gate could detect at the sample size used
    ci_method: str | None = None
    ci_coverage: float | None = None  # simulated coverage of that method at this sample size
    state: str | None = None  # "not measurable": the deployment cannot give the figure (an INCONCLUSIVE gate)

    @classmethod
    def of(cls, task: str, metric: str, j: verdicts.Judgement, point: float | None = None,
           judged: float | None = None) -> Gate:
        return cls(task, metric, j.verdict == verdicts.PASS, j.detail, point, judged, j.verdict, j.required,
                   j.resolution, j.ci_method, j.ci_coverage)

    @property
    def name(self) -> str:
        """The gate as report.json, sequential.json and the reasons name it: task.metric."""
        return f"{self.task}.{self.metric}"

    def to_json(self) -> dict[str, Any]:
        node = asdict(self)
        del node["task"], node["metric"]
        return {"name": self.name, **node}

    @classmethod
    def from_json(cls, node: dict[str, Any]) -> Gate:
        """A gate of report.json; a report without verdicts has `passed` only. The metric is the part after the
        last dot: a policy's metric names have none, a workload file's task (custom:STEM) may."""
        task, _, metric = node["name"].rpartition(".")
        rest = {k: v for k, v in node.items() if k in _FIELDS}
        rest.setdefault("verdict", verdicts.PASS if rest["passed"] else verdicts.FAIL)
        return cls(task, metric, **rest)


_FIELDS = {f.name for f in fields(Gate)} - {"task", "metric"}


def undecided_and_failed(policy: Policy, evals: EvalResults | None,
                         skip: Callable[[Gate], bool] = lambda g: False) -> tuple[list[Gate], list[Gate]]:
    """After one look of the sequential draw (qtoolkit/signoff/sequential.py): the required quality gates still
    INCONCLUSIVE or without evidence, and those that failed. `skip` leaves out gates that more items cannot
    decide (a figure an endpoint does not give)."""
    quality = [g for g in evaluate_gates(policy, evals, None, None) if g.task in policy.tasks and not skip(g)]
    undecided = (verdicts.INCONCLUSIVE, verdicts.NO_EVIDENCE)
    return ([g for g in quality if g.required and g.verdict in undecided],
            [g for g in quality if g.verdict == verdicts.FAIL])


def evaluate_gates(policy: Policy, evals: EvalResults | None, table: AblationTable | ThroughputTable | None,
                   quant: QuantizeReport | QuantizeSummary | None, bench: AblationBench | None = None) -> list[Gate]:
    """Every gate of the policy: `table` (the local ablation, or the two deployments' throughput) feeds the
    older throughput gates, `bench` (bench.json) the speed gates (qtoolkit/signoff/speed.py)."""
    gates: list[Gate] = []
    for task, bounds in policy.tasks.items():
        summary = None if evals is None else evals.summary(task)
        for metric_name, bound in bounds.items():
            if summary is None:
                gates.append(Gate(task, metric_name, False, f"no {task} evaluation results",
                                  verdict=verdicts.NO_EVIDENCE, required=bound.required))
                continue
            metric = METRICS[task][metric_name]
            point, judged = read_metric(summary, metric)
            j = verdicts.judge_quality(metric_figure(summary, metric), metric.sign, metric.worst == "point",
                                       max_=bound.max, min_=bound.min, min_share=bound.min_baseline_share,
                                       required=bound.required)
            gates.append(Gate.of(task, metric_name, j, point, judged))
    top = table.top if table is not None else None  # throughput is judged at the highest concurrency tier
    where = f" at concurrency {top.concurrency}" if top else ""
    figures = {"min_speedup": (top.total_speedup, top.total_speedup_rounds) if top else (None, None),
               "min_quantization_speedup": (top.quantization_speedup, top.quantization_speedup_rounds) if top
               else (None, None)}
    for attr, (figure, over_rounds) in figures.items():
        limit = getattr(policy.throughput, attr)
        if limit is None:
            continue
        point = judged = figure
        how, lo, hi = "", None, None
        rounds = RoundsRatio.from_json(over_rounds)
        if rounds is not None and rounds.ci.complete:  # like the quality gates: the CI end worst for the candidate
            lo, hi = rounds.ci.bounds
            point, judged = rounds.ratio, lo
            how = f" (lower 95% bound over {rounds.rounds} rounds)"
        j = verdicts.judge_interval(point, lo, hi, max_=None, min_=limit,
                                    n_text=f", {rounds.rounds} rounds" if lo is not None else "")
        if lo is None and point is not None:
            # throughput on a shared CPU moves by 10-20% between runs: one round bounds none of that noise
            j = verdicts.Judgement(verdicts.INCONCLUSIVE, f"{point:.3g} from one round, no interval to judge "
                                   f"against min {limit:g}: pass --rounds 3 or more", j.resolution)
        j.detail += where + how
        if lo is not None:
            j = verdicts.with_interval_method(j, rounds.ci.method, rounds.ci.coverage, rounds.ci.reliable, "rounds")
        gates.append(Gate.of("throughput", attr, j, point, judged))
    t = policy.throughput
    if t.min_decode_speedup is not None or t.prefill_margin is not None or t.capacity is not None:
        for fig in speed_ratios(bench, policy):
            gates.append(Gate.of("throughput", speed_gate_name(fig), judge_speed(fig, policy), fig.ratio,
                                 fig.ci[0] if fig.complete and fig.ci else None))
    t = quant.totals if quant else None
    for attr, figure in (("max_linear_ratio_vs_bf16", t.linear_ratio_vs_bf16 if t else None),
                         ("max_checkpoint_bytes", t.checkpoint_bytes if t else None)):
        limit = getattr(policy.memory, attr)
        if limit is not None:
            j = verdicts.judge_interval(figure, None, None, max_=limit, min_=None)
            gates.append(Gate.of("memory", attr, j, figure, figure))
    return gates
