"""`qtool eval --harness lm-eval`: lm-eval tasks (ours in evals/tasks/ or lm-eval's) on the `qtoolkit` model.

Everything runs offline: the hub and datasets libraries are told so before lm-eval is imported, and our
shipped tasks read data from installed wheels.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qtoolkit.errors import QToolError
from qtoolkit.io import write_json
from qtoolkit.provenance import provenance

from .paired import paired_results

TASKS_DIR = Path(__file__).resolve().parent.parent / "tasks"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1"}


def go_offline() -> None:
    for k, v in OFFLINE.items():
        os.environ.setdefault(k, v)


def shipped_tasks() -> list[str]:
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def run_lm_eval(model: str | None, tasks: str, output: str | os.PathLike, *, limit: int | None = None,
                backend: str = "engine", seed: int = 0, num_fewshot: int | None = None,
                baseline: str | None = None, log_samples: bool = False) -> dict[str, Any]:
    """simple_evaluate over `tasks` (comma-separated); writes results JSON with provenance.

    With `baseline`, the baseline model runs the same documents and `paired` holds per-metric paired deltas
    with bootstrap CIs (evals/lm_eval/paired.py); `log_samples` keeps lm-eval's per-document samples."""
    go_offline()  # lm_eval (an optional dependency) reads the offline switches when imported: set them first
    from lm_eval.tasks import TaskManager

    from . import model as lm_eval_model  # noqa: F401  (registers the `qtoolkit` model)

    if limit is not None and limit <= 0:
        raise QToolError(f"--limit must be a positive number of items, got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise QToolError(f"--num_fewshot must be 0 or more, got {num_fewshot}")
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    manager = TaskManager(include_path=str(TASKS_DIR))
    unknown = [n for n in names if n not in manager.all_tasks]
    if not names or unknown:
        raise QToolError(f"unknown lm-eval task(s) {', '.join(unknown) or tasks!r}: shipped offline tasks are "
                         f"{', '.join(shipped_tasks())}")

    def evaluate(spec: str | None) -> dict[str, Any]:
        import lm_eval

        return lm_eval.simple_evaluate(
            model="qtoolkit", model_args={"pretrained": spec or "default", "backend": backend}, tasks=names,
            task_manager=manager, limit=limit, num_fewshot=num_fewshot, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed, log_samples=log_samples or baseline is not None)

    results = evaluate(model)
    out = {**provenance(model=model or "default", backend=backend, tasks=names, limit=limit, seed=seed,
                        num_fewshot=num_fewshot, baseline=baseline),
           "harness": "lm-eval", "results": results["results"], "configs": results.get("configs", {}),
           "n_samples": results.get("n-samples", {})}
    if log_samples:
        out["samples"] = results.get("samples", {})
    if baseline is not None:
        base = evaluate(baseline)
        out["baseline"] = {"model": baseline, "results": base["results"]}
        if log_samples:
            out["baseline"]["samples"] = base.get("samples", {})
        out["paired"] = paired_results(results.get("samples", {}), base.get("samples", {}), seed=seed)
    write_json(output, out)
    return out
