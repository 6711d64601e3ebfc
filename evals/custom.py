"""The `custom:NAME` task: a user's own workload file (evals/workload_file.py), candidate against baseline.

Per item both models answer greedily (each line's `max_tokens` and `stop`, else the task's). Then:
- the candidate is teacher-forced on the baseline's own answer (its generated tokens after the prompt): KLD,
  NLL and same-top-1 of the tokens the baseline would have sent (`text_stats`, `nll_answer`);
- greedy agreement (the two answers are equal) and the change in answer length (`answer_tokens`);
- ROUGE-L F1 of each answer against `reference`, on the lines that have one (`rougeL`);
- pass@1 of each answer under `tests`, on the lines that have them (`pass@1`).

How `tests` see the answer (HumanEval style): the sandbox runs one program per answer,

    completion = '<the answer, as a Python string>'
    <code>
    <tests>

where <code> is prompt + answer for a `prompt` line (the prompt is the start of the program) and, for a
`messages` line, the first fenced ```python block of the answer (to the answer's end when the fence is not
closed; the whole answer when there is no fence). The answer passes when the program exits 0 (an assert that
fails, an exception, a timeout: it fails).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from rouge_score import rouge_scorer

from qtoolkit.errors import DataError

from .backends.base import Backend, GenParams
from .code import run_checked
from .custom_summary import summarize_custom
from .sandbox.run import Limits, require
from .stats.paired import NOMINAL, Level
from .task import TaskError, paired_scores, side_scores
from .workload_file import WorkloadItem, any_tests, file_sha256, render_prompt, sample_items, task_name

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)
_PREVIEW = 80


def answer_code(item: WorkloadItem, answer: str) -> str:
    if item.messages is None:
        return (item.prompt or "") + answer
    m = _FENCE.search(answer)
    return m.group(1) if m else answer


def checking_program(item: WorkloadItem, answer: str) -> list[str]:
    """The program that checks one answer (see the module docstring), as parts run in one namespace: the answer
    cannot swallow the tests (an unclosed string stays a syntax error of its own part)."""
    return [f"completion = {answer!r}\n", f"{answer_code(item, answer)}\n", f"{item.tests}\n"]


def preview(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _PREVIEW else flat[:_PREVIEW - 1] + "…"


class CustomTask:
    default_limit = 100
    batch_size = 8

    def __init__(self, path: str | Path, max_tokens: int = 128, seed: int = 0, timeout_s: float = 10.0,
                 allow_weak_sandbox: bool = False, **_: Any):
        self.path = Path(path)
        self.name = task_name(self.path)
        self.max_tokens, self.seed = max_tokens, seed
        self.limits = Limits(wall_s=timeout_s, cpu_s=max(1, int(timeout_s)))
        self.scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
        self.sha256 = file_sha256(self.path)
        # fail closed before any model loads when a line carries tests (the file is scanned once, streamed)
        self.isolation = require(allow_weak_sandbox) if any_tests(self.path) else None

    def settings(self) -> dict[str, Any]:
        return {"data": str(self.path), "data_sha256": self.sha256, "max_tokens": self.max_tokens,
                "seed": self.seed, "sampling": "bottom-k of blake2b(seed:id) when --limit < lines"}

    def items(self, limit: int) -> list[dict[str, Any]]:
        return [{"id": ln.id, "line": ln.number, "item": ln.item}
                for ln in sample_items(self.path, limit, seed=self.seed)]

    def _generate(self, backend: Backend, prompts: list[str], items: list[WorkloadItem]) -> list[Any]:
        """Greedy answers, one engine call per distinct (max_tokens, stop) so each line keeps its own budget."""
        groups: dict[tuple[int, tuple[str, ...]], list[int]] = defaultdict(list)
        for i, it in enumerate(items):
            groups[(it.max_tokens or self.max_tokens, tuple(it.stop or ()))].append(i)
        out: list[Any] = [None] * len(items)
        for (max_tokens, stop), idx in groups.items():
            gens = backend.generate([prompts[i] for i in idx], GenParams(max_tokens, 0.0, list(stop), self.seed))
            for i, g in zip(idx, gens, strict=True):
                out[i] = g
        return out

    @staticmethod
    def answer_ids(tok, item: WorkloadItem, gen: Any) -> list[int]:
        """The answer's own tokens; re-tokenized text where a stop string cut it (tokens past the cut)."""
        return list(gen.token_ids) if not item.stop else tok(gen.text, add_special_tokens=False).input_ids

    def _side(self, tok, item: WorkloadItem, gen: Any) -> dict[str, Any]:
        side: dict[str, Any] = {"completion": gen.text, "tokens": len(self.answer_ids(tok, item, gen)),
                                "finish_reason": gen.finish_reason}
        if item.reference is not None:
            side["rougeL"] = self.scorer.score(item.reference, gen.text.strip())["rougeL"].fmeasure
        if item.tests is not None:
            side.update(run_checked(checking_program(item, gen.text), self.limits, self.isolation))
        return side

    def run_batch(self, batch: list[dict[str, Any]], candidate: Backend, baseline: Backend) -> list[dict]:
        tok = candidate.tokenizer
        items: list[WorkloadItem] = [b["item"] for b in batch]
        prompts = [render_prompt(tok, it) for it in items]
        # the scored answers follow the baseline's generation, so the baseline side runs first; each side's
        # generation and scores before the other's: one model loaded at a time (task.side_scores)
        base = self._generate(baseline, prompts, items)
        sequences, starts = [], []
        for it, prompt, b in zip(items, prompts, base, strict=True):
            head = tok(prompt, add_special_tokens=it.messages is None).input_ids
            sequences.append(head + self.answer_ids(tok, it, b))
            starts.append(len(head))
        sb = side_scores(baseline, sequences)
        cand = self._generate(candidate, prompts, items)
        texts = paired_scores(sb if isinstance(sb, str) else side_scores(candidate, sequences), sb, starts)
        records = []
        for row, it, c, b, t, seq, start in zip(batch, items, cand, base, texts, sequences, starts, strict=True):
            n = len(seq) - start
            scored = "unsupported" not in t and n > 0
            records.append({
                "id": row["id"], "line": row["line"], "kind": it.kind,
                "prompt": preview(it.prompt if it.messages is None else it.messages[-1].content),
                "has_reference": it.reference is not None, "has_tests": it.tests is not None,
                "candidate": self._side(tok, it, c), "baseline": self._side(tok, it, b),
                "agree_exact": c.text.rstrip() == b.text.rstrip(), "answer_tokens": n,
                "nll_answer_candidate": sum(t["nll_candidate"]) / n if scored else None,
                "nll_answer_baseline": sum(t["nll_baseline"]) / n if scored else None,
                "token_record": t,
            })
        return records

    def summarize(self, records: list[dict[str, Any]], *, seed: int, level: Level = NOMINAL) -> dict[str, Any]:
        return summarize_custom(records, seed=seed, level=level)


