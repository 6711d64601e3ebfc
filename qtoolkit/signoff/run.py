"""`qtool signoff`: model + recipe -> quantize, eval, bench (layer-by-layer ablation), diagnose -> verdict + report.

Each step writes its own JSON in the output folder and records the hash of its inputs in `steps.json`; a rerun
skips a step whose output exists with the same input hash. A failing step does not stop the report: it is marked,
and the verdict can then only be FAIL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bench.ablation import BASE_SYSTEMS, bench_ablation
from ..bench.kv_layer import UNQUANTIZED, bench_kv_layer, resolve_kv_dtype
from ..diagnose.run import diagnose
from ..draft.format import check_fits, read_head_config
from ..engine.config import KV_CACHE_DTYPES, EngineConfig
from ..errors import QToolError
from ..evals.backends.on_demand import return_freed_memory
from ..evals.results import EvalResults
from ..evals.resummarize import resummarize
from ..evals.runner import EvalConfig, evaluate
from ..evals.sandbox.run import require
from ..evals.stats.paired import NOMINAL, Level
from ..io import write_json
from ..model.llama import ModelConfig
from ..model.sources import ModelSource, resolve_model
from ..provenance import provenance
from ..quantize.plausibility import check_source
from ..quantize.recipe import Recipe, load_recipe
from ..quantize.report import QuantizeReport
from ..quantize.run import quantize
from . import workload
from .config import EngineSignoffConfig, LocalSignoffConfig
from .error_spending import SequentialRecord, plan
from .judge import Gate, evaluate_gates, undecided_and_failed
from .policy import Policy, load_policy
from .report import write_reports
from .sequential import eval_step, planned_items
from .speed import SpeedPlan
from .steps import STEPS, StepOutcome, StepRunner
from .verdict import Evidence, SpeedSection, decide

__all__ = ["Gate", "LocalSignoffConfig", "evaluate_gates", "signoff_local"]


def check_config(cfg: EngineSignoffConfig, rejudge: bool = False) -> Policy:
    """Bad input is an error (exit 2) before any work; the policy it names, loaded (`rejudge`: judging again runs
    no model-written code, so it needs no sandbox)."""
    if cfg.limit <= 0:
        raise QToolError(f"--limit must be a positive number of items, got {cfg.limit}")
    if cfg.rounds <= 0:
        raise QToolError(f"--rounds must be a positive number of bench rounds, got {cfg.rounds}")
    if cfg.max_rounds is not None and cfg.max_rounds < cfg.rounds:
        raise QToolError(f"--max-rounds ({cfg.max_rounds}) must be at least --rounds ({cfg.rounds})")
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise QToolError(f"--kv-cache-dtype {cfg.kv_cache_dtype!r} is unknown: use one of {', '.join(KV_CACHE_DTYPES)}")
    if cfg.max_items is not None and cfg.max_items < cfg.limit:
        raise QToolError(f"--max-items ({cfg.max_items}) must be at least --limit ({cfg.limit})")
    policy = load_policy(cfg.policy)
    workload.check_policy(policy, cfg.data)
    if ("code" in policy.tasks or not policy.tasks) and not rejudge:
        require(cfg.allow_weak_sandbox)  # fail closed before any work: model-written code needs the sandbox
    return policy


def _refuse_sweep_candidate(out: Path) -> None:
    """A sweep's candidate folder (DIR/candidates/NAME) judged alone would reuse the sweep's evidence at a full
    5% instead of the candidate's share of the family-wise error: refused, with the command that keeps it."""
    sweep = out.resolve().parent.parent
    marks = [sweep / "steps.json", sweep / "report.json"]  # a sweep's folder holds its own steps and ranking
    if out.resolve().parent.name == "candidates" and any(p.is_file() for p in marks):
        raise QToolError(f"{out} is a candidate of the sweep in {sweep}: rerun that sweep's command (its finished "
                         "steps are reused and judged at the candidate's share of 5%), or sign off into a new "
                         "--output")


def check_speculative(speculative: str | None, source: ModelSource) -> None:
    """A bad --speculative (or an EAGLE-3 head that does not fit the model) fails here, before any work, not at
    the bench step after quantization and evals."""
    spec = EngineConfig(speculative=speculative).speculative_spec
    if spec is not None and spec.kind == "eagle3":
        folder = Path(str(spec.path))
        check_fits(folder, read_head_config(folder), ModelConfig.from_hf(source.config))


