"""A tier's figures under the names and units `vllm bench serve` writes, so a qtoolkit run sits beside a vLLM one.

vLLM's result JSON (vllm/benchmarks/serve.py) holds `duration`, `completed`, `failed`, `total_input_tokens`,
`total_output_tokens`, `request_throughput`, `output_throughput`, `total_token_throughput` and, for each of
ttft / tpot / itl / e2el, `mean_*_ms`, `median_*_ms`, `std_*_ms` and `p99_*_ms` (and `p90_*_ms`, as `--metric-percentiles 90,99` adds); per run also `num_prompts`,
`max_concurrency` and `request_rate` ("inf" when requests are sent at once). Definitions match vLLM's: TPOT is
(latency - TTFT) / (output tokens - 1) per request over requests with more than one token, ITL is every gap
between streamed chunks, E2EL the whole request; std is the population standard deviation (numpy's default).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .types import RequestResult

PERCENTILES = (90, 99)
# vLLM's run-level names besides `completed` and `failed`, which a TierSummary holds under the same names and
# meaning; the latency ones are mean/median/std/pNN of ttft, tpot, itl and e2el, in ms
_RUN_NAMES = frozenset({"duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                        "output_throughput", "total_token_throughput"})
_LATENCY_NAME = re.compile(r"(mean|median|std|p\d+)_(ttft|tpot|itl|e2el)_ms")


def is_vllm_metric(key: str) -> bool:
    """Whether a tier result's key is one of vLLM's figures that qtoolkit's own do not hold (older files wrote
    p99 without p90)."""
    return key in _RUN_NAMES or _LATENCY_NAME.fullmatch(key) is not None


def _stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None,
                **{f"p{p}_{name}_ms": None for p in PERCENTILES}}
    ms = np.asarray(seconds, dtype=float) * 1000.0
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), **{f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES}}


def vllm_metrics(results: list[RequestResult], duration: float) -> dict[str, float | None]:
    """vLLM's per-run metrics of one system at one tier, but `completed` and `failed` (a TierSummary's own)."""
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    return {"duration": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
            "request_throughput": per_s(len(ok)), "output_throughput": per_s(total_out),
            "total_token_throughput": per_s(total_in + total_out),
            **_stats("ttft", [r.ttft for r in ok if r.ttft is not None]), **_stats("tpot", tpot),
            **_stats("itl", [x for r in ok for x in r.itl]), **_stats("e2el", [r.latency for r in ok])}


def vllm_run_fields(concurrency: int, num_prompts: int, rate: float | None) -> dict[str, Any]:
    """vLLM's per-run settings, written beside the metrics."""
    return {"max_concurrency": concurrency, "num_prompts": num_prompts,
            "request_rate": rate if rate is not None else "inf"}
