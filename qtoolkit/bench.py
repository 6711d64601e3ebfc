"""Load generator for any OpenAI-compatible endpoint: streamed requests, per-request timings, tier summaries.

Each request is streamed, so time to first token (TTFT), inter-token latency (ITL, between streamed chunks) and
time per output token after the first (TPOT) are measured at the client, as a user sees them. Token counts come
from the server's usage block (`stream_options.include_usage`, which vLLM and OpenAI honour too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from .bench_vllm import vllm_metrics, vllm_run_fields
from .workloads import BenchRequest, arrival_offsets

_REQUEST_TIMEOUT_S = 600.0
STREAM_TRIES = 4  # a request refused with 429/503 is sent again up to this many times in all


@dataclass
class RequestResult:
    index: int
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds from send to the first generated text
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    error: str | None = None
    speculative: dict[str, Any] | None = None  # the server's per-request speculative decoding figures, if any
    status: int | None = None  # the HTTP status of a refused request
    retry_after: str | None = None  # its Retry-After header
    retries: int = 0  # 429/503 answers waited out before this result


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
    return (choice.get("delta") or {}).get("content") or ""


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], index: int) -> RequestResult:
    """One streamed request, sent again on 429/503 (Retry-After honoured, capped); the waits count in its TTFT
    and latency, as they would for a user."""
    from .deployment import RETRY_STATUS, backoff_s

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
                    result.speculative = msg["usage"].get("speculative")
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
                   api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """Send `requests` with at most `concurrency` in flight (Poisson arrivals at `rate`/s if given).

    Returns per-request results and the wall time from the first send to the last completion.
    """
    urls = {kind: f"{base_url}/v1/{kind}" for kind in ("completions", "chat/completions")}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    offsets = arrival_offsets(len(requests), rate, seed=seed)
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=_REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with slots:
                body = request_body(model, req, api=api, ignore_eos=ignore_eos)
                chat = api == "chat" or req.messages is not None
                return await stream_request(client, urls["chat/completions" if chat else "completions"], body,
                                            req.index)

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
    return list(results), duration


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """A tier's figures: throughput over the whole run, latency percentiles over completed requests."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    errors = sorted({r.error for r in results if r.error})
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / duration if duration > 0 else 0.0,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
        "ttft_s": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _percentiles(tpot),
        "itl_s": _percentiles([x for r in ok for x in r.itl]),
        "latency_s": _percentiles([r.latency for r in ok]),
        "errors": errors[:5],
        **_speculative_summary(ok),
        **vllm_metrics(results, duration),  # the same run in vLLM's names and units (ms)
    }


def _speculative_summary(ok: list[RequestResult]) -> dict[str, Any]:
    spec = [r.speculative for r in ok if r.speculative]
    if not spec:
        return {}
    drafted = sum(s["draft_tokens"] for s in spec)
    accepted = sum(s["accepted_tokens"] for s in spec)
    lengths = [s["mean_accepted_length"] for s in spec if s["mean_accepted_length"]]
    return {"speculative": {"draft_tokens": drafted, "accepted_tokens": accepted,
                            "acceptance_rate": accepted / drafted if drafted else 0.0,
                            "mean_accepted_length": sum(lengths) / len(lengths) if lengths else 0.0}}


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


# ---- HF transformers baseline: the same requests in static batches --------------------------------------------
def hf_generate_tier(model: Any, tokenizer: Any, requests: list[BenchRequest], batch_size: int) -> dict[str, Any]:
    """Run `requests` through HF `generate` in static batches of `batch_size`, EOS ignored like the server.

    A batch runs until its longest request is done; only the tokens each request asked for count as output.
    """
    import copy

    import torch

    # No EOS at all rather than min_new_tokens: its logits processor costs more than a small model's step.
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=None, pad_token_id=tokenizer.pad_token_id, do_sample=False)
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        prompts = [r.prompt if r.messages is None else tokenizer.apply_chat_template(
            list(r.messages), tokenize=False, add_generation_prompt=True) for r in batch]
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        config.max_new_tokens = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(**enc, generation_config=config)
        generated += (out.shape[1] - enc["input_ids"].shape[1]) * len(batch)
    duration = time.perf_counter() - start
    output_tokens = sum(r.max_tokens for r in requests)
    return {"num_requests": len(requests), "completed": len(requests), "failed": 0, "duration_s": duration,
            "batch_size": batch_size, "output_tokens": output_tokens, "generated_tokens": generated,
            "output_tok_per_s": output_tokens / duration, "requests_per_s": len(requests) / duration}


