"""Summary of a `custom:NAME` task from its per-item records: paired deltas with CIs, and the worst items.

A metric appears only where the file gives what it needs: `rougeL` over the lines with a `reference`, `pass@1`
over the lines with `tests`; KLD / NLL / same-top-1, greedy agreement and the answer-length change always (the
token statistics are listed under `not_computed` where a backend cannot score, e.g. an endpoint).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .stats.paired import NOMINAL, Level, bootstrap_ci, paired_delta, token_stats
from .task import scored_records

WORST_ITEMS = 10


def _mean_kld(record: dict[str, Any]) -> float | None:
    kld = (record.get("token_record") or {}).get("kld")
    return float(np.mean(kld)) if kld else None


def item_regression(r: dict[str, Any]) -> dict[str, Any]:
    """What changed on one item, from the candidate's side (positive = worse than the baseline)."""
    c, b = r["candidate"], r["baseline"]
    nll = (None if r["nll_answer_candidate"] is None
           else r["nll_answer_candidate"] - r["nll_answer_baseline"])
    return {"id": r["id"], "line": r["line"], "kind": r["kind"], "prompt": r["prompt"],
            "pass_lost": bool(b.get("passed")) and not c.get("passed") if r["has_tests"] else None,
            "passed": {"candidate": c.get("passed"), "baseline": b.get("passed")} if r["has_tests"] else None,
            "rougeL_drop": b["rougeL"] - c["rougeL"] if r["has_reference"] else None,
            "kld_mean": _mean_kld(r), "nll_delta": nll, "agree": r["agree_exact"],
            "tokens": {"candidate": c["tokens"], "baseline": b["tokens"]},
            "candidate": c["completion"][:200], "baseline": b["completion"][:200]}


def worst_items(records: list[dict[str, Any]], n: int = WORST_ITEMS) -> list[dict[str, Any]]:
    """Items whose answer changed, worst first: a lost test pass, then the ROUGE-L drop, then the mean KLD
    (NLL increase where KLD cannot be computed)."""
    regs = [item_regression(r) for r in records]
    changed = [x for x in regs if not x["agree"] or x["pass_lost"] or (x["rougeL_drop"] or 0) > 0]

    def key(x: dict[str, Any]) -> tuple[float, float, float]:
        drift = x["kld_mean"] if x["kld_mean"] is not None else (x["nll_delta"] or 0.0)
        return (float(bool(x["pass_lost"])), x["rougeL_drop"] or 0.0, drift)

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
    out["worst_items"] = worst_items(records)
    return out
