"""The workload file: a user's own requests, one JSON object per line (JSONL), read as a stream.

Each line is either a completion request (`prompt`) or a chat request (`messages`, rendered with the model's chat
template), with optional `id`, `reference` (text the answer is compared against with ROUGE-L), `tests` (Python
that checks the answer in the code sandbox, see evals/custom.py for how the answer is passed), `max_tokens` and
`stop`. Every line is validated by a pydantic model; the first bad one stops the run with one line naming the
file, the line and the field. Files are never loaded whole: `sample_items` keeps at most `limit` items while it
streams, so a 10,000-line file costs the memory of the items kept.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qtoolkit.errors import DataError

MAX_STOP = 4  # what the OpenAI API accepts, so the same file works through --endpoint


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class WorkloadItem(BaseModel):
    """One request of the workload file."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[Message] | None = Field(default=None, min_length=1)
    reference: str | None = Field(default=None, min_length=1)
    tests: str | None = Field(default=None, min_length=1)
    max_tokens: int | None = Field(default=None, gt=0, le=4096)
    stop: list[str] | None = Field(default=None, max_length=MAX_STOP)

    @field_validator("id", mode="before")
    @classmethod
    def _id_text(cls, v: object) -> object:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _one_kind(self) -> WorkloadItem:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (completion) or `messages` (chat)")
        if self.messages is not None and self.messages[-1].role == "assistant":
            raise ValueError("the last message is the model's turn to answer: end `messages` with a user turn")
        return self

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "completion"


@dataclass(frozen=True)
class Line:
    """A validated item and where it came from (ids default to `line-N`)."""

    number: int
    id: str
    item: WorkloadItem


def task_name(path: str | Path) -> str:
    return f"custom:{Path(path).stem}"


def _error(path: Path, n: int, e: ValidationError) -> DataError:
    err = e.errors()[0]
    field = ".".join(str(x) for x in err["loc"]) or "line"
    msg = err["msg"].removeprefix("Value error, ")
    return DataError(f"{path}:{n}: {field}: {msg}: fix this line (see evals/tasks/example-workload.jsonl)")


def iter_lines(path: str | Path) -> Iterator[Line]:
    """Validated items in file order; blank lines are skipped; raises DataError at the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"workload file {path} not found: pass a JSONL file (one request per line)")
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        n = 0
        try:
            for n, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    raw = json.loads(text)
                except ValueError as e:
                    raise DataError(f"{path}:{n}: line: not JSON ({e.msg}): write one JSON object per line") from None
                if not isinstance(raw, dict):
                    raise DataError(f"{path}:{n}: line: expected a JSON object, got {type(raw).__name__}: "
                                    "write one object per line")
                try:
                    item = WorkloadItem.model_validate(raw)
                except ValidationError as e:
                    raise _error(path, n, e) from None
                item_id = item.id if item.id is not None else f"line-{n}"
                if item_id in seen:
                    raise DataError(f"{path}:{n}: id: {item_id!r} repeats line {seen[item_id]}: give every line "
                                    "its own id")
                seen[item_id] = n
                yield Line(n, item_id, item)
        except UnicodeDecodeError:
            raise DataError(f"{path}:{n + 1}: line: not UTF-8 text: save the file as UTF-8") from None
    if not seen:
        raise DataError(f"workload file {path} holds no requests: write one JSON object per line")


def _rank(seed: int, item_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{item_id}".encode(), digest_size=8).digest(), "big")


def sample_items(path: str | Path, limit: int | None, *, seed: int = 0) -> list[Line]:
    """All items, or `limit` of them chosen by a seeded hash of their id (bottom-k), back in file order.

    The choice depends only on the ids and the seed, not on the file's order or length, and a larger limit keeps
    every item of a smaller one, so a rerun with a raised --limit resumes the items it already has.
    """
    if limit is None:
        return list(iter_lines(path))
    heap: list[tuple[int, int, Line]] = []  # (-rank, line, item): the largest kept rank is on top
    for line in iter_lines(path):
        entry = (-_rank(seed, line.id), line.number, line)
        if len(heap) < limit:
            heapq.heappush(heap, entry)
        elif entry > heap[0]:
            heapq.heapreplace(heap, entry)
    return sorted((e[2] for e in heap), key=lambda x: x.number)


def any_tests(path: str | Path) -> bool:
    """Whether some line carries `tests` (model-written code will run): one streamed, validating pass."""
    return any(line.item.tests is not None for line in iter_lines(path))


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def render_prompt(tokenizer, item: WorkloadItem) -> str:
    """The text a model is given: the prompt as is, or the messages through the model's chat template."""
    if item.messages is None:
        return item.prompt or ""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("a chat line (`messages`) needs a model with a chat template: this tokenizer has none; "
                        "use `prompt` lines for a base model")
    return tokenizer.apply_chat_template([m.model_dump() for m in item.messages], tokenize=False,
                                         add_generation_prompt=True)
