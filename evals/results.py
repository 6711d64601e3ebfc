"""The results file, written after every finished batch so a crash loses nothing finished and a rerun resumes.

Per task it holds the run key (model identities + task settings), one record per finished item, and the
summary recomputed from those records. A rerun with the same key skips finished items; a different key
for the same task is refused rather than mixed in. `ResultsFile` writes it; `EvalResults.load` reads it back
as typed task results for the sign-off, the report and `qtool plot`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtoolkit.errors import DataError, OutputExistsError
from qtoolkit.io import lock_output, read_results_json, write_json
from qtoolkit.provenance import provenance

from .summary import TaskSummary


@dataclass
class TaskResult:
    """One task of eval.json: its finished item records by id and, once the task finished, its summary."""

    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    summary: TaskSummary | None = None  # None until every item of the task is scored
    items: int | None = None

    @classmethod
    def from_json(cls, node: dict[str, Any]) -> TaskResult:
        summary = node.get("summary")
        return cls(dict(node.get("records") or {}), None if summary is None else TaskSummary.from_json(summary),
                   node.get("items"))

    def token_klds(self) -> dict[str, list[float]]:
        """Per-token KLD values of the finished items, by text set (the task's own name when it has none)."""
        out: dict[str, list[float]] = {}
        for rec in self.records.values():
            values = (rec.get("token_record") or {}).get("kld", [])
            out.setdefault(rec.get("text_set", ""), []).extend(values)
        return out


@dataclass
class EvalResults:
    """eval.json as the sign-off reads it: each task's result, and the models that were compared."""

    tasks: dict[str, TaskResult]
    models: dict[str, Any] | None = None  # candidate and baseline as their backends describe themselves

    @classmethod
    def from_json(cls, data: Any) -> EvalResults:
        tasks = data.get("tasks") if isinstance(data, dict) else None
        if not isinstance(tasks, dict) or not all(isinstance(node, dict) for node in tasks.values()):
            raise DataError("not a qtool eval result (it needs `tasks` by name): pass the JSON that qtool eval wrote")
        return cls({name: TaskResult.from_json(node) for name, node in tasks.items()}, data.get("models"))

    @classmethod
    def load(cls, path: str | Path) -> EvalResults:
        """Read an eval.json; a missing, corrupt or foreign file is a one-line error that names it."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DataError(f"{path} not found: pass the JSON that qtool eval wrote") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{path} is not a qtool eval result ({str(e).splitlines()[0]}): run qtool eval "
                            "again, or pass the JSON it wrote") from None
        try:
            return cls.from_json(data)
        except DataError as e:
            raise DataError(f"{path} is {e}") from None

    def summary(self, task: str) -> TaskSummary | None:
        """The task's summary, or None when the task did not run or has not finished."""
        result = self.tasks.get(task)
        return None if result is None else result.summary


class ResultsFile:
    def __init__(self, path: str | Path, *, overwrite: bool = False, inputs: dict[str, Any] | None = None):
        self.path = Path(path)
        self.lock = lock_output(self.path)  # held while this run writes: a second run fails at once
        self.data: dict[str, Any] = {}
        if self.path.exists() and not overwrite:
            self.data = read_results_json(self.path)
        self.data.update(provenance(**(inputs or {})))
        self.data.setdefault("tasks", {})

    def begin(self, task: str, key: dict[str, Any]) -> dict[str, dict]:
        """Start (or resume) a task; returns its finished records by item id."""
        key = json.loads(json.dumps(key, default=str))  # compare as it will be stored
        entry = self.data["tasks"].get(task)
        if entry is not None and entry.get("key") != key:
            raise OutputExistsError(
                f"{self.path} already holds '{task}' results for other models or settings: choose another "
                "--output or pass --overwrite")
        if entry is None:
            entry = self.data["tasks"][task] = {"key": key, "records": {}}
        return entry["records"]

    def add(self, task: str, records: list[dict[str, Any]]) -> None:
        self.data["tasks"][task]["records"].update({r["id"]: r for r in records})
        self.save()

    def finish(self, task: str, summary: dict[str, Any], item_ids: list[str]) -> None:
        entry = self.data["tasks"][task]
        entry["summary"] = summary
        entry["items"] = len(item_ids)
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)
