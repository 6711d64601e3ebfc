"""`--baseline` with `--harness lm-eval`: both models on the same documents, per-document metrics paired.

lm-eval's `log_samples` output holds each document's metric values (`acc`, `acc_norm`, `exact_match`, ...). Pairing
them by `doc_id` gives the same paired bootstrap CI as qtoolkit's own tasks (stats.paired_delta). Metrics whose
per-document value is not one number (corpus-level ones such as `word_perplexity`, kept as (loglikelihood, words)
tuples until aggregation) are listed under `not_paired` instead.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

from ..stats.paired import paired_delta

# keys lm-eval writes into every sample that are not metrics
_SAMPLE_KEYS = {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics", "doc_hash",
                "prompt_hash", "target_hash"}


def paired_results(candidate: dict[str, list[dict]], baseline: dict[str, list[dict]], *, seed: int
                   ) -> dict[str, Any]:
    """task -> {metric: paired_delta(...)} plus `not_paired` reasons, from both runs' `samples`."""
    out: dict[str, Any] = {}
    for t, task in enumerate(sorted(candidate)):
        cand = {(s["doc_id"], s.get("filter", "none")): s for s in candidate[task]}
        base = {(s["doc_id"], s.get("filter", "none")): s for s in baseline.get(task, [])}
        keys = sorted(set(cand) & set(base))
        metrics = sorted({k for s in cand.values() for k in s if k not in _SAMPLE_KEYS})
        task_out: dict[str, Any] = {"documents": len(keys), "not_paired": []}
        for m, metric in enumerate(metrics):
            pairs = [(cand[k].get(metric), base[k].get(metric)) for k in keys]
            if not pairs or not all(isinstance(c, Real) and isinstance(b, Real) for c, b in pairs):
                task_out["not_paired"].append(f"{metric} (not one number per document)")
                continue
            task_out[metric] = paired_delta([float(c) for c, _ in pairs], [float(b) for _, b in pairs],
                                            seed=seed + 1000 * t + m)
        out[task] = task_out
    return out
