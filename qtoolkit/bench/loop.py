"""The one server-per-system benchmark loop (`qtool bench serve`, the sign-off's ablation, the deployment bench):
every system serves the same requests tier by tier, the order alternating between tiers to spread drift, and
then repeated rounds of fresh requests, interleaved within each round, give every ratio a 95% interval."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from qtoolkit.evals.stats.paired import ratio_over_rounds

from ..progress import status
from .workloads import BenchRequest, build_workload

# (label, requests, concurrency, seed) -> a tier summary (load_client.summarize's dict)
Measure = Callable[[str, list[BenchRequest], int, int], dict[str, Any]]


def requests_per_tier(concurrency: int, num_requests: int | None) -> int:
    """Default: two waves of the tier's concurrency (at least 4, at most 64) to keep a CPU run to minutes."""
    return num_requests if num_requests else min(max(4, 2 * concurrency), 64)


def interleaved(labels: Sequence[str], turn: int) -> list[str]:
    """The measuring order of one tier or round: as given on even turns, reversed on odd ones."""
    return list(labels) if turn % 2 == 0 else list(reversed(labels))


def measure_tier(labels: Sequence[str], reqs: list[BenchRequest], concurrency: int, turn: int, seed: int,
                 measure: Measure, on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every system on `reqs`, interleaved; `on_result(results so far)` after each system. The results come
    back in the order of `labels`."""
    results: dict[str, Any] = {}
    for label in interleaved(labels, turn):
        status(f"concurrency {concurrency}: {len(reqs)} requests against {label}")
        results[label] = measure(label, reqs, concurrency, seed)
        if on_result is not None:
            on_result(results)
    return {label: results[label] for label in labels}


def fresh_requests(workload: Any, n: int, used: list[BenchRequest], *, seed: int, mean_output_tokens: int,
                   max_output_tokens: int) -> list[BenchRequest]:
    """n requests whose prompts none of `used` had: a repeated prompt would be served from the prefix cache."""
    seen = {r.prompt for r in used}
    pool = build_workload(workload, 4 * n + len(used), seed=seed, mean_output_tokens=mean_output_tokens,
                          max_output_tokens=max_output_tokens)
    fresh = []
    for r in pool:
        if r.prompt not in seen and len(fresh) < n:
            seen.add(r.prompt)
            fresh.append(r)
    return fresh if len(fresh) == n else pool[:n]  # a tiny prompt pool: repeats are unavoidable


def repeat_rounds(labels: Sequence[str], first: dict[str, Any], rounds: int, fresh: Callable[[int], list[BenchRequest]],
                  concurrency: int, seed: int, measure: Measure) -> dict[str, list[float]]:
    """Output tok/s per system over `rounds` rounds: round 1 is `first` (the tier's results), each later round
    serves `fresh(round)` requests to every system, interleaved."""
    per_round = {label: [first[label]["output_tok_per_s"]] for label in labels}
    for r in range(1, rounds):
        reqs = fresh(r)
        for label in interleaved(labels, r):
            status(f"concurrency {concurrency}, round {r + 1}/{rounds}: {len(reqs)} requests against {label}")
            per_round[label].append(measure(label, reqs, concurrency, seed + r)["output_tok_per_s"])
    return per_round


def ratio_rounds(rounds: dict[str, list[float]], numerator: str, denominator: str) -> dict[str, Any] | None:
    """numerator ÷ denominator over paired rounds (evals.stats.ratio_over_rounds: geometric mean, t-interval);
    None when either side is missing or a round measured nothing (all its requests failed)."""
    a, b = rounds.get(numerator), rounds.get(denominator)
    if not a or not b or min(a) <= 0 or min(b) <= 0:
        return None
    return ratio_over_rounds(a, b)