def signoff_local(cfg: LocalSignoffConfig) -> dict[str, Any]:
    """Run every step (or reuse it), decide, and write report.{json,md,html} into cfg.output."""
    policy = check_config(cfg, cfg.rejudge)
    out = Path(cfg.output)
    _refuse_sweep_candidate(out)
    if cfg.rejudge:
        return _rejudge(cfg, policy, out)
    recipe = load_recipe(cfg.recipe)
    source = resolve_model(cfg.model)
    check_source(source)  # a GGUF read wrong decodes to garbage: refused before anything is signed off
    check_speculative(cfg.speculative, source)
    out.mkdir(parents=True, exist_ok=True)
    run = SignoffRun(cfg, policy, recipe, source, out, StepRunner(out))
    try:
        run.steps()
        return decide_and_write(cfg, policy, {"name": recipe.name, "sha256": recipe.sha256}, source.describe(), out,
                       run.results, run.quant)
    finally:
        run.runner.lock.release()  # the folder is free again for the next run in this process


@dataclass
class SignoffRun:
    """One sign-off's steps, in order: each runs (or is reused) through the StepRunner."""

    cfg: LocalSignoffConfig
    policy: Policy
    recipe: Recipe
    source: ModelSource
    out: Path
    runner: StepRunner
    results: dict[str, StepOutcome] | None = None
    quant: QuantizeReport | None = None
    tasks: str = ""
    data: list[dict[str, str]] | None = None  # the workload files' hashes, in the steps' reuse keys
    kv: str = UNQUANTIZED  # the candidate's KV cache, `auto` resolved against its checkpoint (resolve_kv_dtype)

    def steps(self) -> None:
        """quantize -> eval -> bench -> diagnose, each run or reused."""
        self.quality()
        if self.quant:
            self.bench_step()
        else:
            self.results["bench"] = StepOutcome.failed("skipped: no quantized checkpoint")
        self.diagnose_step(lambda path: write_json(path, diagnose(
            str(self.source.path), batches=self.cfg.diagnose_batches, prompt_lengths=(64, 512)).to_json()))

    @property
    def cand_key(self) -> str:
        """The candidate is identified by what made it: the source weights and the recipe."""
        assert self.quant is not None
        return f"{self.source.sha256}:{self.quant.recipe.sha256}"

    def quality(self) -> None:
        """Quantize, then evaluate the candidate against the baseline (when quantizing worked)."""
        cfg, out, source = self.cfg, self.out, self.source
        self.results = {}
        self.tasks = workload.eval_tasks(self.policy, cfg.data)
        self.data = workload.data_inputs(cfg.data)
        ckpt = out / "checkpoint"
        self.results["quantize"] = self.runner.run(
            "quantize", {"model": source.sha256, "recipe": self.recipe.sha256}, ckpt / "quantize_report.json",
            lambda: quantize(source.path, cfg.recipe, ckpt, overwrite=True))
        self.quant = QuantizeReport.load(ckpt / "quantize_report.json") if self.results["quantize"].ok else None
        return_freed_memory()  # the quantizer's models are gone: their heap back to the OS before the eval loads
        if self.quant:
            self.kv = resolve_kv_dtype(cfg.kv_cache_dtype, ckpt)
            self.eval_step(self.cand_key)
        else:
            self.results["eval"] = StepOutcome.failed("skipped: no quantized checkpoint")

    def diagnose_step(self, write: Callable[[Path], None]) -> None:
        """The baseline model's diagnosis (`write(path)` produces it: measured, or copied from a sweep's one)."""
        path = self.out / "diagnose.json"
        self.results["diagnose"] = self.runner.run(
            "diagnose", {"model": self.source.sha256, "batches": self.cfg.diagnose_batches}, path,
            lambda: write(path))

    def eval_config(self, tasks: str, items: int, output: Path, overwrite: bool = False,
                    level: Level = NOMINAL) -> EvalConfig:
        """The candidate against the baseline as its eval step runs them (the sweep re-reads the same items)."""
        cfg = self.cfg
        return EvalConfig(model=str(self.out / "checkpoint"), baseline=str(self.source.path), tasks=tasks,
                          output=str(output), limit=items, endpoint=cfg.endpoint, seed=cfg.seed, overwrite=overwrite,
                          kv_cache_dtype=UNQUANTIZED if cfg.endpoint else self.kv,
                          task_options=workload.task_options(cfg), baseline_generations=cfg.baseline_generations,
                          level=level)

    def eval_step(self, cand_key: str) -> None:
        cfg, policy, out, tasks, data = self.cfg, self.policy, self.out, self.tasks, self.data
        inputs = {"candidate": cand_key, "baseline": self.source.sha256, "tasks": tasks, "limit": cfg.limit,
                  "endpoint": cfg.endpoint, "seed": cfg.seed, **({"data": data} if data else {}),
                  **({"kv_cache_dtype": self.kv} if self.kv != UNQUANTIZED and not cfg.endpoint else {})}

        def run(items: int, overwrite: bool, only: list[str] | None, level: Level) -> None:
            # a further look reuses the items of the looks before it
            evaluate(self.eval_config(",".join(only) if only else tasks, items, out / "eval.json", overwrite, level))

        def judge() -> tuple[list[Gate], list[Gate]]:
            evals = EvalResults.load(out / "eval.json")
            return undecided_and_failed(workload.gate_policy(policy, evals, cfg.data), evals)

        self.results["eval"] = eval_step(self.runner, out, inputs, policy, cfg.limit, cfg.max_items, run, judge)

    def bench_plan(self) -> tuple[dict[str, Any], EngineConfig, dict[str, Any]]:
        """The bench step's reuse key, the servers' engine options and the ablation's arguments. With speed gates
        in the policy every system serves --rounds rounds at every tier (each layer of the ablation gets an
        interval per tier) and the speed gates' pair serves more, up to --max-rounds, while a gate is undecided."""
        cfg, policy, data = self.cfg, self.policy, self.data
        quantization_gate = policy.throughput.min_quantization_speedup is not None
        plan = SpeedPlan.of(policy, cfg.rounds, cfg.max_rounds)
        repeat = None if plan.speed is not None else \
            ("baseline_static", "full_stack") + (("candidate_static",) if quantization_gate else ())
        engine = EngineConfig(speculative=cfg.speculative, kv_cache_dtype=self.kv)
        kwargs = {"concurrency": cfg.concurrency, "num_requests": cfg.num_requests,
                  "mean_output_tokens": cfg.mean_output_tokens, "seed": cfg.seed, "rounds": cfg.rounds,
                  "repeat": repeat, "workload": workload.bench_workload(cfg.data, self.out / "eval.json"),
                  "speed": plan.speed, "capacity": plan.capacity}
        inputs = {"candidate": self.cand_key, "baseline": self.source.sha256, "systems": [s.label for s in BASE_SYSTEMS],
                  "concurrency": cfg.concurrency, "num_requests": cfg.num_requests,
                  "mean_output_tokens": cfg.mean_output_tokens, "seed": cfg.seed, "speculative": cfg.speculative,
                  "rounds": cfg.rounds, "quantization_gate": quantization_gate, **({"data": data} if data else {}),
                  **({"kv_cache_dtype": self.kv} if self.kv != UNQUANTIZED else {})}
        return inputs | plan.inputs, engine, kwargs

    def bench_done(self) -> bool:
        """Whether an earlier run with the same inputs finished the bench step (a rerun reuses it)."""
        return self.runner.finished("bench", self.bench_plan()[0], self.out / "bench.json")

    def bench_step(self, measured: dict[str, Any] | None = None) -> None:
        """The ablation (or `measured`: this candidate's result of a sweep's shared bench) into bench.json."""
        out = self.out
        inputs, engine, kwargs = self.bench_plan()

        def do_bench() -> None:
            result = measured if measured is not None else bench_ablation(
                self.source.path, out / "checkpoint", engine, **kwargs)
            if "error" in result:  # the sweep's bench could not serve this candidate
                raise QToolError(result["error"])
            write_json(out / "bench.json", result)
            self.kv_layer(engine)

        self.results["bench"] = self.runner.run("bench", inputs, out / "bench.json", do_bench)

    def kv_layer(self, engine: EngineConfig) -> None:
        """The ablation's KV cache layer, when the candidate's cache is quantized: the candidate with the
        unquantized and the quantized cache at the top tier's concurrency, on long prompts, where the unquantized
        cache is the limit. Without it, an earlier run's bench_kv.json is removed (it describes another cache)."""
        cfg, path = self.cfg, self.out / "bench_kv.json"
        if self.kv == UNQUANTIZED:
            path.unlink(missing_ok=True)
            return
        write_json(path, bench_kv_layer(self.out / "checkpoint", self.kv, engine.replace(speculative=None),
                                        concurrency=max(cfg.concurrency), num_requests=cfg.num_requests,
                                        seed=cfg.seed, rounds=cfg.rounds))


