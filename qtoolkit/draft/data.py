"""Training and held-out text for a draft head, offline only: the Python standard library's source, ACLSum's
train split, and text the target writes itself (its greedy and sampled continuations of prompts built from
those two). The eval items (HumanEval problems, ACLSum test documents) are never read as training text, and
`check_clean` refuses a corpus that contains one.

Held out, for the acceptance the trainer reports: code = the target's greedy continuations of function stubs
from one stdlib file in ten (chosen by a hash of its path, never trained on); summarization = its greedy
continuations of ACLSum's validation split (`val`), never its test split.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from qtoolkit.evals.data import aclsum_items, humaneval_problems
from qtoolkit.evals.prompts import QUESTIONS, user_message
from qtoolkit.evals.summarization import chat_prompt

from ..errors import DataError

CODE, SUMMARIZATION = "code", "summarization"
KINDS = (CODE, SUMMARIZATION)
HELDOUT_ACLSUM_SPLIT, TRAIN_ACLSUM_SPLIT = "val", "train"  # ACLSum's test split is the eval's: never read here


@dataclass
class Sample:
    """One training or held-out sequence: positions before prompt_len are a prompt the target did not write."""

    kind: str  # CODE | SUMMARIZATION
    source: str  # "stdlib:PATH", "aclsum-train:ID", "self-greedy:...", "self-sampled:..."
    token_ids: list[int]
    prompt_len: int = 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str) -> list[Path]:
    """The stdlib's own .py files (no tests, no installed packages); one in ten is held out by path hash."""
    return list(_stdlib_files(split))


@cache
def _stdlib_files(split: str) -> tuple[Path, ...]:
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in ("site-packages", "dist-packages", "test", "tests", "idle_test") for p in rel.parts):
            continue
        heldout = int(hashlib.sha1(str(rel).encode()).hexdigest(), 16) % 10 == 0
        if heldout == (split == "heldout"):
            files.append(path)
    return tuple(files)


def read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def code_chunks(files: list[Path], tokenizer: Any, max_tokens: int, seq_len: int, seed: int = 0) -> list[Sample]:
    """Windows of seq_len tokens from the files (in a seeded order) until max_tokens are taken."""
    order = list(files)
    random.Random(seed).shuffle(order)
    out, taken = [], 0
    for path in order:
        text = read_source(path)
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for start in range(0, len(ids) - 16, seq_len):
            window = ids[start:start + seq_len]
            out.append(Sample(CODE, f"stdlib:{path.relative_to(stdlib_root())}", window))
            taken += len(window)
            if taken >= max_tokens:
                return out
    return out


def function_stubs(files: list[Path], n: int, seed: int = 0, max_chars: int = 1500) -> list[str]:
    """HumanEval-shaped prompts: a function's signature and docstring, the body left for the model."""
    stubs: list[str] = []
    order = list(files)
    random.Random(seed).shuffle(order)
    for path in order:
        text = read_source(path)
        try:
            tree = ast.parse(text or "")
        except (SyntaxError, ValueError):
            continue
        lines = (text or "").splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not ast.get_docstring(node):
                continue
            stub = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno])) + "\n"
            if len(stub) <= max_chars:
                stubs.append(stub)
            if len(stubs) >= n:
                return stubs
            break  # one stub per file: more files, more variety
    return stubs


def summary_prompts(split: str, tokenizer: Any) -> list[str]:
    """The prompts the evals and the bench send: the eval's chat question per aspect (the bench's summarization
    traffic is the same question, sent as plain completion text), for documents of `split`."""
    if split == "test":
        raise DataError("ACLSum's test split holds the eval's documents: a draft head never trains on it")
    prompts = []
    for doc in aclsum_items(split):
        prompts += [chat_prompt(tokenizer, doc["abstract"], aspect)[0] for aspect in QUESTIONS]
        prompts.append(user_message(doc["abstract"], "outcome"))
    return prompts


def aclsum_texts(tokenizer: Any) -> list[Sample]:
    """ACLSum train documents as plain text: title, abstract and the reference summaries."""
    out = []
    for doc in aclsum_items(TRAIN_ACLSUM_SPLIT):
        text = "\n\n".join([doc["title"], doc["abstract"], *doc["summaries"].values()])
        out.append(Sample(SUMMARIZATION, f"aclsum-train:{doc['id']}", tokenizer(text).input_ids))
    return out


def eval_texts() -> list[str]:
    """What must never be trained on: HumanEval prompts and ACLSum test abstracts."""
    return [p["prompt"].strip() for p in humaneval_problems()] + \
        [d["abstract"][:300] for d in aclsum_items("test")]


def check_clean(samples: list[Sample], tokenizer: Any) -> None:
    """Refuse a corpus in which an eval item appears (as decoded text)."""
    corpus = "\n".join(tokenizer.decode(s.token_ids) for s in samples)
    for text in eval_texts():
        if text and text in corpus:
            raise DataError(f"training text contains an eval item ({text[:60]!r}...): the draft head must not "
                            "train on HumanEval or ACLSum test documents")
