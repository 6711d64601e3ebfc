"""One decision for every sign-off, local or through endpoints: step outcomes and gates -> verdict, reasons and
the reading, gathered in the `SignoffReport` that report.py writes as report.{json,md,html}."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..bench.ablation import AblationBench, AblationTable
from ..bench.deployment import ThroughputTable
from ..bench.kv_layer import KVLayerRow
from ..diagnose.result import DiagnoseResult
from ..evals.results import EvalResults
from ..quantize.report import QuantizeSummary
from . import verdicts
from .error_spending import SequentialRecord
from .judge import Gate
from .policy import Policy
from .speed import SpeedRatio, speed_ratios
from .steps import StepOutcome, load_output


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
    bench: ThroughputTable | None  # the throughput of both endpoints, tier by tier
    not_measurable: list[NotMeasurable] = field(default_factory=list)


@dataclass(frozen=True)
class SpeedSection:
    """The speed gates' answer, the report's first lines: their pair of systems and every figure they judged."""

    pair: list[str]
    figures: list[SpeedRatio]
    slo: str | None = None  # the capacity gate's SLO in words, when the policy sets one

    def to_json(self) -> dict[str, Any]:
        return {"pair": list(self.pair), "figures": [f.to_json() for f in self.figures],
                **({"slo": self.slo} if self.slo else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SpeedSection:
        return cls(list(d["pair"]), [SpeedRatio.from_json(f) for f in d["figures"]], d.get("slo"))

    @classmethod
    def of(cls, bench: AblationBench | None, policy: Policy) -> SpeedSection | None:
        """The section of a bench with speed gates' rounds (local or deployment), None for one without."""
        if bench is None or bench.speed_rounds is None:
            return None
        return cls(list(bench.speed_rounds.pair), speed_ratios(bench, policy),
                   bench.capacity.plan.slo.describe() if bench.capacity else None)


@dataclass(frozen=True)
class KVLayerSection:
    """The ablation's KV cache layer (bench_kv.json): the row and the configuration it was measured under."""

    row: KVLayerRow
    config: dict[str, Any]  # bench_kv.json's `config`: concurrency, workload, kv_cache_memory, ...

    def to_json(self) -> dict[str, Any]:
        return self.row.to_json() | {"config": self.config}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVLayerSection:
        return cls(KVLayerRow.from_json(d), dict(d.get("config") or {}))


@dataclass
class Evidence:
    """What a sign-off measured: each step's outcome (in the order the steps run), its output as its type, and the
    gates judged on it."""

    steps: dict[str, StepOutcome]  # name -> its steps.json entry
    gates: list[Gate]
    evals: EvalResults | None = None
    sequential: SequentialRecord | None = None  # sequential.json: the looks of the eval step
    quant: QuantizeSummary | None = None  # what the report keeps of the candidate's quantize_report.json
    ablation: AblationTable | None = None
    diagnose: DiagnoseResult | None = None
    kv_layer: KVLayerSection | None = None  # bench_kv.json's layer, when it ran
    speed: SpeedSection | None = None  # the speed gates' figures, when the bench measured their rounds
    bench: AblationBench | None = None  # bench.json as the gates read it (the report keeps `ablation`)

    @classmethod
    def load(cls, folder: Path, steps: dict[str, StepOutcome], *, evals: EvalResults | None = None,
             sequential: SequentialRecord | None = None, quant: QuantizeSummary | None = None) -> Evidence:
        """Each step's output in a local sign-off's `folder` (eval.json, sequential.json, bench.json,
        bench_kv.json, diagnose.json) read once, as its type; a step that did not finish has none. `evals`,
        `sequential` and `quant` when the caller holds them already (--rejudge rebuilds the summaries). The
        gates are judged on it afterwards (`gates` starts empty)."""
        def ok(name: str) -> bool:
            return name in steps and steps[name].ok

        if evals is None and ok("eval"):
            evals = EvalResults.load(folder / "eval.json")
        written = load_output(folder / "bench.json") if ok("bench") else None
        bench = AblationBench.from_json(written) if written else None
        kv = load_output(folder / "bench_kv.json") if bench else None
        diagnosed = load_output(folder / "diagnose.json") if ok("diagnose") else None
        return cls(steps, [], evals, sequential or SequentialRecord.load(folder / "sequential.json"), quant,
                   None if bench is None else bench.table,
                   DiagnoseResult.from_json(diagnosed) if diagnosed else None,
                   KVLayerSection(KVLayerRow.from_json(kv["layer"]), kv["config"]) if kv else None, bench=bench)


