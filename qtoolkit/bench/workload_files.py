"""A workload file (evals/workload_file.py) as benchmark traffic: the file's own prompts, chat or completion.

Each request asks for its line's `max_tokens`; a line without one asks for the answer length measured on a
reference server (the baseline's greedy answer with EOS honoured, capped at --max-output-tokens), and is then
replayed with EOS ignored, so every system under test generates the same number of tokens for it. Lengths are
measured once per item and kept, so fresh rounds of the same file reuse them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import QToolError
from ..evals.workload_file import file_sha256, sample_items
from ..progress import status
from .load_client import run_load
from .types import BenchRequest, Workload
from .workloads import WORKLOADS, BuiltinWorkload

_MEASURE_CONCURRENCY = 8


@dataclass
class FileWorkload:
    paths: tuple[str, ...]
    lengths: dict[str, int] = field(default_factory=dict)  # measured answer tokens per item ("STEM/ID")
    measure: Callable[[list[BenchRequest]], list[int]] | None = field(default=None, repr=False)
    measured_on: str | None = None  # the server `measure` asks
    sources: dict[str, int] = field(default_factory=dict)  # where the lengths came from: items per source

    def __post_init__(self) -> None:
        for p in self.paths:  # validate every line before any server starts (a bad line exits 2)
            sample_items(p, 1)

    def __str__(self) -> str:
        return "file:" + ",".join(self.paths)

    def describe(self) -> dict[str, Any]:
        return {"files": [{"path": p, "sha256": file_sha256(p)} for p in self.paths],
                "answer_lengths": {"measured_items": len(self.lengths), "sources": dict(self.sources)}}

    def requests(self, n: int, *, seed: int, max_output_tokens: int,
                 mean_output_tokens: int = 64) -> list[BenchRequest]:
        """n requests drawn from the files' lines (each file sampled by a seeded hash of ids, then shuffled);
        `mean_output_tokens` plays no part: a line's length is its max_tokens or its measured answer."""
        lines = [(Path(p).stem, ln) for p in self.paths for ln in sample_items(p, n, seed=seed)]
        order = np.random.default_rng(seed).permutation(len(lines))
        out = []
        for i in range(n):
            stem, ln = lines[order[i % len(lines)]]
            key, it = f"{stem}/{ln.id}", ln.item
            messages = tuple(m.model_dump() for m in it.messages) if it.messages is not None else None
            prompt = it.prompt if messages is None else json.dumps(messages)
            out.append(BenchRequest(i, it.kind, prompt or "", it.max_tokens or self.lengths.get(key, 0),
                                    messages, key))
        return self._fill(out, max_output_tokens)

    def _fill(self, reqs: list[BenchRequest], cap: int) -> list[BenchRequest]:
        todo = list({r.item: replace(r, max_tokens=cap) for r in reqs if not r.max_tokens}.values())
        if todo:
            if self.measure is None:
                raise QToolError("workload lines without max_tokens need measured answer lengths: attach a "
                                 "reference server (attach_length_probe) before building requests")
            self.lengths.update(zip([r.item for r in todo], self.measure(todo), strict=True))
            self.sources[str(self.measured_on)] = self.sources.get(str(self.measured_on), 0) + len(todo)
        return [r if r.max_tokens else replace(r, max_tokens=self.lengths[r.item]) for r in reqs]

    def attach_length_probe(self, url: str, model: str, *, name: str, api_key: str | None = None) -> None:
        """Measure missing answer lengths on the server at `url` (greedy, EOS honoured)."""

        def measure(reqs: list[BenchRequest]) -> list[int]:
            status(f"measuring the answer length of {len(reqs)} workload lines on {name}")
            results, _ = asyncio.run(run_load(url, model, reqs, concurrency=min(_MEASURE_CONCURRENCY, len(reqs)),
                                              ignore_eos=False, api_key=api_key))
            bad = [r for r in results if not r.ok]
            if bad:
                item = {r.index: r.item for r in reqs}[bad[0].index]
                raise QToolError(f"{name} did not answer workload line {item} ({bad[0].error}): "
                                 "give the line a max_tokens or fix the server")
            return [max(r.output_tokens, 1) for r in results]

        self.measure, self.measured_on = measure, name


def parse_workload(spec: str) -> Workload:
    """A built-in workload name, or comma-separated workload files."""
    if spec in WORKLOADS:
        return BuiltinWorkload(spec)
    paths = tuple(p.strip() for p in spec.split(",") if p.strip())
    if not paths or not all(p.endswith(".jsonl") or Path(p).is_file() for p in paths):
        raise QToolError(f"--workload {spec!r}: use one of {', '.join(WORKLOADS)} or a workload file FILE.jsonl")
    return FileWorkload(paths)