def _rejudge(cfg: LocalSignoffConfig, policy: Policy, out: Path) -> dict[str, Any]:
    """Decide again from the step outputs already in `out` (e.g. under another policy, or after a fix to an
    interval method); runs nothing. Every summary is rebuilt from its per-item records by this code
    (evals/resummarize.py) at the level of the look its task stopped at, under this code's error spending."""
    if not (out / "steps.json").is_file():
        raise QToolError(f"{out} holds no sign-off steps (steps.json) to judge again: run `qtool signoff` first")
    runner = StepRunner(out)
    state = runner.state
    runner.lock.release()  # judging again writes only the reports
    results = {n: state.get(n) or StepOutcome.failed("never ran") for n in STEPS}
    ckpt_report = out / "checkpoint" / "quantize_report.json"
    quant = QuantizeReport.load(ckpt_report) if results["quantize"].ok else None
    recipe = quant.recipe.to_json() if quant else {"name": cfg.recipe, "sha256": None}
    evals, sequential = None, SequentialRecord.load(out / "sequential.json")
    if results["eval"].ok:
        _check_rejudge_data(EvalResults.load(out / "eval.json"), cfg.data)
        planned = planned_items(sequential) or [cfg.limit]
        design = plan(planned)
        evals = resummarize(out / "eval.json", design.level_at, len(design.items), workload.task_options(cfg))
        if sequential is not None:
            sequential = sequential.with_design(design)
    return decide_and_write(cfg, policy, recipe, {"spec": cfg.model}, out, results, quant, evals=evals,
                   sequential=sequential)


