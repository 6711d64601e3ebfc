"""An eval.json's summaries rebuilt from its per-item records by the interval methods of the code now running.

A verdict is judged from summaries, and a summary is a function of the items' records and the statistics code.
`qtool signoff --rejudge` therefore rebuilds every task's summary from the records (the items in the task's own
order, at the level of the look the task stopped at) instead of reading the summaries stored when the run was
made: a fix to an interval method reaches an existing run folder. Nothing is run, nothing is written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from qtoolkit.errors import QToolError
from qtoolkit.io import read_results_json

from .registry import make_task
from .results import EvalResults
from .stats.paired import Level
from .summary import TaskSummary


def resummarize(path: Path, level_at: Callable[[int], float], looks: int, task_options: dict[str, Any]
                ) -> EvalResults:
    """Every finished task of `path` summarized again; `level_at(items)` is the look level for that many items
    in a design of `looks` planned looks.

    Workload tasks (custom:NAME) need their files in `task_options["custom_data"]`, with the hash they were
    evaluated with: a task whose file is missing or changed cannot be judged again (one-line error)."""
    data = read_results_json(path)
    seed = int((data.get("inputs") or {}).get("seed") or 0)
    for name, entry in (data.get("tasks") or {}).items():
        if entry.get("summary") is None or not entry.get("records"):
            continue  # unfinished, or a file that holds summaries only: there is nothing to rebuild them from
        # the code task's sandbox is not used (nothing runs); the summary keeps the isolation it was scored under
        task = make_task(name, seed=seed, **{**task_options, "allow_weak_sandbox": True})
        stored = (entry.get("key") or {}).get("settings") or {}
        if name.startswith("custom:") and stored.get("data_sha256") != task.settings().get("data_sha256"):
            raise QToolError(f"{name}: --data {task.settings().get('data')} is not the file this run evaluated "
                             "(its sha256 differs): pass the run's own workload file to --rejudge")
        n = int(entry.get("items") or len(entry["records"]))
        ids = [it["id"] for it in task.items(n)]
        missing = [i for i in ids if i not in entry["records"]]
        if missing:
            raise QToolError(f"{path}: task {name} has no records for {len(missing)} of its {n} items "
                             f"(e.g. {missing[0]}): it cannot be judged again; rerun the sign-off")
        summary = TaskSummary.from_json(task.summarize([entry["records"][i] for i in ids], seed=seed,
                                                       level=Level(level_at(n), looks))).to_json()
        if "isolation" in entry["summary"]:
            summary["isolation"] = entry["summary"]["isolation"]
        entry["summary"] = summary
    return EvalResults.from_json(data)
