"""The `perplexity` task: teacher-forced token-level comparison on each task's text, no generation.

Two text sets, reported separately because quantization error differs by domain: `code` (HumanEval prompt +
canonical solution) and `summarization` (ACLSum abstract followed by its three reference summaries, plain
text). Per set: PPL ratio, KL divergence statistics, Δp of the correct token and same-top-1 rate, each with
the token-level ± llama.cpp reports and an item-bootstrap CI.
"""

from __future__ import annotations

from typing import Any

from .backends.base import Backend
from .data import ASPECTS, aclsum_items, humaneval_problems
from .stats.kld import llama_cpp_stats
from .stats.paired import NOMINAL, Level, paired_delta, token_stats
from .task import compare_scored, scored_records

TEXT_SETS = ("code", "summarization")


def code_texts() -> list[tuple[str, str]]:
    return [(p["task_id"], p["prompt"] + p["canonical_solution"]) for p in humaneval_problems()]


def summarization_texts(split: str = "test") -> list[tuple[str, str]]:
    return [(d["id"], "\n\n".join([d["abstract"], *(d["summaries"][a] for a in ASPECTS)]))
            for d in aclsum_items(split)]


class PerplexityTask:
    name = "perplexity"
    default_limit = 40  # per text set
    batch_size = 8

    def __init__(self, max_length: int = 1024, **_: Any):
        self.max_length = max_length

    def settings(self) -> dict[str, Any]:
        return {"text_sets": list(TEXT_SETS), "max_length": self.max_length}

    def items(self, limit: int) -> list[dict[str, Any]]:
        out = []
        for text_set, texts in (("code", code_texts()), ("summarization", summarization_texts())):
            out += [{"id": f"{text_set}/{i}", "text_set": text_set, "text": t} for i, t in texts[:limit]]
        return out

    def run_batch(self, items: list[dict[str, Any]], candidate: Backend, baseline: Backend) -> list[dict]:
        tok = candidate.tokenizer
        seqs = [tok(it["text"]).input_ids[: self.max_length] for it in items]
        records = compare_scored(candidate, baseline, seqs, [0] * len(seqs))
        return [{"id": it["id"], "text_set": it["text_set"], "token_record": r} for it, r in zip(items, records, strict=True)]

    def summarize(self, records: list[dict[str, Any]], *, seed: int, level: Level = NOMINAL) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, text_set in enumerate(TEXT_SETS):
            recs, unsupported = scored_records([r for r in records if r["text_set"] == text_set])
            if unsupported:
                out[text_set] = {"not_computed": [f"all perplexity statistics: {why}" for why in unsupported]}
            if not recs:
                continue
            stats = token_stats(recs, seed=seed + 100 * i, level=level)
            stats["llama_cpp"] = llama_cpp_stats(recs)  # the same tokens in llama-perplexity's names and set
            stats["mean_nll"] = paired_delta(
                [sum(r["nll_candidate"]) / r["tokens"] for r in recs], [sum(r["nll_baseline"]) / r["tokens"] for r in recs],
                [r["tokens"] for r in recs], seed=seed + 100 * i + 50, level=level)
            out[text_set] = stats
        return out
