"""Benchmark workloads: real prompts (HumanEval code, ACLSum abstracts) with seeded output lengths and arrivals.

Prompts come from the packaged data sets, never the network. Output lengths are drawn per request from a
lognormal (long-tailed, like real traffic) and sent as `max_tokens` with EOS ignored, so every system under test
generates exactly the same number of tokens for the same request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from ..errors import DataError
from ..evals.data import aclsum_items, humaneval_problems
from ..evals.prompts import user_message
from .types import BenchRequest, Workload

WORKLOADS = ("code", "summarization", "mixed", "long")
# Code completions run longer than one-sentence summaries; the mixed workload averages to the requested mean.
_LENGTH_FACTOR = {"code": 1.25, "summarization": 0.75, "long": 1.0}
# `long`: ~2k-token documents (consecutive ACLSum abstracts) under one question, the regime where the KV cache,
# not the weights, limits concurrency
_LONG_DOCUMENT_CHARS = 10000  # ~2k tokens of English prose
_LENGTH_SIGMA = 0.6
_MIN_OUTPUT_TOKENS = 4


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


@dataclass(frozen=True)
class BuiltinWorkload:
    """A packaged workload by name (WORKLOADS): prompts from the packaged data sets, seeded lognormal lengths."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise DataError(f"unknown workload {self.name!r}: choose one of {', '.join(WORKLOADS)}")

    def __str__(self) -> str:
        return self.name

    def describe(self) -> str:
        return self.name

    def attach_length_probe(self, url: str, model: str, *, name: str, api_key: str | None = None) -> None:
        """Every request's length is drawn, so there is nothing to measure."""

    def requests(self, n: int, *, seed: int, max_output_tokens: int,
                 mean_output_tokens: int = 64) -> list[BenchRequest]:
        if n <= 0 or mean_output_tokens <= 0 or max_output_tokens < _MIN_OUTPUT_TOKENS:
            raise DataError("num_requests and mean_output_tokens must be > 0 and max_output_tokens >= 4")
        rng = np.random.default_rng(seed)
        if self.name == "mixed":
            kinds = [str(k) for k in rng.choice(["code", "summarization"], size=n)]
        else:
            kinds = [self.name] * n
        pools = {"code": code_prompts(), "summarization": summarization_prompts()}
        if self.name == "long":
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


def as_workload(workload: str | Workload) -> Workload:
    """A built-in workload's name becomes its BuiltinWorkload; any other Workload passes through."""
    if isinstance(workload, str):
        return BuiltinWorkload(workload)
    if not isinstance(workload, Workload):
        raise DataError(f"{workload!r} is not a workload: pass one of {', '.join(WORKLOADS)} or a workload file")
    return workload


def build_workload(name: str | Workload, num_requests: int, *, seed: int = 0, mean_output_tokens: int = 64,
                   max_output_tokens: int = 256) -> list[BenchRequest]:
    """`num_requests` requests of the workload (a built-in's name or any Workload); the same seed gives the same
    prompts and lengths."""
    return as_workload(name).requests(num_requests, seed=seed, mean_output_tokens=mean_output_tokens,
                                      max_output_tokens=max_output_tokens)


def describe_workload(workload: str | Workload) -> Any:
    """The report's `config.workload`: a built-in's name, a workload file's paths, hashes and length sources."""
    return as_workload(workload).describe()


def arrival_offsets(n: int, rate: float | None, *, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start at which each request is sent: all at once without a rate, else gaps drawn from a
    gamma distribution of mean 1/rate and shape `burstiness`, as `vllm bench serve --burstiness` draws them
    (1: Poisson arrivals; below 1 burstier, above 1 more regular)."""
    if not rate:
        return [0.0] * n
    if rate < 0:
        raise DataError(f"--rate must be a positive number of requests per second, got {rate}")
    if not burstiness > 0:
        raise DataError(f"--burstiness must be a positive number (1: Poisson), got {burstiness}")
    rng = np.random.default_rng(seed + 1)
    gaps = (rng.exponential(1.0 / rate, size=n) if burstiness == 1.0
            else rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]  # the first request goes out at once
