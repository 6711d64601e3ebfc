"""How a sign-off's steps run once per input hash (StepRunner, steps.json), each step's outcome a StepOutcome."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import OutputWriteError, QToolError
from ..io import lock_output, read_results_json, write_json
from ..progress import status
from ..provenance import code_identity, text_sha256

STEPS = ("quantize", "eval", "bench", "diagnose")


def load_output(path: Path) -> dict[str, Any] | None:
    """A step's JSON output as written, or None when the step wrote none."""
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class StepOutcome:
    """How a step ended: its entry in steps.json, and in report.json's `steps` without its reuse key."""

    status: str | None  # running | ok | error | skipped; None for a step the sign-off never reached
    key: str | None = None  # the hash of its inputs and code (StepRunner.key)
    output: str | None = None  # the file it wrote
    error: str | None = None
    traceback: str | None = None  # an unexpected exception's
    reason: str | None = None  # why a skipped step was not needed
    note: str | None = None  # a deployment sign-off's checkpoint entry: where its quantize report came from
    seconds: float | None = None
    reused: bool = False  # an earlier run's output, taken as it was (`"skipped": true` in the JSON)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def failed(cls, error: str) -> StepOutcome:
        """A step that could not run (no quantized checkpoint, never reached)."""
        return cls("error", error=error)

    def to_json(self, key: bool = True) -> dict[str, Any]:
        """The entry as steps.json holds it (`key` False: as report.json does, without the reuse key)."""
        fields = (("key", self.key if key else None), ("status", self.status), ("output", self.output),
                  ("error", self.error), ("traceback", self.traceback), ("reason", self.reason),
                  ("note", self.note), ("seconds", self.seconds), ("skipped", self.reused or None))
        return {name: value for name, value in fields if value is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepOutcome:
        return cls(d.get("status"), d.get("key"), d.get("output"), d.get("error"), d.get("traceback"),
                   d.get("reason"), d.get("note"), d.get("seconds"), bool(d.get("skipped")))


def recorded(folder: Path) -> dict[str, StepOutcome]:
    """The step outcomes steps.json in `folder` holds now (none when there is none)."""
    path = folder / "steps.json"
    return {n: StepOutcome.from_json(e) for n, e in read_results_json(path).items()} if path.is_file() else {}


class StepRunner:
    """Runs steps once per input hash; remembers outcomes in steps.json."""

    def __init__(self, folder: Path, *, replay: dict[str, StepOutcome] | None = None):
        self.folder = folder
        # replay: take up the outcomes another process recorded here, running nothing (a sweep's candidate
        # quantized and evaluated in a child process: signoff/apart.py); the dict is steps.json before that
        # process ran, so a step it reused is told from one it ran
        self.replay = replay
        self.path = folder / "steps.json"
        self.lock = lock_output(self.path)  # one sign-off at a time per folder: a second fails at once
        self.state: dict[str, StepOutcome] = recorded(folder)

    def _write(self) -> None:
        write_json(self.path, {n: o.to_json() for n, o in self.state.items()})

    @staticmethod
    def key(inputs: dict[str, Any]) -> str:
        """The step's inputs and the code that computes it (qtoolkit's source, the libraries' versions): a run
        folder made before a fix is never reused by the fixed code."""
        return text_sha256(json.dumps({**inputs, "_code": code_identity()}, sort_keys=True, default=str))

    def finished(self, name: str, inputs: dict[str, Any], output: Path) -> bool:
        """An earlier run with the same inputs finished the step and its output is there."""
        prev = self.state.get(name)
        return prev is not None and prev.key == self.key(inputs) and prev.ok and output.exists()

    def interrupted(self, name: str, inputs: dict[str, Any]) -> bool:
        """True when an earlier run of this step, with the same inputs, stopped midway (its partial output can
        be resumed rather than discarded)."""
        prev = self.state.get(name)
        return prev is not None and prev.key == self.key(inputs) and not prev.ok

    def skip(self, name: str, reason: str) -> StepOutcome:
        """Record that a step was not needed (a sweep does not benchmark a candidate a gate has already failed)."""
        self.state[name] = StepOutcome("skipped", reason=reason)
        self._write()
        status(f"{name}: skipped: {reason}")
        return self.state[name]

    def run(self, name: str, inputs: dict[str, Any], output: Path, fn: Callable[[], None]) -> StepOutcome:
        """Run `fn` unless an earlier run with the same inputs finished it. "ok" is recorded only after `fn` has
        returned, i.e. after its output was written in full (atomically), so a step killed at any point is
        never taken as finished."""
        key = self.key(inputs)
        prev = self.state.get(name)
        if prev is not None and self.finished(name, inputs, output):
            if self.replay is None:  # a replayed step has said what it did, in its own process
                status(f"{name}: up to date ({output.name}), skipped")
            return replace(prev, reused=self.replay is None or self.replay.get(name) == prev)
        if self.replay is not None:
            if prev is not None and prev.key == key and prev.status == "error":
                return prev
            return StepOutcome.failed(f"{name}: its process ended before the step finished; rerun the same "
                                      "command to resume it")
        status(f"{name}: running")
        self.state[name] = StepOutcome("running", key)
        self._write()
        t = time.perf_counter()
        try:
            fn()
            entry = StepOutcome("ok", key, output=output.name)
        except OutputWriteError:
            # no room for outputs: every later step would fail the same way. The step stays "running" in
            # steps.json (never ok), so the rerun after space is freed resumes it
            raise
        except QToolError as e:
            entry = StepOutcome("error", key, error=str(e))
        except Exception as e:  # a bug or a library failure: keep the report, mark the step
            entry = StepOutcome("error", key, error=f"{type(e).__name__}: {e}",
                                traceback=traceback.format_exc(limit=8))
        entry = replace(entry, seconds=round(time.perf_counter() - t, 1))
        self.state[name] = entry
        self._write()
        if not entry.ok:
            status(f"{name}: FAILED: {entry.error}")
        return entry
