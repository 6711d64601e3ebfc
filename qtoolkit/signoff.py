"""`qtool signoff`: model + recipe -> quantize, eval, bench (layer-by-layer ablation), diagnose -> verdict + report.

Each step writes its own JSON in the output folder and records the hash of its inputs in `steps.json`; a rerun
skips a step whose output exists with the same input hash. A failing step does not stop the report: it is marked,
and the verdict can then only be FAIL.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import custom_signoff
from . import gates as verdicts
from .errors import QToolError
from .evals.custom import custom_tasks
from .io import lock_output, read_results_json, write_json
from .policy import METRICS, Policy, load_policy, metric_node, read_metric
from .progress import status
from .provenance import provenance, text_sha256
from .recipe import load_recipe
from .sequential import describe, draw_until_decisive
from .sources import resolve_model

STEPS = ("quantize", "eval", "bench", "diagnose")


@dataclass
class SignoffConfig:
    model: str = "default"
    recipe: str = "fp8-dynamic"
    output: str = "runs/signoff"
    policy: str = "default"
    limit: int = 8
    endpoint: str | None = None  # evaluate the candidate through a served endpoint instead of the engine
    concurrency: list[int] = field(default_factory=lambda: [1, 8])
    num_requests: int | None = None
    mean_output_tokens: int = 48
    speculative: str | None = None  # e.g. "ngram": adds the speculative-decoding layer to the ablation
    diagnose_batches: tuple[int, ...] = (1, 8)
    seed: int = 0
    rounds: int = 5  # of the throughput gates' systems at the top tier: the gates judge their spread
    max_items: int | None = None  # budget of items per task when a quality gate is inconclusive (qtoolkit/sequential.py)
    allow_weak_sandbox: bool = False  # run model-written code even where bubblewrap cannot
    rejudge: bool = False  # decide again from the step outputs in `output`, running nothing
    # a deployment sign-off (qtoolkit.signoff_deployment): both sides measured through endpoints; `model` and
    # `baseline` then name the local checkpoints (tokenizers, memory figures)
    candidate_endpoint: str | None = None
    baseline_endpoint: str | None = None
    baseline: str | None = None
    candidate_model_id: str | None = None
    baseline_model_id: str | None = None
    data: list[str] = field(default_factory=list)  # workload files: custom:STEM tasks and the bench's traffic


@dataclass
class Gate:
    name: str
    passed: bool
    detail: str
    point: float | None = None
    judged: float | None = None
    verdict: str = ""  # PASS | FAIL | INCONCLUSIVE | NO EVIDENCE (qtoolkit/gates.py)
    required: bool = True
    resolution: str = ""  # the smallest violation the gate could detect at the sample size used
    ci_method: str | None = None

    @classmethod
    def of(cls, name: str, j: verdicts.Judgement, point: float | None = None, judged: float | None = None) -> Gate:
        return cls(name, j.verdict == verdicts.PASS, j.detail, point, judged, j.verdict, j.required, j.resolution,
                   j.ci_method)
    state: str | None = None  # "not measurable": the deployment cannot give the figure (an INCONCLUSIVE gate)


class StepRunner:
    """Runs steps once per input hash; remembers outcomes in steps.json."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.path = folder / "steps.json"
        self.lock = lock_output(self.path)  # one sign-off at a time per folder: a second fails at once
        self.state: dict[str, Any] = read_results_json(self.path) if self.path.is_file() else {}

    @staticmethod
    def key(inputs: dict[str, Any]) -> str:
        return text_sha256(json.dumps(inputs, sort_keys=True, default=str))

    def interrupted(self, name: str, inputs: dict[str, Any]) -> bool:
        """True when an earlier run of this step, with the same inputs, stopped midway (its partial output can
        be resumed rather than discarded)."""
        prev = self.state.get(name) or {}
        return prev.get("key") == self.key(inputs) and prev.get("status") != "ok"

    def run(self, name: str, inputs: dict[str, Any], output: Path, fn: Callable[[], None]) -> dict[str, Any]:
        key = self.key(inputs)
        prev = self.state.get(name)
        if prev and prev.get("key") == key and prev.get("status") == "ok" and output.exists():
            status(f"{name}: up to date ({output.name}), skipped")
            return {**prev, "skipped": True}
        status(f"{name}: running")
        self.state[name] = {"key": key, "status": "running"}
        write_json(self.path, self.state)
        t = time.perf_counter()
        try:
            fn()
            entry = {"key": key, "status": "ok", "output": output.name}
        except QToolError as e:
            entry = {"key": key, "status": "error", "error": str(e)}
        except Exception as e:  # a bug or a library failure: keep the report, mark the step
            entry = {"key": key, "status": "error", "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc(limit=8)}
        entry["seconds"] = round(time.perf_counter() - t, 1)
        self.state[name] = entry
        write_json(self.path, self.state)
        if entry["status"] != "ok":
            status(f"{name}: FAILED: {entry['error']}")
        return entry


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def evaluate_gates(policy: Policy, evals: dict[str, Any] | None, ablation: dict[str, Any] | None,
                   quant: dict[str, Any] | None) -> list[Gate]:
    gates: list[Gate] = []
    tasks = (evals or {}).get("tasks", {})
    for task, bounds in policy.tasks.items():
        summary = (tasks.get(task) or {}).get("summary")
        for metric_name, bound in bounds.items():
            name = f"{task}.{metric_name}"
            if summary is None:
                gates.append(Gate(name, False, f"no {task} evaluation results", verdict=verdicts.NO_EVIDENCE,
                                  required=bound.required))
                continue
            metric = METRICS[task][metric_name]
            point, judged = read_metric(summary, metric)
            j = verdicts.judge_quality(metric_node(summary, metric), metric.sign, metric.worst == "point",
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
        rounds = top.get(f"{key}_rounds")
        if rounds and rounds.get("ci95"):  # like the quality gates: the CI end worst for the candidate
            point, judged = rounds["ratio"], rounds["ci95"][0]
            lo, hi = rounds["ci95"]
            how = f" (lower 95% bound over {rounds['rounds']} rounds)"
        j = verdicts.judge_interval(point, lo, hi, max_=None, min_=limit,
                                    n_text=f", {rounds['rounds']} rounds" if lo is not None else "")
        j.detail += where + how
        gates.append(Gate.of(f"throughput.{attr}", j, point, judged))
    totals = (quant or {}).get("totals", {})
    for attr, key in (("max_linear_ratio_vs_bf16", "linear_ratio_vs_bf16"), ("max_checkpoint_bytes", "checkpoint_bytes")):
        limit = getattr(policy.memory, attr)
        if limit is not None:
            j = verdicts.judge_interval(totals.get(key), None, None, max_=limit, min_=None)
            gates.append(Gate.of(f"memory.{attr}", j, totals.get(key), totals.get(key)))
    return gates


def signoff(cfg: SignoffConfig) -> dict[str, Any]:
    """Run every step (or reuse it), decide, and write report.{json,md,html} into cfg.output."""
    if cfg.candidate_endpoint or cfg.baseline_endpoint:
        from .signoff_deployment import (
            signoff_deployments,  # it imports this module: a top-level import cycles
        )

        return signoff_deployments(cfg)
    if cfg.limit <= 0:
        raise QToolError(f"--limit must be a positive number of items, got {cfg.limit}")
    if cfg.rounds <= 0:
        raise QToolError(f"--rounds must be a positive number of bench rounds, got {cfg.rounds}")
    if cfg.max_items is not None and cfg.max_items < cfg.limit:
        raise QToolError(f"--max-items ({cfg.max_items}) must be at least --limit ({cfg.limit})")
    policy = load_policy(cfg.policy)  # a bad policy is bad input: exit 2 before any work
    custom_signoff.check_policy(policy, cfg.data)
    if ("code" in policy.tasks or not policy.tasks) and not cfg.rejudge:
        from qtoolkit.evals.sandbox import require

        require(cfg.allow_weak_sandbox)  # fail closed before any work: model-written code needs the sandbox
    out = Path(cfg.output)
    if cfg.rejudge:
        return _rejudge(cfg, policy, out)
    recipe = load_recipe(cfg.recipe)
    source = resolve_model(cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    steps = StepRunner(out)
    ckpt = out / "checkpoint"
    tasks = custom_signoff.eval_tasks(policy, cfg.data)
    data = custom_signoff.data_inputs(cfg.data)
    results: dict[str, dict[str, Any]] = {}

    def do_quantize() -> None:
        from .quantize import quantize

        quantize(source.path, cfg.recipe, ckpt, overwrite=True)

    results["quantize"] = steps.run("quantize", {"model": source.sha256, "recipe": recipe.sha256},
                                    ckpt / "quantize_report.json", do_quantize)
    quant = _load(ckpt / "quantize_report.json") if results["quantize"]["status"] == "ok" else None
    # the candidate is identified by what made it: the source weights and the recipe
    cand_key = f"{source.sha256}:{quant['recipe']['sha256']}" if quant else None

    eval_inputs = {"candidate": cand_key, "baseline": source.sha256, "tasks": tasks, "limit": cfg.limit,
                   "endpoint": cfg.endpoint, "seed": cfg.seed, **({"data": data} if data else {})}
    if cfg.max_items and cfg.max_items > cfg.limit:  # how many items get drawn depends on the quality bounds
        eval_inputs |= {"max_items": cfg.max_items, "quality_bounds": policy.model_dump()["tasks"]}

    def do_eval() -> None:
        from qtoolkit.evals.runner import EvalConfig, evaluate

        def run(items: int, overwrite: bool, only: list[str] | None) -> None:
            # eval.json is written per batch: a rerun with the same inputs resumes its finished items, and a
            # further look reuses the items of the looks before it
            evaluate(EvalConfig(model=str(ckpt), baseline=str(source.path), tasks=",".join(only) if only else tasks,
                                output=str(out / "eval.json"), limit=items, endpoint=cfg.endpoint, seed=cfg.seed,
                                overwrite=overwrite, task_options={"allow_weak_sandbox": cfg.allow_weak_sandbox,
                                              "custom_data": custom_tasks(cfg.data)}))

        def judge() -> tuple[list[str], list[str]]:
            evals = _load(out / "eval.json")
            judged = custom_signoff.gate_policy(policy, evals, cfg.data)
            quality = [g for g in evaluate_gates(judged, evals, None, None) if g.name.split(".")[0] in judged.tasks]
            undecided = (verdicts.INCONCLUSIVE, verdicts.NO_EVIDENCE)
            return ([g.name for g in quality if g.required and g.verdict in undecided],
                    [g.name for g in quality if g.verdict == verdicts.FAIL])

        looks = draw_until_decisive(run, judge, cfg.limit, cfg.max_items, resume=resume_eval)
        write_json(out / "sequential.json", describe(looks, cfg.max_items))

    if quant:
        resume_eval = steps.interrupted("eval", eval_inputs)
        results["eval"] = steps.run("eval", eval_inputs, out / "eval.json", do_eval)

        def do_bench() -> None:
            from .ablation import bench_ablation
            from .engine.config import EngineConfig

            repeat = ["baseline_static", "full_stack"]
            if policy.throughput.min_quantization_speedup is not None:
                repeat.append("candidate_static")
            write_json(out / "bench.json", bench_ablation(
                source.path, ckpt, EngineConfig(speculative=cfg.speculative), concurrency=cfg.concurrency,
                num_requests=cfg.num_requests, mean_output_tokens=cfg.mean_output_tokens, seed=cfg.seed,
                rounds=cfg.rounds, repeat=tuple(repeat),
                workload=custom_signoff.bench_workload(cfg.data, out / "eval.json")))

        from .ablation import BASE_SYSTEMS

        results["bench"] = steps.run("bench", {"candidate": cand_key, "baseline": source.sha256,
                                               "systems": [s.label for s in BASE_SYSTEMS],
                                               "concurrency": cfg.concurrency, "num_requests": cfg.num_requests,
                                               "mean_output_tokens": cfg.mean_output_tokens, "seed": cfg.seed,
                                               "speculative": cfg.speculative, "rounds": cfg.rounds,
                                               "quantization_gate": policy.throughput.min_quantization_speedup
                                               is not None, **({"data": data} if data else {})},
                                     out / "bench.json", do_bench)
    else:
        for name in ("eval", "bench"):
            results[name] = {"status": "error", "error": "skipped: no quantized checkpoint"}

    def do_diagnose() -> None:
        from .diagnose import diagnose

        write_json(out / "diagnose.json", diagnose(str(source.path), batches=cfg.diagnose_batches,
                                                   prompt_lengths=(64, 512)))

    results["diagnose"] = steps.run("diagnose", {"model": source.sha256, "batches": cfg.diagnose_batches},
                                    out / "diagnose.json", do_diagnose)

    try:
        return _decide(cfg, policy, {"name": recipe.name, "sha256": recipe.sha256}, source.describe(), out, results,
                       quant)
    finally:
        steps.lock.release()  # the folder is free again for the next run in this process


def _rejudge(cfg: SignoffConfig, policy: Policy, out: Path) -> dict[str, Any]:
    """Decide again from the step outputs already in `out` (e.g. under another policy); runs nothing."""
    if not (out / "steps.json").is_file():
        raise QToolError(f"{out} holds no sign-off steps (steps.json) to judge again: run `qtool signoff` first")
    runner = StepRunner(out)
    state = runner.state
    runner.lock.release()  # judging again writes only the reports
    results = {n: state.get(n) or {"status": "error", "error": "never ran"} for n in STEPS}
    quant = _load(out / "checkpoint" / "quantize_report.json") if results["quantize"]["status"] == "ok" else None
    recipe = (quant or {}).get("recipe") or {"name": cfg.recipe, "sha256": None}
    return _decide(cfg, policy, recipe, {"spec": cfg.model}, out, results, quant)


def _decide(cfg: SignoffConfig, policy: Policy, recipe: dict[str, Any], model: dict[str, Any], out: Path,
            results: dict[str, dict[str, Any]], quant: dict[str, Any] | None) -> dict[str, Any]:
    from .ablation import ablation_table
    from .report import write_reports

    evals = _load(out / "eval.json") if results.get("eval", {}).get("status") == "ok" else None
    bench = _load(out / "bench.json") if results.get("bench", {}).get("status") == "ok" else None
    ablation = ablation_table(bench) if bench else None
    gates = evaluate_gates(custom_signoff.gate_policy(policy, evals, cfg.data), evals, ablation, quant)
    failed_steps = [n for n in STEPS if results.get(n, {}).get("status") != "ok"]
    verdict = verdicts.FAIL if failed_steps else verdicts.overall([(g.verdict, g.required) for g in gates])
    reasons = [f"step {n} failed: {results[n].get('error')}" for n in failed_steps]
    reasons += [f"gate {g.name} {g.verdict.lower()}: {g.detail}" for g in gates
                if g.verdict == verdicts.FAIL or (g.verdict != verdicts.PASS and g.required)]
    report = {
        **provenance(model=model, recipe=recipe,
                     policy={"name": policy.name, "path": policy.source}),
        "verdict": verdict,
        "reasons": reasons,
        "reading": verdicts.reading(gates, evals, _load(out / "sequential.json") if evals else None),
        "config": asdict(cfg),
        "policy": policy.model_dump(),
        "gates": [asdict(g) for g in gates],
        "steps": {n: {k: v for k, v in results.get(n, {}).items() if k != "key"} for n in STEPS},
        "quantize": {k: quant[k] for k in ("recipe", "totals", "timings", "smoke_test")} if quant else None,
        "eval": {t: {"items": e.get("items"), "summary": e.get("summary")}
                 for t, e in (evals or {}).get("tasks", {}).items()} or None,
        "eval_models": (evals or {}).get("models"),
        "ablation": ablation,
        "diagnose": _load(out / "diagnose.json") if results["diagnose"]["status"] == "ok" else None,
    }
    write_reports(out, report)
    return report
