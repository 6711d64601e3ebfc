"""`qtool signoff --recipe a,b,c`: several candidate recipes against one baseline, one recommendation.

Each candidate is a single sign-off in `DIR/candidates/NAME/` (its own steps.json, checkpoint, eval.json,
bench.json and report), so its verdict is the one a separate `qtool signoff --recipe NAME` would give at the same
seeds and sizes, and a rerun resumes every finished candidate step by step. What the candidates share is done
once: the baseline's completions (`DIR/baseline/generations.jsonl`, evals/backends/cached.py) and the baseline
model's diagnosis (`DIR/diagnose.json`). A candidate that already fails a quality or memory gate is not
benchmarked (its verdict is FAIL whatever throughput it reaches). The recommendation reads every candidate again at
its share of the family-wise error (qtoolkit/signoff/family.py) and the ranking (qtoolkit/signoff/ranking.py)
picks the cheapest that passes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bench.ablation import AblationBench, bench_candidates
from ..bench.deployment import DeploymentBench
from ..bench.kv_layer import UNQUANTIZED
from ..bench.memory import peak_memory
from ..diagnose.run import diagnose
from ..errors import OutputWriteError, QToolError
from ..evals.results import EvalResults
from ..evals.summary import RoundsRatio
from ..io import write_json
from ..model.sources import ModelSource, resolve_model
from ..progress import status
from ..quantize.plausibility import check_source
from ..quantize.recipe import Recipe, load_recipe
from . import verdicts, workload
from .apart import run_apart
from .config import (
    DeploymentSignoffConfig,
    EndpointSweepSignoffConfig,
    LocalSignoffConfig,
    SweepSignoffConfig,
)
from .deployment import judge_deployment, signoff_deployments
from .family import FamilyJudgement, Rejudge, fallback, judge_at, look_levels
from .judge import Gate, evaluate_gates
from .policy import Policy, load_policy
from .ranking import Bought, Row, worst_gate, write_sweep_reports
from .run import SignoffRun, check_config, check_speculative, decide_and_write
from .steps import StepRunner, load_output, recorded
from .verdict import SignoffReport


@dataclass
class Candidate:
    """One recipe of the sweep: its single sign-off's run, outcome and family-wise reading."""

    name: str
    spec: str  # the recipe as given (a shipped name or a file), or the served candidate's URL
    cfg: LocalSignoffConfig | DeploymentSignoffConfig
    run: SignoffRun | None = None
    error: str | None = None  # what stopped it outside its steps (its steps record their own errors)
    report: SignoffReport | None = None
    family: FamilyJudgement | None = None

    @property
    def folder(self) -> Path:
        return Path(self.cfg.output)


def signoff_sweep(cfg: SweepSignoffConfig) -> dict[str, Any]:
    """Every candidate's sign-off, the family-wise reading and the ranked report in cfg.output."""
    policy = check_config(cfg)
    specs = list(cfg.recipes)
    recipes = [load_recipe(s) for s in specs]  # an unknown recipe is bad input: exit 2 before any work
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise QToolError(f"--recipe names a recipe twice ({', '.join(names)}): list each candidate once")
    source = resolve_model(cfg.model)
    check_source(source)  # a GGUF read wrong decodes to garbage: refused before anything is signed off
    check_speculative(cfg.speculative, source)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    shared = StepRunner(out)  # one sweep per folder at a time
    generations = str(out / "baseline" / "generations.jsonl")
    cands = [Candidate(n, s, cfg.candidate(s, str(out / "candidates" / n), generations))
             for n, s in zip(names, specs, strict=True)]
    try:
        with peak_memory(pss=True) as peak:  # the whole tree: this process, its servers, sandboxes, compilers
            for i, (c, recipe) in enumerate(zip(cands, recipes, strict=True)):
                status(f"candidate {i + 1}/{len(cands)} {c.name}: quantize and evaluate")
                _guard(c, lambda c=c, recipe=recipe: _start(c, policy, recipe, source))
            _bench(cands, policy, source)
            _diagnose(cands, shared, cfg, source)
            for c in cands:
                if c.run is not None and c.error is None:
                    _guard(c, lambda c=c: _report(c, policy, source))
            _family(cands, _local_judge(policy))
        return write_sweep_reports(out, cfg, policy, [row_of(c, policy) for c in cands], specs, source.describe(),
                                   peak)
    finally:
        shared.lock.release()
        for c in cands:
            if c.run is not None:
                c.run.runner.lock.release()


