"""Workload files (`qtool signoff --data FILE.jsonl`) in the sign-off: tasks, gates and the bench's traffic.

The policy's `custom` section holds the bounds of every workload file's task (custom:STEM). Without --data the
section is left out; a bound whose figure the file cannot give (ROUGE-L without any `reference`, pass@1 without
any `tests`) is left out of that file's gates rather than failing as "not measured".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..bench.workload_files import FileWorkload
from ..evals.custom import custom_tasks
from ..evals.custom_summary import AnswerSide
from ..evals.results import EvalResults
from ..evals.workload_file import file_sha256
from .config import CommonSignoffConfig
from .policy import Policy, PolicyError

# metric -> the summary count that says whether the file can give it
_NEEDS = {"rougeL_drop": "items_with_reference", "pass_at_1_drop": "items_with_tests"}


def check_policy(policy: Policy, data: list[str]) -> None:
    if data and "custom" not in policy.tasks:
        raise PolicyError(f"policy {policy.name} has no `custom` section for --data: add tasks.custom bounds "
                          "(see recipes/policies/default.yaml)")
    custom_tasks(data)  # two files with one name: exit 2 before any work


def task_options(cfg: CommonSignoffConfig) -> dict[str, Any]:
    """What every eval of a sign-off passes its tasks: the sandbox choice and the workload files' tasks."""
    return {"allow_weak_sandbox": cfg.allow_weak_sandbox, "custom_data": custom_tasks(cfg.data)}


def eval_tasks(policy: Policy, data: list[str]) -> str:
    """The eval step's task list: the policy's built-in tasks, then one custom:STEM task per --data file."""
    names = [t for t in policy.tasks if t != "custom"] + list(custom_tasks(data))
    return ",".join(names) or "code,summarization"


def data_inputs(data: list[str]) -> list[dict[str, str]]:
    """What the steps' reuse keys see of the files: a changed file reruns eval and bench."""
    return [{"path": str(p), "sha256": file_sha256(p)} for p in data]


def gate_policy(policy: Policy, evals: EvalResults | None, data: list[str]) -> Policy:
    """The policy with `custom` expanded to one section per workload file (and dropped without --data)."""
    tasks = {t: b for t, b in policy.tasks.items() if t != "custom"}
    for name in custom_tasks(data):
        summary = None if evals is None else evals.summary(name)
        tasks[name] = {m: b for m, b in policy.tasks["custom"].items()
                       if summary is None or m not in _NEEDS or summary.get(_NEEDS[m])}
    return policy.model_copy(update={"tasks": tasks})


def bench_workload(data: list[str], eval_path: Path) -> str | FileWorkload:
    """The ablation's traffic: the files' request mix, with the baseline's answer lengths from the eval step
    where it measured them (the rest are measured on the baseline server); the mixed built-in without --data."""
    if not data:
        return "mixed"
    workload = FileWorkload(tuple(str(p) for p in data))
    tasks = EvalResults.load(eval_path).tasks if eval_path.is_file() else {}
    for name, path in custom_tasks(data).items():
        for record in tasks[name].records.values() if name in tasks else ():
            baseline = AnswerSide.from_json(record["baseline"])
            workload.lengths[f"{Path(path).stem}/{record['id']}"] = max(baseline.tokens, 1)
    if workload.lengths:
        workload.sources["baseline greedy answers of the eval step"] = len(workload.lengths)
    return workload
