"""What every task is, and the teacher-forced comparison shared by all tasks (evals/registry.py builds them).

A task is a list of items (each with a stable `id`) and a function that turns a batch of items into one
JSON record per item, given a candidate and a baseline backend. Records are all that is kept: the summary
is recomputed from them, so a resumed run and an uninterrupted one report the same numbers.
"""

from __future__ import annotations

from typing import Any, Protocol

from qtoolkit.errors import QToolError

from .backends.base import Backend, Scored, ScoringUnsupported
from .stats.paired import NOMINAL, Level, token_item_record


class TaskError(QToolError):
    """Unknown task name or task options that cannot work."""


class Task(Protocol):
    name: str
    default_limit: int
    batch_size: int

    def items(self, limit: int) -> list[dict[str, Any]]: ...

    def run_batch(self, items: list[dict[str, Any]], candidate: Backend, baseline: Backend) -> list[dict]: ...

    def summarize(self, records: list[dict[str, Any]], *, seed: int, level: Level = NOMINAL) -> dict[str, Any]: ...

    def settings(self) -> dict[str, Any]: ...


def check_same_vocabulary(candidate: Backend, baseline: Backend) -> None:
    """Token-level comparisons need one tokenization for both models."""
    if candidate.tokenizer.get_vocab() != baseline.tokenizer.get_vocab():
        raise TaskError("candidate and baseline use different tokenizers: token-level comparison needs "
                        "the same vocabulary (compare a quantized model with its own baseline)")


def side_scores(backend: Backend, sequences: list[list[int]]) -> list[Scored] | str:
    """One side's teacher-forced scores of `sequences`, or why the backend cannot score at all. A task asks each
    side for everything it needs (generation and scores) before asking the other, so an eval with two
    in-process models loads each once a batch (evals/backends/on_demand.py)."""
    try:
        return backend.score(sequences)
    except ScoringUnsupported as e:
        return str(e)


def paired_scores(sc: list[Scored] | str, sb: list[Scored] | str, starts: list[int]) -> list[dict[str, Any]]:
    """Teacher-forced per-token comparison of the two sides' scores, from token `starts[i]` on (0 = whole text).

    Returns one token record per sequence (see stats.token_item_record) covering the predictions of
    tokens starts[i]..T-1, or `{"unsupported": reason}` records when a backend cannot score at all.
    """
    if isinstance(sc, str) or isinstance(sb, str):
        return [{"unsupported": sc if isinstance(sc, str) else sb} for _ in starts]
    out = []
    for c, b, start in zip(sc, sb, starts, strict=True):
        lo = max(start - 1, 0)  # row i of a Scored predicts token i+1
        out.append(token_item_record(
            c.target[lo:], b.target[lo:],
            None if c.logprobs is None else c.logprobs[lo:], None if b.logprobs is None else b.logprobs[lo:],
            None if c.top1 is None else c.top1[lo:], None if b.top1 is None else b.top1[lo:]))
    return out


def compare_scored(candidate: Backend, baseline: Backend, sequences: list[list[int]],
                   starts: list[int]) -> list[dict[str, Any]]:
    """Both sides' scores of `sequences` compared (paired_scores): the candidate scored first."""
    sc = side_scores(candidate, sequences)
    return paired_scores(sc, sc if isinstance(sc, str) else side_scores(baseline, sequences), starts)


def join_tokens(tokenizer, head: str, tail: str, *, special: bool = True) -> tuple[list[int], int]:
    """Token ids of head+tail with an exact boundary: (ids, index of tail's first token)."""
    h = tokenizer(head, add_special_tokens=special).input_ids
    t = tokenizer(tail, add_special_tokens=False).input_ids
    return h + t, len(h)


def scored_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The items' token records that could be scored, and why the others could not."""
    ok = [r["token_record"] for r in records if "unsupported" not in r["token_record"]]
    reasons = sorted({r["token_record"]["unsupported"] for r in records if "unsupported" in r["token_record"]})
    return ok, reasons