def row_of(c: Candidate, policy: Policy) -> Row:
    report = c.report
    gates = report.gates if report else []
    name, frac = worst_gate(gates, policy)
    _, qfrac = worst_gate(gates, policy, quality_only=True)
    ev = report.evidence if report else None
    quant = ev.quant if ev else None
    top = ev.ablation.top if ev and ev.ablation else None
    rounds = RoundsRatio.from_json(top.total_speedup_rounds) if top else None
    figs = ev.speed.figures if ev and ev.speed else []
    # what a deployment buys: capacity at the policy's SLO, else the top tier's decode speedup (TPOT), else the
    # full stack's throughput
    bought = [f for f in figs if f.kind == "capacity" and f.ratio is not None] or \
        [f for f in figs if f.kind == "decode" and f.ratio is not None]
    fam = c.family
    return Row(c.name, report.verdict if report else verdicts.ERROR, fam.verdict if fam else verdicts.ERROR,
               fam.alpha if fam else 0.0, quant.totals.linear_ratio_vs_bf16 if quant else None,
               Bought(bought[-1].kind, bought[-1].ratio, bought[-1].ci, bought[-1].concurrency,
                      ev.speed.slo if bought[-1].kind == "capacity" and ev and ev.speed else None) if bought
               else Bought("full_stack", rounds.ratio, None if rounds.ci.bounds is None else
                           (rounds.ci.bounds[0], rounds.ci.bounds[1])) if rounds else None, name, frac, qfrac,
               list(report.reasons) if report else [], c.error, str(c.folder), fam.to_json() if fam else None)


def _guard(c: Candidate, fn: Callable[[], object]) -> None:
    """A candidate's failure outside its steps (a bug, a refused input) is its ERROR; the others go on."""
    try:
        fn()
    except OutputWriteError:
        raise  # no room for outputs: every candidate would fail the same way
    except Exception as e:  # noqa: BLE001 - recorded as the candidate's error and shown in the report
        c.error = f"{type(e).__name__}: {e}" if not isinstance(e, QToolError) else str(e)
        status(f"candidate {c.name}: ERROR: {c.error}")


def _start(c: Candidate, policy: Policy, recipe: Recipe, source: ModelSource) -> None:
    """Quantize and evaluate in a process of its own (apart.py: what its libraries keep goes with it), then take
    up its recorded outcomes here for the bench and the report."""
    Path(c.cfg.output).mkdir(parents=True, exist_ok=True)
    before = recorded(c.folder)
    run_apart(f"candidate {c.name}'s quantize and eval", _quality, c.cfg, policy, recipe, source, c.folder)
    c.run = SignoffRun(c.cfg, policy, recipe, source, c.folder, StepRunner(c.folder, replay=before))
    c.run.quality()
    c.run.runner.replay = None  # the bench and the diagnosis run in this process


def _quality(cfg: LocalSignoffConfig, policy: Policy, recipe: Recipe, source: ModelSource, folder: Path) -> None:
    run = SignoffRun(cfg, policy, recipe, source, folder, StepRunner(folder))
    try:
        run.quality()
    finally:
        run.runner.lock.release()


def _already_failed(c: Candidate, policy: Policy) -> str | None:
    """Why benchmarking `c` cannot change its verdict (a failed step or gate), or None."""
    assert c.run is not None and c.run.results is not None
    if c.run.quant is None or "eval" not in c.run.results or not c.run.results["eval"].ok:
        return "its quantize or eval step did not finish"
    evals = EvalResults.load(c.folder / "eval.json")
    gates = evaluate_gates(workload.gate_policy(policy, evals, c.cfg.data), evals, None, c.run.quant)
    failed = [g.name for g in gates if g.verdict == verdicts.FAIL]
    if not failed:
        return None
    return f"gate {failed[0]} already fails" if len(failed) == 1 else f"gates {', '.join(failed)} already fail"


def _bench(cands: list[Candidate], policy: Policy, source: ModelSource) -> None:
    """Benchmark the candidates a throughput figure can still decide. Those with the model's own KV cache and the
    built-in traffic share one bench (bench_candidates: the baseline's server kept and its own layers measured
    once, one candidate's server at a time); the others are benchmarked one after another."""
    todo = []
    for c in (c for c in cands if c.run is not None and c.error is None):
        assert c.run is not None and c.run.results is not None
        reason = _already_failed(c, policy)
        if reason:
            c.run.results["bench"] = c.run.runner.skip("bench", f"not benchmarked: {reason}")
        else:
            todo.append(c)
    group = {c.name: c for c in todo if not c.run.bench_done() and c.run.kv == UNQUANTIZED and not c.cfg.data}
    if len(group) > 1:
        first = next(iter(group.values())).run
        _, engine, kwargs = first.bench_plan()
        status(f"benchmark: {', '.join(group)} against one baseline server")

        def record(name: str, result: dict[str, Any]) -> None:
            _guard(group[name], lambda: group[name].run.bench_step(result))

        try:
            bench_candidates(source.path, {n: c.folder / "checkpoint" for n, c in group.items()}, engine,
                             on_candidate=record, **kwargs)
        except OutputWriteError:
            raise
        except Exception as e:  # noqa: BLE001 - the baseline's server failed: every candidate of the group errs
            for c in group.values():
                c.error = c.error or f"the shared bench failed: {type(e).__name__}: {e}"
    for i, c in enumerate(todo):
        if c.error is None and "bench" not in c.run.results:
            status(f"candidate {c.name} ({i + 1}/{len(todo)}): benchmark")
            _guard(c, c.run.bench_step)