# report.json's own keys; every other top-level key is provenance (qtoolkit.provenance.provenance())
_REPORT_KEYS = {"verdict", "reasons", "reading", "config", "policy", "gates", "steps", "deployments",
                "deployment_bench", "not_measurable", "quantize", "eval", "eval_models", "ablation", "diagnose",
                "kv_layer", "plots"}


@dataclass
class SignoffReport:
    """Everything report.json holds; `to_json` gives report.json's layout, key for key, and `from_json` reads it
    back (a report on disk renders as the one just decided)."""

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
            "steps": {n: s.to_json(key=False) for n, s in ev.steps.items()},
        }
        if self.deployment is not None:
            bench = self.deployment.bench
            out |= {"deployments": self.deployment.endpoints,
                    "deployment_bench": None if bench is None else bench.to_json(),
                    "not_measurable": [x.to_json() for x in self.deployment.not_measurable]}
        evals = ev.evals
        ablation = None if ev.ablation is None else ev.ablation.to_json()
        if ablation is not None and ev.speed is not None:
            ablation["speed"] = ev.speed.to_json()
        out |= {
            "quantize": None if ev.quant is None else ev.quant.to_json(),
            "eval": None if evals is None else {
                t: {"items": r.items, "summary": None if r.summary is None else r.summary.to_json()}
                for t, r in evals.tasks.items()} or None,
            "eval_models": None if evals is None else evals.models,
            "ablation": ablation,
            "diagnose": None if ev.diagnose is None else ev.diagnose.to_json(),
        }
        if ev.kv_layer is not None:  # only a sign-off whose candidate has a quantized KV cache runs the layer
            out["kv_layer"] = ev.kv_layer.to_json()
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SignoffReport:
        """report.json as its type; sections a report does not have (an older one, a deployment's) are None."""
        evals = None
        if d.get("eval") is not None or d.get("eval_models") is not None:
            evals = EvalResults.from_json({"tasks": d.get("eval") or {}, "models": d.get("eval_models")})
        ablation = dict(d["ablation"]) if d.get("ablation") else None
        speed = ablation.pop("speed", None) if ablation else None
        evidence = Evidence(
            {n: StepOutcome.from_json(s) for n, s in (d.get("steps") or {}).items()},
            [Gate.from_json(g) for g in d.get("gates") or []], evals, None,
            None if d.get("quantize") is None else QuantizeSummary.from_json(d["quantize"]),
            None if ablation is None else AblationTable.from_json(ablation),
            None if d.get("diagnose") is None else DiagnoseResult.from_json(d["diagnose"]),
            None if d.get("kv_layer") is None else KVLayerSection.from_json(d["kv_layer"]),
            None if speed is None else SpeedSection.from_json(speed))
        deployment = None
        if "deployments" in d:
            bench = d.get("deployment_bench")
            deployment = DeploymentSection(dict(d["deployments"] or {}),
                                           None if bench is None else ThroughputTable.from_json(bench),
                                           [NotMeasurable(**x) for x in d.get("not_measurable") or []])
        return cls({k: v for k, v in d.items() if k not in _REPORT_KEYS}, d["verdict"], list(d.get("reasons") or []),
                   list(d.get("reading") or []), dict(d.get("config") or {}), Policy.model_validate(d["policy"]),
                   evidence, deployment)


def decide(evidence: Evidence, *, provenance: dict[str, Any], config: dict[str, Any], policy: Policy,
           deployment: DeploymentSection | None = None, without_gates: str = verdicts.INCONCLUSIVE) -> SignoffReport:
    """ERROR when a step did not finish (no gate could judge the candidate), else the gates' overall verdict;
    `without_gates` is the verdict when the policy left nothing to judge. Reasons name the failed steps, then
    every gate that failed or holds a required gate undecided, in its own verdict's words."""
    # a skipped step (a sweep's bench of a candidate that already fails a gate) is not a failure: the gates it
    # would feed show no evidence, and the failed gate decides
    failed_steps = [n for n, s in evidence.steps.items() if s.status not in ("ok", "skipped")]
    gates = evidence.gates
    verdict = (verdicts.ERROR if failed_steps else without_gates if not gates
               else verdicts.overall([(g.verdict, g.required) for g in gates]))
    reasons = [f"step {n} failed: {evidence.steps[n].error}" for n in failed_steps]
    reasons += [f"gate {g.name} {g.verdict.lower()}: {g.detail}" for g in gates
                if g.verdict == verdicts.FAIL or (g.verdict != verdicts.PASS and g.required)]
    reading = verdicts.reading(gates, evidence.evals, evidence.sequential if evidence.evals else None)
    return SignoffReport(provenance, verdict, reasons, reading, config, policy, evidence, deployment)
