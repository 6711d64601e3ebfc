"""The results file, written after every finished batch so a crash loses nothing finished and a rerun resumes.

Per task it holds the run key (model identities + task settings), one record per finished item, and the
summary recomputed from those records. A rerun with the same key skips finished items; a different key
for the same task is refused rather than mixed in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qtoolkit.errors import OutputExistsError
from qtoolkit.io import lock_output, read_results_json, write_json
from qtoolkit.provenance import provenance


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