def _diagnose(cands: list[Candidate], shared: StepRunner, cfg: SweepSignoffConfig, source: ModelSource) -> None:
    """The baseline model is diagnosed once; each candidate's folder gets a copy (its report reads it there)."""
    path = Path(cfg.output) / "diagnose.json"
    entry = shared.run("diagnose", {"model": source.sha256, "batches": cfg.diagnose_batches}, path,
                       lambda: write_json(path, diagnose(str(source.path), batches=cfg.diagnose_batches,
                                                         prompt_lengths=(64, 512)).to_json()))

    def copy(dest: Path) -> None:
        if not entry.ok:
            raise QToolError(f"the sweep's diagnosis failed: {entry.error}")
        shutil.copyfile(path, dest)

    for c in cands:
        if c.run is not None and c.error is None:
            _guard(c, lambda c=c: c.run.diagnose_step(copy))


def _report(c: Candidate, policy: Policy, source: ModelSource) -> None:
    assert c.run is not None and c.run.results is not None
    recipe = c.run.recipe
    c.report = SignoffReport.from_json(decide_and_write(
        c.cfg, policy, {"name": recipe.name, "sha256": recipe.sha256}, source.describe(), c.folder, c.run.results,
        c.run.quant))


JudgeAt = Callable[["Candidate", float], FamilyJudgement]


def _family(cands: list[Candidate], judge: JudgeAt) -> None:
    """Each candidate's share of the family-wise error (fallback order: largest weights first, then as given)
    and its reading there; `judge(candidate, share)` reads a candidate that passed on its own."""
    def weight(c: Candidate) -> float:
        q = c.run.quant if c.run else None
        ratio = q.totals.linear_ratio_vs_bf16 if q else None
        return -ratio if ratio is not None else 1.0

    by_name = {c.name: c for c in cands}

    def passes_at(name: str, alpha: float) -> bool:
        c = by_name[name]
        if not c.report or c.report.verdict != verdicts.PASS:
            return False
        c.family = judge(c, alpha)
        return c.family.recommendable

    shares = fallback([c.name for c in sorted(cands, key=weight)], passes_at)
    for c in cands:
        if c.family is None:
            verdict = c.report.verdict if c.report else verdicts.ERROR
            c.family = FamilyJudgement(shares.get(c.name, 0.0), verdict)


def _local_judge(policy: Policy) -> JudgeAt:
    def judge(c: Candidate, alpha: float) -> FamilyJudgement:
        levels = look_levels(c.cfg.limit, c.cfg.max_items, alpha)
        return judge_at(alpha, c.folder, levels, workload.task_options(c.cfg), _rejudge(c, policy))
    return judge


def _rejudge(c: Candidate, policy: Policy) -> Rejudge:
    def run(evals: EvalResults | None, level: float) -> list[Gate]:
        bench = load_output(c.folder / "bench.json")
        measured = AblationBench.from_json(bench, level) if bench else None  # its rounds' intervals at the share
        assert c.run is not None
        return evaluate_gates(workload.gate_policy(policy, evals, c.cfg.data), evals,
                              measured.table if measured else None, c.run.quant, measured)
    return run


def signoff_endpoint_sweep(cfg: EndpointSweepSignoffConfig) -> dict[str, Any]:
    """Several served candidates against one baseline endpoint: a deployment sign-off each, one recommendation."""
    policy = load_policy(cfg.policy)
    pairs = cfg.candidates
    if (resolve_model(cfg.model).path / "quantize_report.json").is_file():
        raise QToolError(f"with several candidate endpoints --model is only their tokenizer, but {cfg.model} is a "
                         "quantized checkpoint whose bytes would be read as every candidate's: pass the unquantized "
                         "model")
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    shared = StepRunner(out)
    generations = str(out / "baseline" / "generations.jsonl")
    cands = [Candidate(n, url, cfg.candidate(url, str(out / "candidates" / n), generations)) for n, url in pairs]
    try:
        with peak_memory() as peak:
            for i, c in enumerate(cands):
                status(f"candidate {i + 1}/{len(cands)} {c.name} ({c.spec}): deployment sign-off")
                _guard(c, lambda c=c: setattr(c, "report", SignoffReport.from_json(signoff_deployments(c.cfg))))
            _family(cands, _endpoint_judge(policy))
        return write_sweep_reports(out, cfg, policy, [row_of(c, policy) for c in cands], [u for _, u in pairs],
                                   {"tokenizer": cfg.model, "baseline_endpoint": cfg.baseline_endpoint}, peak)
    finally:
        shared.lock.release()


def _endpoint_judge(policy: Policy) -> JudgeAt:
    def judge(c: Candidate, alpha: float) -> FamilyJudgement:
        def rejudge(evals: EvalResults | None, level: float) -> list[Gate]:
            bench = load_output(c.folder / "bench.json")
            table = DeploymentBench.from_json(bench).table(level) if bench else None
            return judge_deployment(c.cfg, policy, evals, table, None)[0]

        levels = look_levels(c.cfg.limit, c.cfg.max_items, alpha)
        return judge_at(alpha, c.folder, levels, workload.task_options(c.cfg), rejudge)
    return judge
