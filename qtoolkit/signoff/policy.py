"""Sign-off policy: the gates a quantized model must clear, judged on the worst end of each 95% CI.

A gate reads one figure from the eval / bench / quantize results. Quality gates take the CI bound that is worst
for the candidate (the upper bound of a KLD or NLL increase, the lower bound of a pass@1 or ROUGE delta), so a
small, noisy sample cannot pass by luck of its point estimate.
"""

from __future__ import annotations

import importlib.resources
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..bench.summary import SLO
from ..errors import QToolError
from ..evals.summary import Figure, TaskSummary, TokenStat
from ..yaml_safe import load_yaml_file

POLICY_DIR = Path(str(importlib.resources.files("qtoolkit.recipes"))) / "policies"


class PolicyError(QToolError):
    """The policy file is unknown, malformed or names tasks/metrics that do not exist."""


@dataclass(frozen=True)
class Metric:
    """Which figure of a task summary a gate reads (evals/summary.py), and which CI end is worst for the candidate."""

    figure: str  # its name in the task summary, or in its token statistics when `tokens`
    worst: Literal["high", "low", "point"]  # which bound to judge on
    sign: float = 1.0  # -1 turns a delta into a drop (so "max drop" gates read naturally)
    doc: str = ""
    tokens: bool = False  # a token statistic (the summary's text_stats)
    part: str | None = None  # one number the figure carries (KLD's p99), judged as a point


_TOKEN_METRICS = {
    "kld_mean": Metric("kld", "high", doc="mean KL divergence candidate || baseline, nats/token", tokens=True),
    "kld_p99": Metric("kld", "point", doc="99th percentile of per-token KLD", tokens=True, part="p99"),
    "ppl_ratio": Metric("ppl_ratio", "high", doc="perplexity ratio candidate / baseline", tokens=True),
    "same_top1": Metric("same_top1", "low", doc="share of tokens with the same top-1", tokens=True),
}


class _Metrics(dict):
    """Task name -> its metrics; every workload file's task (custom:NAME) has the `custom` metrics."""

    def __missing__(self, task: str) -> dict[str, Metric]:
        if task.startswith("custom:"):
            return self["custom"]
        raise KeyError(task)


METRICS: dict[str, dict[str, Metric]] = _Metrics({
    "code": {
        **_TOKEN_METRICS,
        "pass_at_1_drop": Metric("pass@1", "low", -1.0, "HumanEval pass@1 baseline - candidate"),
        "nll_delta": Metric("nll_canonical_solution", "high", doc="NLL of canonical solutions, nats/token"),
        "greedy_agreement": Metric("greedy_agreement", "point", doc="greedy completions equal"),
    },
    "summarization": {
        **_TOKEN_METRICS,
        "rouge1_drop": Metric("rouge1", "low", -1.0, "ROUGE-1 baseline - candidate"),
        "rougeL_drop": Metric("rougeL", "low", -1.0, "ROUGE-L baseline - candidate"),
        "nll_delta": Metric("nll_reference", "high", doc="NLL of reference summaries, nats/token"),
    },
    "custom": {  # a workload file (--data); teacher-forced figures are on the baseline's own answers
        **_TOKEN_METRICS,
        "nll_delta": Metric("nll_answer", "high", doc="NLL of the baseline's answers, nats/token"),
        "rougeL_drop": Metric("rougeL", "low", -1.0, "ROUGE-L vs `reference` baseline - candidate"),
        "pass_at_1_drop": Metric("pass@1", "low", -1.0, "pass@1 under the lines' `tests` baseline - candidate"),
        "greedy_agreement": Metric("greedy_agreement", "point", doc="greedy answers equal"),
        "answer_tokens_delta": Metric("answer_tokens", "point", doc="answer length candidate - baseline"),
    },
})


