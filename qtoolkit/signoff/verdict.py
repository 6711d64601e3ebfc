"""One decision for every sign-off, local or through endpoints: step outcomes and gates -> verdict, reasons and
the reading, gathered in the `SignoffReport` that report.py writes as report.{json,md,html}."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..evals.results import EvalResults
from ..quantize.report import QuantizeReport
from . import gates as verdicts
from .judge import Gate
from .policy import Policy


@dataclass(frozen=True)
class NotMeasurable:
    """A figure an endpoint cannot give, listed in the report and never filled in from the local engine."""

    key: str
    what: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "what": self.what, "reason": self.reason}


@dataclass
class DeploymentSection:
    """What only a deployment sign-off reports: the endpoints measured, their bench tiers, what they cannot give."""

    endpoints: dict[str, dict[str, Any]]  # role -> the endpoint as probed (endpoints.deployment.EndpointInfo)
    bench: dict[str, Any] | None  # the throughput table of both endpoints (bench.deployment)
    not_measurable: list[NotMeasurable] = field(default_factory=list)


@dataclass
class Evidence:
    """What a sign-off measured: each step's outcome (in the order the steps run) and the gates judged on it."""

    steps: dict[str, dict[str, Any]]  # name -> steps.json entry: status, error, seconds, output
    gates: list[Gate]
    evals: EvalResults | None = None
    sequential: dict[str, Any] | None = None  # sequential.json: the looks of the eval step
    quant: QuantizeReport | None = None  # the candidate's quantize_report.json
    ablation: dict[str, Any] | None = None
    diagnose: dict[str, Any] | None = None
    kv_layer: dict[str, Any] | None = None  # bench_kv.json's layer (bench.kv_layer.KVLayerRow), when it ran


@dataclass
class SignoffReport:
    """Everything report.json holds; `to_json` gives report.json's layout, key for key."""

    provenance: dict[str, Any]  # qtoolkit.provenance.provenance(): schema version, created, inputs, machine
    verdict: str
    reasons: list[str]
    reading: list[str]
    config: dict[str, Any]
    policy: Policy
    evidence: Evidence
    deployment: DeploymentSection | None = None

    @property
    def gates(self) -> list[Gate]:
        return self.evidence.gates

    def to_json(self) -> dict[str, Any]:
        ev = self.evidence
        out: dict[str, Any] = {
            **self.provenance, "verdict": self.verdict, "reasons": self.reasons, "reading": self.reading,
            "config": self.config, "policy": self.policy.model_dump(), "gates": [g.to_json() for g in ev.gates],
            "steps": {n: {k: v for k, v in s.items() if k != "key"} for n, s in ev.steps.items()},
        }
        if self.deployment is not None:
            out |= {"deployments": self.deployment.endpoints, "deployment_bench": self.deployment.bench,
                    "not_measurable": [x.to_json() for x in self.deployment.not_measurable]}
        evals = ev.evals
        out |= {
            "quantize": _quantize_section(ev.quant),
            "eval": None if evals is None else {
                t: {"items": r.items, "summary": None if r.summary is None else r.summary.to_json()}
                for t, r in evals.tasks.items()} or None,
            "eval_models": None if evals is None else evals.models,
            "ablation": ev.ablation,
            "diagnose": ev.diagnose,
        }
        if ev.kv_layer is not None:  # only a sign-off whose candidate has a quantized KV cache runs the layer
            out["kv_layer"] = ev.kv_layer
        return out


def _quantize_section(quant: QuantizeReport | None) -> dict[str, Any] | None:
    return quant.summary.to_json() if quant else None


def decide(evidence: Evidence, *, provenance: dict[str, Any], config: dict[str, Any], policy: Policy,
           deployment: DeploymentSection | None = None, without_gates: str = verdicts.INCONCLUSIVE) -> SignoffReport:
    """ERROR when a step did not finish (no gate could judge the candidate), else the gates' overall verdict;
    `without_gates` is the verdict when the policy left nothing to judge. Reasons name the failed steps, then
    every gate that failed or holds a required gate undecided, in its own verdict's words."""
    # a skipped step (a sweep's bench of a candidate that already fails a gate) is not a failure: the gates it
    # would feed show no evidence, and the failed gate decides
    failed_steps = [n for n, s in evidence.steps.items() if s.get("status") not in ("ok", "skipped")]
    gates = evidence.gates
    verdict = (verdicts.ERROR if failed_steps else without_gates if not gates
               else verdicts.overall([(g.verdict, g.required) for g in gates]))
    reasons = [f"step {n} failed: {evidence.steps[n].get('error')}" for n in failed_steps]
    reasons += [f"gate {g.name} {g.verdict.lower()}: {g.detail}" for g in gates
                if g.verdict == verdicts.FAIL or (g.verdict != verdicts.PASS and g.required)]
    reading = verdicts.reading(gates, evidence.evals, evidence.sequential if evidence.evals else None)
    return SignoffReport(provenance, verdict, reasons, reading, config, policy, evidence, deployment)
