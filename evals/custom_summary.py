"""Summary of a `custom:NAME` task from its per-item records: paired deltas with CIs, and the worst items.

A metric appears only where the file gives what it needs: `rougeL` over the lines with a `reference`, `pass@1`
over the lines with `tests`; KLD / NLL / same-top-1, greedy agreement and the answer-length change always (the
token statistics are listed under `not_computed` where a backend cannot score, e.g. an endpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .stats.paired import NOMINAL, Level, bootstrap_ci, paired_delta, token_stats
from .task import scored_records

WORST_ITEMS = 10


def _mean_kld(record: dict[str, Any]) -> float | None:
    kld = (record.get("token_record") or {}).get("kld")
    return float(np.mean(kld)) if kld else None


@dataclass(frozen=True)
class AnswerSide:
    """One side's answer in a custom item's record (`candidate` / `baseline`): the text, its length in the answer's
    own tokens, and its ROUGE-L / test result where the line has a reference / tests."""

    completion: str
    tokens: int
    rougeL: float | None = None
    passed: bool | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AnswerSide:
        """A record's side; only `tokens` is required (the bench replays the answers' lengths, not their text)."""
        return cls(d.get("completion", ""), int(d["tokens"]), d.get("rougeL"), d.get("passed"))


@dataclass(frozen=True)
class ItemRegression:
    """What changed on one item, from the candidate's side (positive = worse than the baseline): a summary's
    `worst_items` entry."""

    id: str
    line: int
    kind: str
    prompt: str
    pass_lost: bool | None  # None: the line has no tests
    passed: tuple[bool | None, bool | None] | None  # (candidate, baseline); None: no tests
    rougeL_drop: float | None
    kld_mean: float | None
    nll_delta: float | None
    agree: bool
    tokens: tuple[int, int]  # (candidate, baseline)
    candidate: str  # the answers' first 200 characters
    baseline: str

    def to_json(self) -> dict[str, Any]:
        passed = None if self.passed is None else {"candidate": self.passed[0], "baseline": self.passed[1]}
        return {"id": self.id, "line": self.line, "kind": self.kind, "prompt": self.prompt,
                "pass_lost": self.pass_lost, "passed": passed, "rougeL_drop": self.rougeL_drop,
                "kld_mean": self.kld_mean, "nll_delta": self.nll_delta, "agree": self.agree,
                "tokens": {"candidate": self.tokens[0], "baseline": self.tokens[1]},
                "candidate": self.candidate, "baseline": self.baseline}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ItemRegression:
        p = d.get("passed")
        return cls(d["id"], d["line"], d["kind"], d["prompt"], d.get("pass_lost"),
                   None if p is None else (p["candidate"], p["baseline"]), d.get("rougeL_drop"), d.get("kld_mean"),
                   d.get("nll_delta"), bool(d.get("agree")), (d["tokens"]["candidate"], d["tokens"]["baseline"]),
                   d["candidate"], d["baseline"])


def item_regression(r: dict[str, Any]) -> ItemRegression:
    """What changed on one item's record."""
    c, b = AnswerSide.from_json(r["candidate"]), AnswerSide.from_json(r["baseline"])
    nll = (None if r["nll_answer_candidate"] is None
           else r["nll_answer_candidate"] - r["nll_answer_baseline"])
    return ItemRegression(r["id"], r["line"], r["kind"], r["prompt"],
                          bool(b.passed) and not c.passed if r["has_tests"] else None,
                          (c.passed, b.passed) if r["has_tests"] else None,
                          b.rougeL - c.rougeL if r["has_reference"] and b.rougeL is not None and c.rougeL is not None
                          else None,
                          _mean_kld(r), nll, r["agree_exact"], (c.tokens, b.tokens), c.completion[:200],
                          b.completion[:200])


def worst_items(records: list[dict[str, Any]], n: int = WORST_ITEMS) -> list[ItemRegression]:
    """Items whose answer changed, worst first: a lost test pass, then the ROUGE-L drop, then the mean KLD
    (NLL increase where KLD cannot be computed)."""
    regs = [item_regression(r) for r in records]
    changed = [x for x in regs if not x.agree or x.pass_lost or (x.rougeL_drop or 0) > 0]

    def key(x: ItemRegression) -> tuple[float, float, float]:
        drift = x.kld_mean if x.kld_mean is not None else (x.nll_delta or 0.0)
        return (float(bool(x.pass_lost)), x.rougeL_drop or 0.0, drift)

    return sorted(changed, key=key, reverse=True)[:n]


def summarize_custom(records: list[dict[str, Any]], *, seed: int, level: Level = NOMINAL) -> dict[str, Any]:
    token_records, unsupported = scored_records(records)
    scored = [r for r in records if r["nll_answer_candidate"] is not None]
    agree = [float(r["agree_exact"]) for r in records]
    out: dict[str, Any] = {
        "items": len(records),
        "items_with_reference": sum(r["has_reference"] for r in records),
        "items_with_tests": sum(r["has_tests"] for r in records),
        "nll_answer": paired_delta([r["nll_answer_candidate"] for r in scored],
                                   [r["nll_answer_baseline"] for r in scored],
                                   [r["answer_tokens"] for r in scored], seed=seed + 10, level=level),
        "greedy_agreement": {"rate": sum(agree) / max(len(agree), 1), "ci95": bootstrap_ci(agree, seed=seed + 1, level=level),
                             "items": len(agree)},
        "answer_tokens": paired_delta([r["candidate"]["tokens"] for r in records],
                                      [r["baseline"]["tokens"] for r in records], seed=seed + 2, level=level),
        "text_stats": token_stats(token_records, seed=seed + 20, level=level),
        "not_computed": [f"nll_answer, text_stats: {why}" for why in unsupported],
    }
    with_ref = [r for r in records if r["has_reference"]]
    if with_ref:
        out["rougeL"] = paired_delta([r["candidate"]["rougeL"] for r in with_ref],
                                     [r["baseline"]["rougeL"] for r in with_ref], seed=seed + 3, level=level)
    with_tests = [r for r in records if r["has_tests"]]
    if with_tests:
        out["pass@1"] = paired_delta([float(r["candidate"]["passed"]) for r in with_tests],
                                     [float(r["baseline"]["passed"]) for r in with_tests], seed=seed + 4, level=level)
    out["worst_items"] = [x.to_json() for x in worst_items(records)]
    return out
