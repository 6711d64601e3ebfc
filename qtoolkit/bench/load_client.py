"""The load client every benchmark shares: streams OpenAI requests (retrying 429/503 with backoff), times each one
as a user sees it (TTFT, ITL, TPOT) and summarizes a tier. Token counts come from the server's usage block
(`stream_options.include_usage`, which vLLM and OpenAI honour too)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import httpx

from ..endpoints.deployment import RETRY_STATUS, backoff_s
from ..engine.params import SpeculativeUsage
from ..provenance import text_sha256
from .summary import SLO, TierSummary
from .types import BenchRequest, RequestResult
from .vllm_names import vllm_metrics
from .workloads import arrival_offsets, build_workload

_REQUEST_TIMEOUT_S = 600.0
STREAM_TRIES = 4  # a request refused with 429/503 is sent again up to this many times in all


def request_body(model: str, req: BenchRequest, *, api: str, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # an extension (ours and vLLM's): lengths stay as drawn
    if req.messages is not None:  # a workload file's chat line
        body["messages"] = list(req.messages)
    elif api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta")  # a chat chunk; the wire format's own shape
    return (delta.get("content") if delta else None) or ""


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], index: int) -> RequestResult:
    """One streamed request, sent again on 429/503 (Retry-After honoured, capped); the waits count in its TTFT
    and latency, as they would for a user."""
    start = time.perf_counter()
    for attempt in range(STREAM_TRIES):
        result = await _stream_once(client, url, body, index)
        if result.status not in RETRY_STATUS or attempt + 1 == STREAM_TRIES:
            break
        await asyncio.sleep(backoff_s(attempt, result.retry_after))
    waited = time.perf_counter() - start - result.latency
    result.latency += waited
    result.ttft = None if result.ttft is None else result.ttft + waited
    result.retries = attempt
    return result


async def _stream_once(client: httpx.AsyncClient, url: str, body: dict[str, Any], index: int) -> RequestResult:
    """Send one streamed request and time its chunks."""
    result = RequestResult(index, ok=False)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, timeout=_REQUEST_TIMEOUT_S) as resp:
            if resp.status_code != 200:
                result.status, result.retry_after = resp.status_code, resp.headers.get("retry-after")
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.ok = result.error is None
                    break
                msg = json.loads(data)
                if "error" in msg:
                    result.error = str(msg["error"].get("message", msg["error"]))
                    continue
                if msg.get("usage"):
                    result.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    result.output_tokens = msg["usage"].get("completion_tokens", 0)
                    if spec := msg["usage"].get("speculative"):
                        result.speculative = SpeculativeUsage.from_dict(spec)
                if any(_chunk_text(c) for c in msg.get("choices", [])):
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.latency = time.perf_counter() - start
    if result.ok and not result.output_tokens:
        result.output_tokens = chunks  # a server without usage blocks: one chunk per token is the best guess
    if result.ok and result.ttft is None:
        result.ok, result.error = False, "the stream ended without any generated text"
    return result


async def run_load(base_url: str, model: str, requests: list[BenchRequest], *, concurrency: int,
                   rate: float | None = None, seed: int = 0, api: str = "completions", ignore_eos: bool = True,
                   api_key: str | None = None, burstiness: float = 1.0) -> tuple[list[RequestResult], float]:
    """Send `requests` with at most `concurrency` in flight (arrivals at `rate`/s if given: Poisson, or gamma
    with shape `burstiness`).

    Returns per-request results and the wall time from the first send to the last completion.
    """
    urls = {kind: f"{base_url}/v1/{kind}" for kind in ("completions", "chat/completions")}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    offsets = arrival_offsets(len(requests), rate, seed=seed, burstiness=burstiness)
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=_REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with slots:
                body = request_body(model, req, api=api, ignore_eos=ignore_eos)
                chat = api == "chat" or req.messages is not None
                sent_at = time.perf_counter() - start
                result = await stream_request(client, urls["chat/completions" if chat else "completions"], body,
                                              req.index)
                result.sent_at = sent_at
                return result

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
    return list(results), duration


def summarize(results: list[RequestResult], duration: float, *, slo: SLO | None = None,
              rate: float | None = None) -> TierSummary:
    """A tier's figures: throughput over the whole run, latency distributions over completed requests, goodput
    under `slo`, saturation under open-loop `rate`, the speculation counters and the same run in vLLM's names and
    units (ms)."""
    spec = [r.speculative for r in results if r.ok and r.speculative is not None]
    return dataclasses.replace(TierSummary.of(results, duration, slo=slo, rate=rate),
                               speculative=sum(spec, SpeculativeUsage()) if spec else None,
                               vllm=vllm_metrics(results, duration))


def normalize_endpoint(url: str) -> str:
    """Accept `http://host:port`, `.../v1` or `.../v1/`; return the server root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def served_models(base_url: str, api_key: str | None = None) -> list[str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=30.0) as client:
        resp = await client.get(f"{base_url}/v1/models")
        resp.raise_for_status()
        return [m["id"] for m in resp.json().get("data", [])]


def warm_up(url: str, model: str, *, seed: int, api: str = "completions", ignore_eos: bool = True,
            api_key: str | None = None) -> None:
    """Two short requests: a server's first steps pay one-off costs, kept out of the figures."""
    warm = build_workload("code", 2, seed=seed + 1, mean_output_tokens=4, max_output_tokens=8)
    asyncio.run(run_load(url, model, warm, concurrency=2, api=api, ignore_eos=ignore_eos, api_key=api_key))


def requests_sha256(requests: list[BenchRequest]) -> str:
    return text_sha256(json.dumps([[r.prompt, r.max_tokens] for r in requests]))
