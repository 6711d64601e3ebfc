"""The baseline's generations, kept on disk so a sweep over several candidates generates them once.

A multi-recipe sign-off compares every candidate with the same unquantized baseline on the same items. Decoding
is the expensive part of an eval item (one forward per token), so the baseline's completions are stored by what
determines them (the baseline's identity, the prompt and the generation parameters) and every later candidate,
and every later look, reads them back: the candidates are then paired with one and the same baseline draw.
Scoring (teacher-forced log-probs for KLD and NLL) is not kept: a full next-token distribution is ~200 KB a
token, and one forward over a known sequence costs about what a single decoded token does.

The file is append-only JSON lines; a line torn by a crash is skipped on reading, so a killed run loses at most
the batch it was writing.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from qtoolkit.provenance import text_sha256

from .base import Backend, GeneratedText, GenParams, Scored


class CachedGenerations:
    """A Backend whose generate() answers from `path` where it can and asks `inner` for the rest."""

    def __init__(self, inner: Backend, path: str | Path, identity: dict[str, Any]):
        self.inner = inner
        self.path = Path(path)
        self.identity = json.dumps(identity, sort_keys=True, default=str)
        self.hits = 0
        self.misses = 0
        self.cache = self._read()

    # the Backend protocol's attributes are the inner backend's
    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def full_distributions(self) -> bool:
        return self.inner.full_distributions

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "generations_cache": {"path": str(self.path), "hits": self.hits,
                                                               "misses": self.misses}}

    def score(self, token_ids: list[list[int]]) -> list[Scored]:
        return self.inner.score(token_ids)

    def key(self, prompt: str, params: GenParams) -> str:
        return text_sha256(json.dumps([self.identity, prompt, asdict(params)], sort_keys=True))

    def generate(self, prompts: list[str], params: GenParams) -> list[GeneratedText]:
        keys = [self.key(p, params) for p in prompts]
        todo = [i for i, k in enumerate(keys) if k not in self.cache]
        self.hits += len(prompts) - len(todo)
        self.misses += len(todo)
        if todo:
            fresh = self.inner.generate([prompts[i] for i in todo], params)
            self._append({keys[i]: g for i, g in zip(todo, fresh, strict=True)})
        return [self.cache[k] for k in keys]

    def _read(self) -> dict[str, GeneratedText]:
        out: dict[str, GeneratedText] = {}
        if not self.path.is_file():
            return out
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
                out[row["key"]] = GeneratedText(row["text"], list(row["token_ids"]), row["finish_reason"])
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a crash: that completion is generated again
        return out

    def _append(self, rows: dict[str, GeneratedText]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for key, g in rows.items():
                f.write(json.dumps({"key": key, **asdict(g)}) + "\n")
        self.cache.update(rows)