def _check_rejudge_data(evals: EvalResults, data: list[str]) -> None:
    """The workload gates are judged only with the run's own --data files: without them a custom task's gates
    would silently drop out of the verdict (a FAIL could become a PASS)."""
    judged = {t for t in evals.tasks if t.startswith("custom:")}
    given = set(workload.custom_tasks(data))
    if judged - given:
        raise QToolError(f"this run judged workload file(s) {', '.join(sorted(judged))}: pass the same --data "
                         "FILE(s) to --rejudge, or its workload gates would drop out of the verdict")
    if given - judged:
        raise QToolError(f"--data names {', '.join(sorted(given - judged))}, which this run did not evaluate: "
                         "--rejudge judges only what the run measured")


def decide_and_write(cfg: LocalSignoffConfig, policy: Policy, recipe: dict[str, Any], model: dict[str, Any], out: Path,
                     results: dict[str, StepOutcome], quant: QuantizeReport | None, *,
                     evals: EvalResults | None = None, sequential: SequentialRecord | None = None) -> dict[str, Any]:
    """The evidence in `out` read once (Evidence.load), judged, decided, and written as report.{json,md,html}."""
    evidence = Evidence.load(out, {n: results.get(n) or StepOutcome(None) for n in STEPS}, evals=evals,
                             sequential=sequential,
                             quant=quant.summary if quant else None)
    bench = evidence.bench
    evidence.speed = SpeedSection.of(bench, policy)  # the report's first lines
    evidence.gates = evaluate_gates(workload.gate_policy(policy, evidence.evals, cfg.data), evidence.evals,
                                    evidence.ablation, evidence.quant, bench)
    report = decide(evidence, config=cfg.to_json(), policy=policy, provenance=provenance(
        model=model, recipe=recipe, policy={"name": policy.name, "path": policy.source}))
    return write_reports(out, report)