def make_custom_task(name: str, custom_data: dict[str, str] | None = None, **options: Any) -> CustomTask:
    """The task of one workload file; `custom_data` maps task names (custom:STEM) to files."""
    if name == "custom" or name not in (custom_data or {}):
        raise TaskError(f"task {name!r} needs its workload file: pass --data FILE.jsonl (task custom:FILE-STEM)")
    return CustomTask((custom_data or {})[name], **options)


def custom_tasks(paths: list[str]) -> dict[str, str]:
    """Task name per workload file (custom:STEM); two files with one stem would write one task's results."""
    out: dict[str, str] = {}
    for p in paths:
        name = task_name(p)
        if name in out:
            raise DataError(f"--data {p} and {out[name]} share the name {name}: rename one of the files")
        out[name] = p
    return out


def expand_task_spec(spec: str, paths: list[str]) -> str:
    """`custom` in a task list becomes one custom:STEM task per --data file."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if paths and "custom" not in names and not any(n.startswith("custom:") for n in names):
        raise DataError("--data gives a workload file: add `custom` to --task (e.g. --task custom)")
    if "custom" in names and not paths:
        raise DataError("--task custom needs a workload file: pass --data FILE.jsonl (one task per file)")
    out: list[str] = []
    for n in names:
        out += list(custom_tasks(paths)) if n == "custom" else [n]
    return ",".join(out)
