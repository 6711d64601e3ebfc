"""Benchmark workloads: real prompts (HumanEval code, ACLSum abstracts) with seeded output lengths and arrivals.

Prompts come from the packaged data sets, never the network. Output lengths are drawn per request from a
lognormal (long-tailed, like real traffic) and sent as `max_tokens` with EOS ignored, so every system under test
generates exactly the same number of tokens for the same request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from ..errors import DataError
from ..evals.data import aclsum_items, humaneval_problems
from ..evals.prompts import user_message

if TYPE_CHECKING:
    from .workload_files import FileWorkload

WORKLOADS = ("code", "summarization", "mixed", "long")
# Code completions run longer than one-sentence summaries; the mixed workload averages to the requested mean.
_LENGTH_FACTOR = {"code": 1.25, "summarization": 0.75, "long": 1.0}
# `long`: ~2k-token documents (consecutive ACLSum abstracts) under one question, the regime where the KV cache,
# not the weights, limits concurrency
_LONG_DOCUMENT_CHARS = 10000  # ~2k tokens of English prose
_LENGTH_SIGMA = 0.6
_MIN_OUTPUT_TOKENS = 4



@dataclass(frozen=True)
class BenchRequest:
    index: int
    kind: str  # "code" | "summarization" | a workload file's "completion" | "chat"
    prompt: str  # a chat request's messages as JSON (its identity; the messages are sent as they are)
    max_tokens: int
    messages: tuple[dict[str, str], ...] | None = None  # a chat request, sent to /v1/chat/completions
    item: str | None = None  # a workload file's item, "STEM/ID"


@cache
def code_prompts() -> tuple[str, ...]:
    """HumanEval function stubs (the raw completion prompts)."""
    return tuple(p["prompt"] for p in humaneval_problems())


@cache
def summarization_prompts(split: str = "test") -> tuple[str, ...]:
    """ACLSum abstracts under the eval's question about their outcome (evals/prompts.py)."""
    return tuple(user_message(d["abstract"], "outcome") for d in aclsum_items(split))


@cache
def long_document_prompts(split: str = "test") -> tuple[str, ...]:
    """One prompt per abstract: it and the abstracts after it, up to ~2k tokens, under the outcome question."""
    abstracts = [d["abstract"] for d in aclsum_items(split)]
    prompts = []
    for i in range(len(abstracts)):
        parts, size, j = [], 0, i
        while size < _LONG_DOCUMENT_CHARS:
            parts.append(abstracts[j % len(abstracts)])
            size += len(parts[-1]) + 2
            j += 1
        prompts.append(user_message("\n\n".join(parts), "outcome"))
    return tuple(prompts)


def output_lengths(kind: str, n: int, rng: np.random.Generator, mean_tokens: int, max_tokens: int) -> list[int]:
    """Lognormal output lengths with the given mean for this kind, clipped to [4, max_tokens]."""
    mean = mean_tokens * _LENGTH_FACTOR[kind]
    mu = math.log(mean) - _LENGTH_SIGMA**2 / 2  # a lognormal's mean is exp(mu + sigma^2 / 2)
    draws = rng.lognormal(mu, _LENGTH_SIGMA, size=n)
    return [int(min(max(round(x), _MIN_OUTPUT_TOKENS), max_tokens)) for x in draws]


def build_workload(name: str | FileWorkload, num_requests: int, *, seed: int = 0, mean_output_tokens: int = 64,
                   max_output_tokens: int = 256) -> list[BenchRequest]:
    """`num_requests` requests of the named workload; the same seed gives the same prompts and lengths."""
    if not isinstance(name, str):  # a user's workload file (workload_files.py)
        return name.requests(num_requests, seed=seed, max_output_tokens=max_output_tokens)
    if name not in WORKLOADS:
        raise DataError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    if num_requests <= 0 or mean_output_tokens <= 0 or max_output_tokens < _MIN_OUTPUT_TOKENS:
        raise DataError("num_requests and mean_output_tokens must be > 0 and max_output_tokens >= 4")
    rng = np.random.default_rng(seed)
    if name == "mixed":
        kinds = [str(k) for k in rng.choice(["code", "summarization"], size=num_requests)]
    else:
        kinds = [name] * num_requests
    pools = {"code": code_prompts(), "summarization": summarization_prompts()}
    if name == "long":
        pools = {"long": long_document_prompts()}
    orders = {k: rng.permutation(len(pool)) for k, pool in pools.items()}
    taken = {k: 0 for k in pools}
    requests = []
    for i, kind in enumerate(kinds):
        pool, order = pools[kind], orders[kind]
        prompt = pool[order[taken[kind] % len(pool)]]
        taken[kind] += 1
        (length,) = output_lengths(kind, 1, rng, mean_output_tokens, max_output_tokens)
        requests.append(BenchRequest(i, kind, prompt, length))
    return requests


def arrival_offsets(n: int, rate: float | None, *, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals at `rate`/s, or all at once."""
    if not rate:
        return [0.0] * n
    if rate < 0:
        raise DataError(f"--rate must be a positive number of requests per second, got {rate}")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=n)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]  # the first request goes out at once