def load_hf(model_path: Any, dtype: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


# ---- one `qtool bench serve` run: systems x concurrency tiers, interleaved ---------------------------------------
def requests_per_tier(concurrency: int, num_requests: int | None) -> int:
    """Default: two waves of the tier's concurrency (at least 4, at most 64) to keep a CPU run to minutes."""
    return num_requests if num_requests else min(max(4, 2 * concurrency), 64)


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or not b.get("output_tok_per_s") or a.get("failed") or b.get("failed"):
        return None
    return a["output_tok_per_s"] / b["output_tok_per_s"]


def _update_tier(report: dict[str, Any], c: int, n: int, results: dict[str, Any],
                 on_tier: Callable[[dict[str, Any]], None] | None) -> None:
    """Record (or refresh) tier `c` with the systems measured so far and hand the report to `on_tier`."""
    engine = results.get("continuous") or results.get("static")
    ratios = {"continuous_over_static": _ratio(results.get("continuous"), results.get("static")),
              "engine_over_hf": _ratio(engine, results.get("hf"))}
    for name in results:  # "<mode>+<proposer>": speculation over the same server without it
        if "+" in name:
            ratios[f"{name}_over_{name.split('+')[0]}"] = _ratio(results[name], results.get(name.split("+")[0]))
    tier = {"concurrency": c, "num_requests": n, **vllm_run_fields(c, n, report["config"].get("rate_qps")),
            "results": dict(results),
            "ratios": {k: v for k, v in ratios.items() if v is not None}}
    tiers = report["tiers"]
    if tiers and tiers[-1]["concurrency"] == c and tiers[-1]["num_requests"] == n:
        tiers[-1] = tier
    else:
        tiers.append(tier)
    report["speculative_curve"] = _speculative_curve(report["tiers"])
    if on_tier is not None:
        on_tier(report)  # long CPU runs keep what they measured if stopped


def _add_ceilings(results: dict[str, Any], concurrency: int, num_speculative_tokens: int) -> None:
    """At concurrency 1: each speculative system's ceiling from its measured costs (see spec_ceiling)."""
    from .spec_ceiling import prefill_share, speculation_ceiling

    if concurrency != 1:
        return
    for name, res in results.items():
        plain = results.get(name.split("+")[0])
        share = prefill_share(plain) if plain else None
        if "speculative_engine" in res and share is not None:
            res["speculative_ceiling"] = speculation_ceiling(res["speculative_engine"], prefill_share=share,
                                                             num_speculative_tokens=num_speculative_tokens)


def _speculative_curve(tiers: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per speculative system: spec / no-spec output tok/s at each concurrency (the load-aware policy's curve)."""
    curve: dict[str, list[dict[str, Any]]] = {}
    for tier in tiers:
        for key, value in tier["ratios"].items():
            if "+" in key:
                name = key.split("_over_")[0]
                point = {"concurrency": tier["concurrency"], "speedup": value}
                if ceiling := tier["results"][name].get("speculative_ceiling"):
                    point["ceiling"] = ceiling["measured_acceptance"]["request_speedup"]
                    point["ceiling_at_full_acceptance"] = ceiling["full_acceptance"]["request_speedup"]
                curve.setdefault(name, []).append(point)
    return curve


def bench_serve(model: str = "default", *, endpoint: str | None = None, concurrency: list[int] | None = None,
                batching: list[str] | None = None, workload: Any = "mixed", rate: float | None = None,
                num_requests: int | None = None, compare_hf: bool = False, seed: int = 0,
                mean_output_tokens: int = 64, max_output_tokens: int = 128, api: str = "completions",
                ignore_eos: bool = True, api_key: str | None = None, kv_cache_memory: str = "1GiB",
                max_num_seqs: int = 64, dtype: str = "auto", speculative: list[str] | None = None,
                num_speculative_tokens: int = 4, on_tier: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure every system on the same requests, tier by tier; returns the report (see `format_table`).

    `on_tier(report)` is called after each measured system with the report so far (`complete` stays False until the end).
    """
    from .errors import QToolError
    from .progress import status
    from .provenance import provenance, text_sha256
    from .spec_ceiling import scrape_speculative, tier_delta
    from .workload_files import attach_length_probe, describe_workload
    from .workloads import build_workload

    concurrency = concurrency or [1, 4, 16, 32]
    batching = [] if endpoint else (batching or ["continuous"])
    if any(c <= 0 for c in concurrency):
        raise QToolError(f"--concurrency takes positive integers, got {concurrency}")
    if endpoint and compare_hf:
        raise QToolError("--compare hf needs a local --model to load; drop --endpoint or --compare")
    if not endpoint and max(concurrency) > max_num_seqs:
        raise QToolError(f"concurrency {max(concurrency)} exceeds --max-num-seqs {max_num_seqs}: raise it")
    sizes = [requests_per_tier(c, num_requests) for c in concurrency]
    source = None
    if not endpoint:
        from .sources import resolve_model

        source = resolve_model(model)

    from .server.process import server_process

    with contextlib.ExitStack() as stack:
        systems: dict[str, str] = {}
        if endpoint:
            systems["endpoint"] = normalize_endpoint(endpoint)
            try:
                names = asyncio.run(served_models(systems["endpoint"], api_key))
            except httpx.HTTPError as e:
                raise QToolError(f"cannot list models at {endpoint} ({type(e).__name__}: {e}): check the URL "
                                 "and --api-key") from None
            if model not in names:
                if model != "default" or not names:
                    raise QToolError(f"the endpoint serves {names}, not {model!r}: pass one of them as --model")
                model = names[0]
        else:
            for mode in batching:
                status(f"starting a {mode}-batching server for {model}")
                systems[mode] = stack.enter_context(server_process(
                    model, batching=mode, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs, dtype=dtype))
                for proposer in speculative or []:  # the same server with speculation, one per proposer
                    status(f"starting a {mode}-batching server for {model} with --speculative {proposer}")
                    systems[f"{mode}+{proposer}"] = stack.enter_context(server_process(
                        model, batching=mode, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                        dtype=dtype, extra_args=["--speculative", proposer,
                                                 "--num-speculative-tokens", str(num_speculative_tokens)]))
        for url in systems.values():  # first steps pay one-off costs; keep them out of the figures
            warm = build_workload("code", 2, seed=seed + 1, mean_output_tokens=4, max_output_tokens=8)
            asyncio.run(run_load(url, model, warm, concurrency=2, api=api, ignore_eos=ignore_eos, api_key=api_key))
        first = next(iter(systems))  # a workload file's lines without max_tokens: their answer length here
        attach_length_probe(workload, systems[first], model, name=first, api_key=api_key)
        all_requests = build_workload(workload, sum(sizes), seed=seed, mean_output_tokens=mean_output_tokens,
                                      max_output_tokens=max_output_tokens)
        hf = load_hf(source.path, dtype) if compare_hf else None
        if hf is not None:
            hf_generate_tier(*hf, build_workload("code", 1, seed=seed + 1, mean_output_tokens=4,
                                                 max_output_tokens=8), 1)

        config = {"model": model, "endpoint": endpoint, "systems": list(systems) + (["hf"] if hf else []),
                  "concurrency": concurrency, "workload": describe_workload(workload), "rate_qps": rate, "seed": seed,
                  "mean_output_tokens": mean_output_tokens, "max_output_tokens": max_output_tokens, "api": api,
                  "ignore_eos": ignore_eos, "kv_cache_memory": kv_cache_memory, "max_num_seqs": max_num_seqs,
                  "dtype": dtype, "speculative": speculative or [],
                  "num_speculative_tokens": num_speculative_tokens, "hf_note": "HF runs the tier's requests offline in static batches of the "
                                             "tier's concurrency (no arrivals); only requested tokens count"}
        workload_hash = text_sha256(json.dumps([[r.prompt, r.max_tokens] for r in all_requests]))
        prov = provenance(model=source.describe() if source else {"name": model, "endpoint": endpoint},
                          workload_sha256=workload_hash)
        report = {**prov, "config": config, "complete": False, "tiers": []}
        offset = 0
        for t, (c, n) in enumerate(zip(concurrency, sizes, strict=True)):
            reqs = all_requests[offset:offset + n]
            offset += n
            order = list(systems) if t % 2 == 0 else list(reversed(systems))  # alternate to spread drift
            results: dict[str, Any] = {}
            for name in order:
                status(f"concurrency {c}: {n} requests against {name}")
                before = scrape_speculative(systems[name], api_key) if "+" in name else None
                res, duration = asyncio.run(run_load(systems[name], model, reqs, concurrency=c, rate=rate,
                                                     seed=seed + t, api=api, ignore_eos=ignore_eos, api_key=api_key))
                results[name] = summarize(res, duration)
                if "+" in name and (engine := tier_delta(before, scrape_speculative(systems[name], api_key))):
                    results[name]["speculative_engine"] = engine
                _add_ceilings(results, c, num_speculative_tokens)
                _update_tier(report, c, n, results, on_tier)
            if hf is not None:
                status(f"concurrency {c}: {n} requests through HF generate (static batches of {c})")
                results["hf"] = hf_generate_tier(*hf, reqs, c)
                _update_tier(report, c, n, results, on_tier)
    report["complete"] = True
    return report


def format_table(report: dict[str, Any]) -> str:
    def ms(block: dict[str, Any] | None, key: str) -> str:
        v = (block or {}).get(key)
        return "-" if v is None else f"{1000 * v:.0f}"

    head = (f"{'system':<11}{'conc':>5}{'ok':>7}{'out tok/s':>11}{'req/s':>8}{'TTFT p50/p99 ms':>17}"
            f"{'TPOT p50/p99 ms':>17}{'ITL p50/p99 ms':>16}")
    lines = [head, "-" * len(head)]
    for tier in report["tiers"]:
        for name, r in tier["results"].items():
            lat = [f"{ms(r.get(k), 'p50')}/{ms(r.get(k), 'p99')}" for k in ("ttft_s", "tpot_s", "itl_s")]
            lines.append(f"{name:<11}{tier['concurrency']:>5}{r['completed']:>4}/{r['num_requests']:<2}"
                         f"{r['output_tok_per_s']:>11.1f}{r['requests_per_s']:>8.2f}{lat[0]:>17}{lat[1]:>17}"
                         f"{lat[2]:>16}")
        for k, v in tier["ratios"].items():
            lines.append(f"{'':<16}{k} = {v:.2f}x")
        for name, r in tier["results"].items():
            if (e := r.get("speculative_engine")) is not None:
                lines.append(f"{'':<16}{name}: drafted {e['draft_tokens']}, accepted {e['accepted_tokens']} "
                             f"(by position {e['acceptance_by_position'][:4]}), proposer {e['proposer_share']:.0%}"
                             f" of spec time, draft cost r={e['draft_cost_ratio']:.2f}, "
                             f"verify cost v={e['verify_cost_per_token']:.2f}/token")
            if (cl := r.get("speculative_ceiling")) is not None:
                m, f = cl["measured_acceptance"], cl["full_acceptance"]
                lines.append(f"{'':<16}{name}: ceiling at these costs {m['request_speedup']:.2f}x "
                             f"(k={m['best_k']}), at acceptance 1 {f['request_speedup']:.2f}x (k={f['best_k']}); "
                             f"prefill is {cl['prefill_share']:.0%} of a request")
    return "\n".join(lines)
