"""`qtool signoff --candidate-endpoint URL --baseline-endpoint URL`: sign off the deployment that ships.

Quality is scored on both endpoints, paired, with one set of generation settings (`qtool eval` with two
endpoints); throughput tiers and the throughput gate come from the same load generator and rounds against both
(`deployment_bench`); memory gates read the local candidate checkpoint's `quantize_report.json`. Whatever an
endpoint cannot give is listed as "not measurable on this deployment" and never filled in from the local engine;
a gate resting on it has `state="not measurable"` (and `passed=False`, so it cannot pass by absence).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from qtoolkit.evals.custom import custom_tasks
from qtoolkit.evals.runner import EvalConfig, evaluate

from ..bench.deployment import bench_deployments, throughput_table
from ..endpoints.deployment import Deployment, EndpointInfo, endpoint, probe
from ..errors import QToolError
from ..evals.summary import TaskSummary
from ..io import write_json
from ..model.sources import resolve_model
from ..progress import status
from ..provenance import provenance
from ..quantize.report import QuantizeReport
from . import gates as verdicts
from . import workload as custom_signoff
from .judge import Gate, evaluate_gates, undecided_and_failed
from .policy import Policy, load_policy
from .report import write_reports
from .sequential import describe, draw_until_decisive
from .steps import SignoffConfig, StepRunner

STEPS = ("checkpoint", "eval", "bench")
NOT_MEASURABLE = "not measurable"
# (key, what, why): measured by qtoolkit only on servers it starts itself, or on this machine
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


def deployments(cfg: SignoffConfig) -> dict[str, Deployment]:
    if not (cfg.candidate_endpoint and cfg.baseline_endpoint):
        raise QToolError("pass both --candidate-endpoint and --baseline-endpoint: a deployment sign-off measures "
                         "both sides the same way (or neither, to sign off qtoolkit's own engine)")
    if cfg.endpoint:
        raise QToolError("--endpoint is the candidate-only shortcut: use --candidate-endpoint with --baseline-endpoint")
    baseline_local = cfg.baseline or cfg.model
    return {"candidate": endpoint("candidate", cfg.candidate_endpoint, local=cfg.model, model_id=cfg.candidate_model_id),
            "baseline": endpoint("baseline", cfg.baseline_endpoint, local=baseline_local,
                                 model_id=cfg.baseline_model_id)}


def _unmeasurable_gate(g: Gate, evals: dict[str, Any] | None, quant: QuantizeReport | None) -> str | None:
    """Why gate `g` cannot be measured through the endpoints, or None if it was (or should have been)."""
    if g.point is not None:
        return None
    group, metric = g.name.split(".", 1)
    if group == "throughput" and metric == "min_quantization_speedup":
        return ("quantization alone needs both models on the same static-batching engine; two endpoints give "
                "only the deployments' ratio (throughput.min_speedup)")
    if group == "memory":
        return None if quant else "the local --model folder has no quantize_report.json (write it with qtool quantize)"
    if group in ("code", "summarization"):
        raw = (((evals or {}).get("tasks") or {}).get(group) or {}).get("summary")
        if raw is None:
            return None  # the eval step failed: that is an error, not a property of the deployment
        if metric.startswith("kld"):
            return ALWAYS_NOT_MEASURABLE[1][2]
        summary = TaskSummary.from_json(raw)
        stats = summary.text_stats
        why = summary.get("not_computed", []) + (stats.not_computed if stats is not None else [])
        return "; ".join(why) if why else None
    return None


def _checkpoint_report(dep: Deployment) -> QuantizeReport | None:
    return QuantizeReport.load(resolve_model(dep.local).path / "quantize_report.json")


def signoff_deployments(cfg: SignoffConfig) -> dict[str, Any]:
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
    custom_signoff.check_policy(policy, cfg.data)
    tasks = custom_signoff.eval_tasks(policy, cfg.data)
    served = {role: {"url": i.url, "model_id": i.model_id, "version": i.version, "server": i.server}
              for role, i in infos.items()}
    results: dict[str, dict[str, Any]] = {}
    quant = _checkpoint_report(deps["candidate"])
    results["checkpoint"] = {"status": "ok", "note": "quantize_report.json of --model" if quant else
                             "--model has no quantize_report.json"}
    results["eval"] = _eval_step(cfg, policy, deps, infos, steps, tasks,
                                 {"served": served, "tokenizers": {r: s.sha256 for r, s in sources.items()}})
    bench_kw = {"concurrency": cfg.concurrency, "num_requests": cfg.num_requests,
                "mean_output_tokens": cfg.mean_output_tokens, "max_output_tokens": 2 * cfg.mean_output_tokens,
                "seed": cfg.seed, "rounds": cfg.rounds}
    results["bench"] = steps.run("bench", {"served": served, **bench_kw}, out / "bench.json",
                                 lambda: write_json(out / "bench.json", bench_deployments(deps, infos, **bench_kw)))
    evals = _load(out / "eval.json") if results["eval"]["status"] == "ok" else None
    bench = _load(out / "bench.json") if results["bench"]["status"] == "ok" else None
    table = throughput_table(bench) if bench else None
    gates = evaluate_gates(custom_signoff.gate_policy(policy, evals, cfg.data), evals, table, quant)
    for g in gates:
        if why := _unmeasurable_gate(g, evals, quant):
            g.state, g.detail = NOT_MEASURABLE, f"not measurable on this deployment: {why}"
            g.passed, g.verdict = False, verdicts.INCONCLUSIVE
    try:
        return _decide_and_write(cfg, policy, infos, results, gates, evals, table, quant)
    finally:
        steps.lock.release()  # the folder is free again for the next run in this process


def _eval_step(cfg: SignoffConfig, policy: Policy, deps: dict[str, Deployment], infos: dict[str, EndpointInfo],
               steps: StepRunner, tasks: str, identity: dict[str, Any]) -> dict[str, Any]:
    """Both endpoints scored paired; as in the local sign-off, while a measurable quality gate is undecided and
    none failed, the undecided tasks draw more items up to --max-items (qtoolkit/signoff/sequential.py)."""
    out = Path(cfg.output)
    inputs = {**identity, "tasks": tasks, "limit": cfg.limit, "seed": cfg.seed}
    if cfg.max_items and cfg.max_items > cfg.limit:  # how many items get drawn depends on the quality bounds
        inputs |= {"max_items": cfg.max_items, "quality_bounds": policy.model_dump()["tasks"]}

    def run(items: int, overwrite: bool, only: list[str] | None) -> None:
        evaluate(EvalConfig(
            model=cfg.model, baseline=deps["baseline"].local, tasks=",".join(only) if only else tasks,
            output=str(out / "eval.json"), limit=items, endpoint=infos["candidate"].url,
            baseline_endpoint=infos["baseline"].url, seed=cfg.seed, overwrite=overwrite,
            model_id=infos["candidate"].model_id, baseline_model_id=infos["baseline"].model_id,
            task_options={"allow_weak_sandbox": cfg.allow_weak_sandbox, "custom_data": custom_tasks(cfg.data)}))

    def judge() -> tuple[list[str], list[str]]:
        evals = _load(out / "eval.json")
        return undecided_and_failed(custom_signoff.gate_policy(policy, evals, cfg.data), evals,
                                    skip=lambda g: _unmeasurable_gate(g, evals, None) is not None)

    resume = steps.interrupted("eval", inputs)

    def do_eval() -> None:
        looks = draw_until_decisive(run, judge, cfg.limit, cfg.max_items, resume=resume)
        write_json(out / "sequential.json", describe(looks, cfg.max_items))

    return steps.run("eval", inputs, out / "eval.json", do_eval)


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _decide_and_write(cfg: SignoffConfig, policy: Policy, infos: dict[str, EndpointInfo],
                      results: dict[str, dict[str, Any]], gates: list[Gate], evals: dict[str, Any] | None,
                      table: dict[str, Any] | None, quant: QuantizeReport | None) -> dict[str, Any]:
    failed_steps = [n for n in STEPS if results.get(n, {}).get("status") != "ok"]
    failed_gates = [g for g in gates if g.verdict == verdicts.FAIL or (g.verdict != verdicts.PASS and g.required)]
    verdict = (verdicts.ERROR if failed_steps else verdicts.FAIL if not gates
               else verdicts.overall([(g.verdict, g.required) for g in gates]))
    reasons = [f"step {n} failed: {results[n].get('error')}" for n in failed_steps]
    # as the local sign-off words them: the gate's own verdict (a no-evidence gate has not "failed")
    reasons += [f"gate {g.name} {g.verdict.lower()}: {g.detail}" for g in failed_gates]
    not_measurable = [{"key": k, "what": what, "reason": why} for k, what, why in ALWAYS_NOT_MEASURABLE]
    for task, entry in ((evals or {}).get("tasks") or {}).items():  # what the endpoints could not score
        for line in (entry.get("summary") or {}).get("not_computed", []):
            figures, _, why = line.partition(": ")
            not_measurable.append({"key": f"{task}.scores", "what": f"{task}: {figures}", "reason": why})
    not_measurable += [{"key": g.name, "what": f"gate {g.name}", "reason": g.detail.split(": ", 1)[1]}
                       for g in gates if g.state == NOT_MEASURABLE and g.name.split(".")[0] not in ("code",
                                                                                           "summarization")]
    report = {
        **provenance(model={"candidate": cfg.model, "baseline": cfg.baseline or cfg.model},
                     deployments={r: i.url for r, i in infos.items()},
                     policy={"name": policy.name, "path": policy.source}),
        "verdict": verdict,
        "reasons": reasons,
        "reading": verdicts.reading(gates, evals, _load(Path(cfg.output) / "sequential.json") if evals else None),
        # the recipe the served checkpoint was made with, as its quantize_report.json says
        "config": {**asdict(cfg), "recipe": cfg.recipe or (quant.recipe.name if quant else None)},
        "policy": policy.model_dump(),
        "gates": [asdict(g) for g in gates],
        "steps": {n: {k: v for k, v in results.get(n, {}).items() if k != "key"} for n in STEPS},
        "deployments": {r: asdict(i) for r, i in infos.items()},
        "deployment_bench": table,
        "not_measurable": not_measurable,
        "quantize": quant.summary.to_json() if quant else None,
        "eval": {t: {"items": e.get("items"), "summary": e.get("summary")}
                 for t, e in (evals or {}).get("tasks", {}).items()} or None,
        "eval_models": (evals or {}).get("models"),
        "ablation": None,
        "diagnose": None,
    }
    write_reports(Path(cfg.output), report)
    return report
