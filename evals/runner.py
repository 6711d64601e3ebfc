"""`evaluate()`: the Python API behind `qtool eval` — run tasks on candidate and baseline, write results.

Both models see the same items in the same batches; every delta is paired per item. Models are loaded only
when some item is still unfinished, so rerunning a finished evaluation just rebuilds the summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qtoolkit.engine.config import KV_CACHE_DTYPES
from qtoolkit.errors import QToolError
from qtoolkit.model.sources import resolve_model
from qtoolkit.progress import bar

from .backends.base import Backend, load_tokenizer
from .backends.cached import CachedGenerations
from .backends.factory import make_backend
from .backends.on_demand import OnDemand, Resident
from .registry import make_task, parse_tasks
from .results import EvalResults, ResultsFile
from .stats.paired import N_RESAMPLES, NOMINAL, Level
from .summary import PairedDelta, Rate, TaskSummary, TextStats
from .task import check_same_vocabulary


@dataclass
class EvalConfig:
    model: str | None
    baseline: str | None
    tasks: str = "code,summarization,perplexity"
    output: str = "eval.json"
    limit: int | None = None
    backend: str = "engine"
    endpoint: str | None = None
    baseline_endpoint: str | None = None
    seed: int = 0
    overwrite: bool = False
    model_id: str | None = None  # the served model each endpoint must list in /v1/models
    baseline_model_id: str | None = None
    task_options: dict[str, Any] = field(default_factory=dict)
    # the engine backend's KV cache storage per side (auto, fp8, int8): a KV-quantized candidate against the same
    # weights with the unquantized cache measures what the cache alone costs
    kv_cache_dtype: str = "auto"
    baseline_kv_cache_dtype: str = "auto"
    # a JSONL file of the baseline's completions (evals/backends/cached.py): a multi-recipe sign-off generates
    # them once for all its candidates
    baseline_generations: str | None = None
    # each endpoint's identity key (qtoolkit/endpoints/identity.py: model id + a fingerprint of its answers), so a
    # redeploy at the same URL reuses neither finished items nor cached completions
    endpoint_identity: str | None = None
    baseline_endpoint_identity: str | None = None
    # the level every summary's intervals are computed at: a sequential sign-off's look sets it
    # (qtoolkit/signoff/error_spending.py)
    level: Level = NOMINAL


def model_identity(spec: str | None, endpoint: str | None, backend: str,
                   kv_cache_dtype: str = "auto", served: str | None = None) -> dict[str, Any]:
    """What makes two runs comparable: the weights' hash (or the endpoint and, where known, the identity of what
    it serves), the backend and, when quantized, the KV cache's storage."""
    if endpoint:
        return {"endpoint": endpoint, "tokenizer": spec} | ({"served": served} if served else {})
    src = resolve_model(spec) if spec is not None else None
    identity = {"backend": backend, "spec": spec, "sha256": src.sha256 if src else None}
    return identity if kv_cache_dtype == "auto" else {**identity, "kv_cache_dtype": kv_cache_dtype}