class Bound(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max: float | None = None
    min: float | None = None
    # the gate carries evidence only where the baseline scores at least this share (pass rates): below it the
    # gate shows "no evidence" and is not required
    min_baseline_share: float | None = Field(default=None, ge=0, le=1)
    required: bool = True  # False: the gate is shown but its INCONCLUSIVE / no evidence does not hold the verdict


class SLOBounds(BaseModel):
    """p99 latency objectives in milliseconds (vLLM's --goodput names); at least one."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    e2el_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_bound(self) -> SLOBounds:
        if self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None:
            raise ValueError("an SLO needs at least one of ttft_ms, tpot_ms, e2el_ms")
        return self

    def slo(self) -> SLO:
        return SLO(self.ttft_ms, self.tpot_ms, self.e2el_ms)


class CapacityGate(BaseModel):
    """Capacity at an SLO (qtoolkit/signoff/speed.py, bench/capacity.py): candidate / baseline of the highest
    open-loop request rate each server carries within `slo`, lower bound over the paired searches' rounds at
    least `min_ratio`."""

    model_config = ConfigDict(extra="forbid")
    slo: SLOBounds
    min_ratio: float = Field(gt=0, allow_inf_nan=False)
    rounds: int = Field(default=3, ge=2, le=20)  # paired searches; two at least, or there is no interval
    # while the gate is undecided, two rounds more at a time up to max_rounds (the error spent over the looks as
    # the other speed gates spend it); None: the first `rounds` only
    max_rounds: int | None = Field(default=None, ge=2, le=20)
    requests_per_probe: int = Field(default=16, ge=4, le=1024)
    required: bool = True  # False: the gate is shown and can FAIL, but its INCONCLUSIVE holds no verdict

    @model_validator(mode="after")
    def _budget_covers_first_look(self) -> CapacityGate:
        if self.max_rounds is not None and self.max_rounds < self.rounds:
            raise ValueError(f"max_rounds {self.max_rounds} is below rounds {self.rounds}: set it to at least "
                             "rounds (or leave it out for a fixed design)")
        return self


class ThroughputGates(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # the speed gates (qtoolkit/signoff/speed.py): candidate against baseline under the same serving
    # configuration, at each tier in `tiers` (default: every tier the bench measures), lower bound over rounds
    min_decode_speedup: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # TPOT baseline / candidate
    prefill_margin: float | None = Field(default=None, ge=0, lt=1, allow_inf_nan=False)  # TTFT >= 1 - margin
    tiers: list[Annotated[int, Field(gt=0)]] | None = Field(default=None, min_length=1)
    capacity: CapacityGate | None = None
    # deprecated for local sign-offs (credits the batching layer to the recipe; judged at the top tier only):
    # full stack (candidate, continuous batching, speculation if enabled) / baseline static batching, output tok/s;
    # a deployment sign-off's candidate / baseline endpoint
    min_speedup: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # candidate / baseline, both with static batching: what quantization alone buys
    min_quantization_speedup: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class MemoryGates(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_linear_ratio_vs_bf16: float | None = Field(default=None, gt=0)
    max_checkpoint_bytes: int | None = Field(default=None, gt=0)


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Literal[1] = 1
    name: str
    description: str = ""
    tasks: dict[str, dict[str, Bound]]
    throughput: ThroughputGates = ThroughputGates()
    memory: MemoryGates = MemoryGates()
    source: str = Field(default="<memory>", exclude=True)


def find_policy(spec: str | os.PathLike) -> Path:
    p = Path(spec)
    if p.suffix in (".yaml", ".yml") or os.sep in str(spec):
        if not p.is_file():
            raise PolicyError(f"policy file {p} not found: pass a YAML path or a shipped policy name")
        return p
    named = POLICY_DIR / f"{spec}.yaml"
    if not named.is_file():
        shipped = ", ".join(sorted(x.stem for x in POLICY_DIR.glob("*.yaml")))
        raise PolicyError(f"unknown policy {str(spec)!r}: use one of {shipped} or a YAML path")
    return named


def load_policy(spec: str | os.PathLike = "default") -> Policy:
    path = find_policy(spec)
    try:
        data = load_yaml_file(path, PolicyError)  # size-capped, aliases refused
        policy = Policy.model_validate(data)
    except yaml.YAMLError as e:
        raise PolicyError(f"{path}: malformed YAML ({str(e).splitlines()[0]}): fix the syntax") from None
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise PolicyError(f"{path}: {field}: {err['msg']}: fix or remove it") from None
    for task, gates in policy.tasks.items():
        if task not in METRICS:
            raise PolicyError(f"{path}: unknown task {task!r} in tasks: use {', '.join(METRICS)}")
        for metric, bound in gates.items():
            if metric not in METRICS[task]:
                raise PolicyError(f"{path}: unknown metric {metric!r} for task {task}: use one of "
                                  f"{', '.join(METRICS[task])}")
            if bound.max is None and bound.min is None:
                raise PolicyError(f"{path}: tasks.{task}.{metric} needs `max` or `min`")
    return policy.model_copy(update={"source": str(path)})


def metric_figure(summary: TaskSummary, metric: Metric) -> Figure | float | None:
    """The figure a metric reads (a paired delta, a token statistic, a rate, or one number); None when absent."""
    if metric.tokens:
        stats = summary.text_stats
        fig = None if stats is None else stats.figure(metric.figure)
    else:
        fig = summary.figure(metric.figure)
    if fig is not None and metric.part is not None:
        value = fig.extra.get(metric.part) if isinstance(fig, TokenStat) else None
        return value if isinstance(value, (int, float)) else None
    return fig


def read_metric(summary: TaskSummary, metric: Metric) -> tuple[float | None, float | None]:
    """(point estimate, value judged) from a task summary; None when the figure is absent."""
    fig = metric_figure(summary, metric)
    if fig is None:
        return None, None
    if isinstance(fig, (int, float)):
        return metric.sign * fig, metric.sign * fig
    point = fig.point
    if point is None:
        return None, None
    judged = point
    if fig.ci.complete and metric.worst != "point":
        judged = fig.ci.bounds[1] if metric.worst == "high" else fig.ci.bounds[0]
    return metric.sign * point, metric.sign * judged
