"""The task registry: a task name (`code`, `summarization`, `perplexity`, `custom:NAME`) -> a Task.

It lives apart from evals/task.py (what every task is) so that no task module and the module it implements
import each other.
"""

from __future__ import annotations

from typing import Any

from .code import CodeTask
from .custom import make_custom_task
from .perplexity import PerplexityTask
from .summarization import SummarizationTask
from .task import Task, TaskError

TASK_NAMES = ("code", "summarization", "perplexity")


def make_task(name: str, **options: Any) -> Task:
    if name == "code":
        return CodeTask(**options)
    if name == "summarization":
        return SummarizationTask(**options)
    if name == "perplexity":
        return PerplexityTask(**options)
    if name.startswith("custom:"):
        return make_custom_task(name, **options)
    raise TaskError(f"unknown task {name!r}: choose from {', '.join(TASK_NAMES)}")


def parse_tasks(spec: str) -> list[str]:
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise TaskError(f"no task in {spec!r}: choose from {', '.join(TASK_NAMES)}")
    for n in names:
        if n == "custom":
            raise TaskError("--task custom needs a workload file: pass --data FILE.jsonl (one task per file)")
        if n.startswith("custom:") and len(n) > 7:
            continue  # a workload file's task: make_task finds its file (evals/custom.py)
        if n not in TASK_NAMES:
            raise TaskError(f"unknown task {n!r}: choose from {', '.join(TASK_NAMES)}")
    return list(dict.fromkeys(names))
