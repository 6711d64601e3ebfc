"""`qtool signoff --candidate-endpoint URL --baseline-endpoint URL`: sign off the deployment that ships.

Quality is scored on both endpoints, paired, with one set of generation settings (`qtool eval` with two
endpoints); throughput tiers and the throughput gate come from the same load generator and rounds against both
(`deployment_bench`); memory gates read the local candidate checkpoint's `quantize_report.json`. Whatever an
endpoint cannot give is listed as "not measurable on this deployment" and never filled in from the local engine;
a gate resting on it has `state="not measurable"` (and `passed=False`, so it cannot pass by absence).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from qtoolkit.evals.runner import EvalConfig, evaluate
from qtoolkit.evals.stats.paired import Level

from ..bench.ablation import AblationBench
from ..bench.deployment import DeploymentBench, ThroughputTable, bench_deployments
from ..endpoints.deployment import Deployment, EndpointInfo, endpoint, probe
from ..endpoints.identity import EndpointIdentity, fingerprint, settle
from ..errors import QToolError
from ..evals.results import EvalResults
from ..io import write_json
from ..model.sources import resolve_model
from ..progress import status
from ..provenance import provenance
from ..quantize.report import QuantizeReport
from . import verdicts, workload
from .config import DeploymentSignoffConfig, EndpointsSignoffConfig
from .error_spending import SequentialRecord
from .judge import Gate, evaluate_gates, undecided_and_failed
from .policy import Policy, load_policy
from .report import write_reports
from .sequential import eval_step
from .speed import SpeedPlan
from .steps import StepOutcome, StepRunner, load_output
from .verdict import DeploymentSection, Evidence, NotMeasurable, SpeedSection, decide

STEPS = ("checkpoint", "eval", "bench")
QUALITY_TASKS = ("code", "summarization")  # built-in tasks whose figures an endpoint may not give
NOT_MEASURABLE = "not measurable"
# (key, what, why): qtoolkit measures these only on servers it starts itself, or on the machine it runs on
ALWAYS_NOT_MEASURABLE = [
    ("ablation", "layer-by-layer ablation (static -> continuous batching -> speculative decoding -> quantization)",
     "each layer is a server setting qtoolkit switches on its own engine; an endpoint is one fixed configuration"),
    ("kld", "KL divergence of next-token distributions (code.kld_*, summarization.kld_*)",
     "an OpenAI-compatible endpoint returns at most top-k logprobs, never the full next-token distribution"),
    ("speculative_engine", "engine-side speculation figures (drafted/accepted tokens, draft and verify costs)",
     "they are read from the /metrics of qtool serve processes qtoolkit starts; the endpoint's engine is not ours"),
    ("diagnose", "bottleneck diagnosis (roofline, prefill/decode step times)",
     "it measures the machine qtoolkit runs on, not the hardware behind the endpoint"),
]


def deployments(cfg: DeploymentSignoffConfig) -> dict[str, Deployment]:
    baseline_local = cfg.baseline or cfg.model
    return {"candidate": endpoint("candidate", cfg.candidate_endpoint, local=cfg.model, model_id=cfg.candidate_model_id),
            "baseline": endpoint("baseline", cfg.baseline_endpoint, local=baseline_local,
                                 model_id=cfg.baseline_model_id)}


def _unmeasurable_gate(g: Gate, evals: EvalResults | None, quant: QuantizeReport | None) -> str | None:
    """Why gate `g` cannot be measured through the endpoints, or None if it was (or should have been)."""
    if g.point is not None:
        return None
    if g.task == "throughput" and g.metric == "min_quantization_speedup":
        return ("quantization alone needs both models on the same static-batching engine; two endpoints give "
                "only the deployments' ratio (throughput.min_speedup)")
    if g.task == "memory":
        return None if quant else "the local --model folder has no quantize_report.json (write it with qtool quantize)"
    if g.task in QUALITY_TASKS:
        summary = None if evals is None else evals.summary(g.task)
        if summary is None:
            return None  # the eval step failed: that is an error, not a property of the deployment
        if g.metric.startswith("kld"):
            return ALWAYS_NOT_MEASURABLE[1][2]
        stats = summary.text_stats
        why = summary.not_computed + (stats.not_computed if stats is not None else [])
        return "; ".join(str(x) for x in why) if why else None
    return None


def _checkpoint_report(dep: Deployment) -> QuantizeReport | None:
    return QuantizeReport.load(resolve_model(dep.local).path / "quantize_report.json")


def signoff_deployments(cfg: DeploymentSignoffConfig) -> dict[str, Any]:
    if cfg.limit <= 0 or cfg.rounds <= 0:
        raise QToolError(f"--limit and --rounds must be positive, got {cfg.limit} and {cfg.rounds}")
    if cfg.max_items is not None and cfg.max_items < cfg.limit:
        raise QToolError(f"--max-items ({cfg.max_items}) must be at least --limit ({cfg.limit})")
    policy = load_policy(cfg.policy)
    deps = deployments(cfg)
    sources = {role: resolve_model(d.local) for role, d in deps.items()}  # tokenizers: bad input fails here
    status("probing the candidate and baseline endpoints")
    infos: dict[str, EndpointInfo] = {role: probe(d) for role, d in deps.items()}  # unreachable: exit 2, no output
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    steps = StepRunner(out)
    workload.check_policy(policy, cfg.data)
    tasks = workload.eval_tasks(policy, cfg.data)
    infos = {role: identify(out, deps[role], i) for role, i in infos.items()}
    served = {role: {"url": i.url, "model_id": i.model_id, "version": i.version, "server": i.server,
                     "identity": i.identity} for role, i in infos.items()}
    results: dict[str, StepOutcome] = {}
    quant = _checkpoint_report(deps["candidate"])
    results["checkpoint"] = StepOutcome("ok", note="quantize_report.json of --model" if quant else
                                        "--model has no quantize_report.json")
    results["eval"] = _eval_step(cfg, policy, deps, infos, steps, tasks,
                                 {"served": served, "tokenizers": {r: s.sha256 for r, s in sources.items()}})
    bench_kw = {"concurrency": cfg.concurrency, "num_requests": cfg.num_requests,
                "mean_output_tokens": cfg.mean_output_tokens, "max_output_tokens": 2 * cfg.mean_output_tokens,
                "seed": cfg.seed, "rounds": cfg.rounds}
    plan = SpeedPlan.of(policy, cfg.rounds, cfg.max_rounds)  # the speed gates' rounds and capacity searches
    results["bench"] = steps.run("bench", {"served": served, **bench_kw, **plan.inputs}, out / "bench.json",
                                 lambda: write_json(out / "bench.json", bench_deployments(
                                     deps, infos, **bench_kw, speed=plan.speed, capacity=plan.capacity)))
    try:
        return _decide_and_write(cfg, policy, infos, results, quant)
    finally:
        steps.lock.release()  # the folder is free again for the next run in this process


def identify(out: Path, dep: Deployment, info: EndpointInfo) -> EndpointInfo:
    """`info` with the endpoint's identity (model id + a fingerprint of its answers) settled against the last run
    in `out`: a redeploy at the same URL changes it, so nothing measured on the old deployment is reused."""
    current = EndpointIdentity(info.url, info.model_id, fingerprint(dep, info.model_id))
    settled, change = settle(out, dep.role, current)
    if change:  # one line even under QTOOLKIT_QUIET: results the user may expect reused are measured again
        print(f"qtool: the {dep.role} endpoint {info.url} is not the deployment of the last run in {out}: {change}; "
              "its eval and bench steps are measured again", file=sys.stderr, flush=True)
    return replace(info, identity=settled.key(), fingerprint=asdict(settled.fingerprint), changed=change)


def _eval_step(cfg: DeploymentSignoffConfig, policy: Policy, deps: dict[str, Deployment], infos: dict[str, EndpointInfo],
               steps: StepRunner, tasks: str, identity: dict[str, Any]) -> StepOutcome:
    """Both endpoints scored paired; as in the local sign-off, while a measurable quality gate is undecided and
    none failed, the undecided tasks draw more items up to --max-items (qtoolkit/signoff/sequential.py)."""
    out = Path(cfg.output)
    inputs = {**identity, "tasks": tasks, "limit": cfg.limit, "seed": cfg.seed}
    if cfg.data:  # an edited workload file is other evidence: its hash is in the key, as in the local sign-off
        inputs["data"] = workload.data_inputs(cfg.data)

    def run(items: int, overwrite: bool, only: list[str] | None, level: Level) -> None:
        evaluate(EvalConfig(
            model=cfg.model, baseline=deps["baseline"].local, tasks=",".join(only) if only else tasks,
            output=str(out / "eval.json"), limit=items, endpoint=infos["candidate"].url,
            baseline_endpoint=infos["baseline"].url, seed=cfg.seed, overwrite=overwrite,
            model_id=infos["candidate"].model_id, baseline_model_id=infos["baseline"].model_id,
            task_options=workload.task_options(cfg), endpoint_identity=infos["candidate"].identity,
            baseline_endpoint_identity=infos["baseline"].identity,
            baseline_generations=cfg.baseline_generations, level=level))

    def judge() -> tuple[list[Gate], list[Gate]]:
        evals = EvalResults.load(out / "eval.json")
        return undecided_and_failed(workload.gate_policy(policy, evals, cfg.data), evals,
                                    skip=lambda g: _unmeasurable_gate(g, evals, None) is not None)

    return eval_step(steps, out, inputs, policy, cfg.limit, cfg.max_items, run, judge)


def judge_deployment(cfg: EndpointsSignoffConfig, policy: Policy, evals: EvalResults | None, table: ThroughputTable | None,
                     quant: QuantizeReport | None, bench: AblationBench | None = None,
                     ) -> tuple[list[Gate], list[NotMeasurable]]:
    """The gates, those the endpoints cannot give marked `not measurable` (INCONCLUSIVE, never passed), and
    what the report lists as not measurable: the engine-only figures, the figures the endpoints could not score,
    and the gates marked outside the quality tasks (whose reasons the scores already give). `bench` (the two
    endpoints' tiers, rounds and capacity searches) feeds the speed gates."""
    gates = evaluate_gates(workload.gate_policy(policy, evals, cfg.data), evals, table, quant, bench)
    items = [NotMeasurable(k, what, why) for k, what, why in ALWAYS_NOT_MEASURABLE]
    for task, result in (evals.tasks if evals else {}).items():
        for nc in [] if result.summary is None else result.summary.not_computed:
            items.append(NotMeasurable(f"{task}.scores", f"{task}: {nc.figures}", nc.reason))
    marked = []
    for g in gates:
        if why := _unmeasurable_gate(g, evals, quant):
            g.state, g.detail = NOT_MEASURABLE, f"not measurable on this deployment: {why}"
            g.passed, g.verdict = False, verdicts.INCONCLUSIVE
            if g.task not in QUALITY_TASKS:
                marked.append(NotMeasurable(g.name, f"gate {g.name}", why))
    return gates, items + marked


def _decide_and_write(cfg: DeploymentSignoffConfig, policy: Policy, infos: dict[str, EndpointInfo],
                      results: dict[str, StepOutcome], quant: QuantizeReport | None) -> dict[str, Any]:
    out = Path(cfg.output)
    steps = {n: results.get(n) or StepOutcome(None) for n in STEPS}
    evals = EvalResults.load(out / "eval.json") if steps["eval"].ok else None
    bench = load_output(out / "bench.json") if steps["bench"].ok else None
    table = DeploymentBench.from_json(bench).table() if bench else None
    speed_bench = AblationBench.from_json(bench) if bench else None
    gates, not_measurable = judge_deployment(cfg, policy, evals, table, quant, speed_bench)
    evidence = Evidence(steps, gates, evals, SequentialRecord.load(out / "sequential.json"),
                        quant.summary if quant else None)
    evidence.speed = SpeedSection.of(speed_bench, policy)  # the report's first lines
    deployment = DeploymentSection({r: asdict(i) for r, i in infos.items()}, table, not_measurable)
    # the recipe the served checkpoint was made with, as its quantize_report.json says
    config = cfg.to_json() | {"recipe": quant.recipe.name if quant else None}
    # no gate to judge is a FAIL here: a deployment passes only on what was measured through its endpoints
    report = decide(evidence, config=config, policy=policy, deployment=deployment, without_gates=verdicts.FAIL,
                    provenance=provenance(model={"candidate": cfg.model, "baseline": cfg.baseline or cfg.model},
                                          deployments={r: i.url for r, i in infos.items()},
                                          policy={"name": policy.name, "path": policy.source}))
    return write_reports(out, report)