class _LazyPair:
    """Candidate and baseline backends, each built when its side first runs. Two in-process models (engine or
    hf on both sides) share one Resident slot: only one is loaded at a time (evals/backends/on_demand.py)."""

    def __init__(self, cfg: EvalConfig, baseline_identity: dict[str, Any]):
        self.cfg = cfg
        self.baseline_identity = baseline_identity
        self.pair: tuple[Backend, Backend] | None = None
        self.sides: tuple[OnDemand, OnDemand] | None = None

    def get(self) -> tuple[Backend, Backend]:
        if self.pair is None:
            c = self.cfg
            ids = [{"role": "candidate", "model_id": c.model_id} if c.endpoint else {},
                   {"role": "baseline", "model_id": c.baseline_model_id} if c.baseline_endpoint else {}]
            in_process = not c.endpoint and not c.baseline_endpoint
            slot = Resident() if in_process else None
            # the tokenizers alone (no model) for the vocabulary check and the tasks' prompts: the same files
            # the backends load theirs from
            toks = (load_tokenizer(resolve_model(c.model).path), load_tokenizer(resolve_model(c.baseline).path)) \
                if in_process else (None, None)
            cand = OnDemand("candidate", lambda: make_backend(
                c.model, kind=c.backend, endpoint=c.endpoint, tokenizer_from=c.model or c.baseline,
                kv_cache_dtype=c.kv_cache_dtype, **ids[0]), slot, toks[0])
            base_side = OnDemand("baseline", lambda: make_backend(
                c.baseline, kind=c.backend, endpoint=c.baseline_endpoint, tokenizer_from=c.baseline or c.model,
                kv_cache_dtype=c.baseline_kv_cache_dtype, **ids[1]), slot, toks[1])
            base: Backend = base_side
            if c.baseline_generations:
                base = CachedGenerations(base_side, c.baseline_generations, self.baseline_identity)
            check_same_vocabulary(cand, base)
            self.sides = (cand, base_side)
            self.pair = (cand, base)
        return self.pair

    def release(self) -> None:
        """Both sides' models freed (the eval is over, or a later step needs the memory)."""
        for side in self.sides or ():
            side.release()


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    names = parse_tasks(cfg.tasks)
    if cfg.limit is not None and cfg.limit <= 0:
        raise QToolError(f"--limit must be a positive number of items, got {cfg.limit}")
    if cfg.model is None and cfg.endpoint is None:
        raise QToolError("no candidate: pass --model M (or --endpoint URL)")
    if cfg.baseline is None and cfg.baseline_endpoint is None:
        raise QToolError("no baseline: pass --baseline B (or --baseline-endpoint URL)")
    for kv in (cfg.kv_cache_dtype, cfg.baseline_kv_cache_dtype):
        if kv not in KV_CACHE_DTYPES:
            raise QToolError(f"KV cache dtype {kv!r} is unknown: use one of {', '.join(KV_CACHE_DTYPES)}")
        if kv != "auto" and cfg.backend != "engine":
            raise QToolError(f"a {kv} KV cache needs the engine backend: drop --backend {cfg.backend}")
    identities = {"candidate": model_identity(cfg.model, cfg.endpoint, cfg.backend, cfg.kv_cache_dtype,
                                              cfg.endpoint_identity),
                  "baseline": model_identity(cfg.baseline, cfg.baseline_endpoint, cfg.backend,
                                             cfg.baseline_kv_cache_dtype, cfg.baseline_endpoint_identity)}
    # every task is built before anything is written or run, so a refusal (no sandbox for code) costs nothing
    built = {name: make_task(name, seed=cfg.seed, **cfg.task_options) for name in names}
    store = ResultsFile(cfg.output, overwrite=cfg.overwrite,
                        inputs={"models": identities, "tasks": names, "limit": cfg.limit, "seed": cfg.seed,
                                "bootstrap": {"resamples": N_RESAMPLES, "confidence": cfg.level.confidence,
                                              "unit": "item (paired)"}})
    models = _LazyPair(cfg, identities["baseline"])
    try:
        for name in names:
            task = built[name]
            items = task.items(cfg.limit or task.default_limit)
            done = store.begin(name, {"models": identities, "settings": task.settings()})
            todo = [it for it in items if it["id"] not in done]
            with bar(total=len(items), initial=len(items) - len(todo), desc=name, unit="item") as progress:
                for start in range(0, len(todo), task.batch_size):
                    batch = todo[start:start + task.batch_size]
                    store.add(name, task.run_batch(batch, *models.get()))
                    progress.update(len(batch))
            records = [done[it["id"]] for it in items]
            summary = TaskSummary.from_json(task.summarize(records, seed=cfg.seed, level=cfg.level))
            store.finish(name, summary.to_json(), [it["id"] for it in items])
            pair = models.pair
            if pair is not None:
                store.data["models"] = {"candidate": pair[0].describe(), "baseline": pair[1].describe()}
    finally:
        models.release()  # the next step (a look, the bench's servers) starts without this eval's model
    store.save()
    return store.data


def summary_lines(results: dict[str, Any]) -> list[str]:
    """A few human-readable lines per task for the terminal."""
    lines = []
    for name, result in EvalResults.from_json(results).tasks.items():
        lines.append(f"{name}: {result.items or 0} items")
        summary = result.summary or TaskSummary.from_json(None)
        for metric, v in summary.entries.items():
            if isinstance(v, PairedDelta) and v.delta is not None:
                lo, hi = v.ci.bounds or (float("nan"), float("nan"))
                lines.append(f"  {metric}: candidate {v.candidate:.4f} baseline {v.baseline:.4f} "
                             f"delta {v.delta:+.4f} [{lo:+.4f}, {hi:+.4f}]")
            elif isinstance(v, TextStats) and v.figure("ppl_ratio") is not None:
                lines.append(f"  {metric}: {_token_line(v)}")
            elif isinstance(v, Rate):
                lines.append(f"  {metric}: {v.rate:.3f}")
    return lines


def _token_line(v: TextStats) -> str:
    r = v.figure("ppl_ratio")
    parts = [f"PPL ratio {r.mean:.4f} ± {r.se:.4f}"]
    k = v.figure("kld")
    if k is not None:
        lo, hi = k.ci.bounds or (float("nan"), float("nan"))
        parts.append(f"KLD {k.mean:.5f} ± {k.se:.5f} [CI {lo:.5f}, {hi:.5f}], p99 {k.extra['p99']:.4f}")
    top1 = v.figure("same_top1")
    if top1 is not None:
        parts.append(f"same top-1 {top1.mean:.3f}")
    if v.not_computed:
        parts.append("not computed: " + "; ".join(str(x) for x in v.not_computed))
    return ", ".join(parts) + f" ({v.tokens} tokens)"
