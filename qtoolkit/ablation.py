"""Layer-by-layer ablation: each serving optimisation measured alone and stacked, on one workload, interleaved.

Layers stack in the order of the thesis: baseline (unquantized, static batching) -> + continuous batching ->
+ speculative decoding (when the engine offers it) -> + quantization. Each layer is also measured alone on top of
the baseline (quantized weights with static batching, ...), so the report shows where savings overlap: the
stacked gain divided by the product of the alone gains is 1 when layers compound and < 1 when they overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from pathlib import Path
from typing import Any

from qtoolkit.evals.stats import ratio_over_rounds

from .progress import status
from .provenance import provenance, text_sha256

# (system name, which model, batching, extra server args); order = stacking order
BASE_SYSTEMS: list[tuple[str, str, str, list[str]]] = [
    ("baseline_static", "baseline", "static", []),
    ("baseline_continuous", "baseline", "continuous", []),
    ("candidate_static", "candidate", "static", []),
    ("candidate_continuous", "candidate", "continuous", []),
]
STACK = ["baseline_static", "baseline_continuous", "baseline_continuous_spec", "candidate_continuous_spec"]
LABELS = {
    "baseline_static": "baseline (static batching)",
    "baseline_continuous": "+ continuous batching",
    "baseline_continuous_spec": "+ speculative decoding",
    "candidate_continuous_spec": "+ quantization (full stack)",
}
# each layer alone over the baseline: (system, name of the layer)
ALONE = [("baseline_continuous", "continuous batching"), ("baseline_static_spec", "speculative decoding"),
         ("candidate_static", "quantization")]


def speculative_systems(speculative: str | None) -> list[tuple[str, str, str, list[str]]]:
    """Systems with speculation, when the engine offers it (`qtool serve --speculative`)."""
    if not speculative:
        return []
    args = ["--speculative", speculative]
    return [("baseline_static_spec", "baseline", "static", args),
            ("baseline_continuous_spec", "baseline", "continuous", args),
            ("candidate_continuous_spec", "candidate", "continuous", args)]


def full_stack_system(systems: list[str]) -> str:
    """The system the total speedup is read from: quantization on top of every other layer offered."""
    return "candidate_continuous_spec" if "candidate_continuous_spec" in systems else "candidate_continuous"


def fresh_requests(workload: str, n: int, used: list[Any], *, seed: int, mean_output_tokens: int,
                   max_output_tokens: int) -> list[Any]:
    """n requests whose prompts none of `used` had: a repeated prompt would be served from the prefix cache."""
    from .workloads import build_workload

    seen = {r.prompt for r in used}
    pool = build_workload(workload, 4 * n + len(used), seed=seed, mean_output_tokens=mean_output_tokens,
                          max_output_tokens=max_output_tokens)
    fresh = []
    for r in pool:
        if r.prompt not in seen and len(fresh) < n:
            seen.add(r.prompt)
            fresh.append(r)
    return fresh if len(fresh) == n else pool[:n]  # a tiny prompt pool: repeats are unavoidable


def bench_ablation(baseline: str | Path, candidate: str | Path, *, concurrency: list[int],
                   num_requests: int | None = None, mean_output_tokens: int = 48, max_output_tokens: int = 96,
                   workload: Any = "mixed", speculative: str | None = None, seed: int = 0,
                   kv_cache_memory: str = "1GiB", rounds: int = 1,
                   repeat: tuple[str, ...] = ("baseline_static", "full_stack")) -> dict[str, Any]:
    """Every system on the same requests, tier by tier, alternating the order between tiers.

    With rounds > 1 the systems in `repeat` ("full_stack" names the top of the stack) serve the top tier again,
    rounds - 1 more times, each round on fresh requests and in alternating order: the throughput gates read the
    spread of the per-round ratios, i.e. how much a rerun could move them."""
    from .bench import requests_per_tier, run_load, served_models, summarize
    from .server.process import server_process
    from .workload_files import attach_length_probe, describe_workload
    from .workloads import build_workload

    systems = BASE_SYSTEMS + speculative_systems(speculative)
    models = {"baseline": str(baseline), "candidate": str(candidate)}
    sizes = [requests_per_tier(c, num_requests) for c in concurrency]
    tiers = []
    with contextlib.ExitStack() as stack:
        urls: dict[str, tuple[str, str]] = {}
        for name, which, batching, extra in systems:
            status(f"starting server {name}")
            url = stack.enter_context(server_process(models[which], batching=batching, max_num_seqs=max(concurrency),
                                                     kv_cache_memory=kv_cache_memory, extra_args=extra))
            served = asyncio.run(served_models(url))[0]
            warm = build_workload("code", 2, seed=seed + 1, mean_output_tokens=4, max_output_tokens=8)
            asyncio.run(run_load(url, served, warm, concurrency=2))
            urls[name] = (url, served)
        # a workload file's lines without max_tokens: the baseline's answer lengths (workload_files.py)
        attach_length_probe(workload, *urls["baseline_static"], name="baseline_static")
        requests = build_workload(workload, sum(sizes), seed=seed, mean_output_tokens=mean_output_tokens,
                                  max_output_tokens=max_output_tokens)
        offset = 0
        for t, (c, n) in enumerate(zip(concurrency, sizes, strict=True)):
            reqs = requests[offset:offset + n]
            offset += n
            order = list(urls) if t % 2 == 0 else list(reversed(urls))  # spread drift over all systems
            results = {}
            for name in order:
                status(f"concurrency {c}: {n} requests against {name}")
                url, served = urls[name]
                res, duration = asyncio.run(run_load(url, served, reqs, concurrency=c, seed=seed + t))
                results[name] = summarize(res, duration)
            tiers.append({"concurrency": c, "num_requests": n, "results": {k: results[k] for k in urls}})
        names, round_requests = list(urls), []
        again = [full_stack_system(names) if x == "full_stack" else x for x in repeat]
        again = [x for x in names if x in again]
        if rounds > 1 and again:
            top, c, n = tiers[-1], concurrency[-1], sizes[-1]
            top["rounds"] = {x: [top["results"][x]["output_tok_per_s"]] for x in again}
            for r in range(1, rounds):
                reqs = fresh_requests(workload, n, requests + round_requests, seed=seed + 100 + r,
                                      mean_output_tokens=mean_output_tokens, max_output_tokens=max_output_tokens)
                round_requests += reqs
                for name in (again if r % 2 == 0 else list(reversed(again))):
                    status(f"concurrency {c}, round {r + 1}/{rounds}: {n} requests against {name}")
                    url, served = urls[name]
                    res, duration = asyncio.run(run_load(url, served, reqs, concurrency=c, seed=seed + r))
                    top["rounds"][name].append(summarize(res, duration)["output_tok_per_s"])
    workload_hash = text_sha256(json.dumps([[r.prompt, r.max_tokens] for r in requests]))
    rounds_hash = text_sha256(json.dumps([[r.prompt, r.max_tokens] for r in round_requests]))
    return {**provenance(baseline=models["baseline"], candidate=models["candidate"], workload_sha256=workload_hash,
                         rounds_workload_sha256=rounds_hash),
            "config": {"concurrency": concurrency, "workload": describe_workload(workload), "speculative": speculative,
                       "mean_output_tokens": mean_output_tokens, "max_output_tokens": max_output_tokens,
                       "seed": seed, "systems": [s[0] for s in systems], "rounds": rounds},
            "tiers": tiers}


def ablation_table(bench: dict[str, Any]) -> dict[str, Any]:
    """Per tier: tok/s of each stacked layer, its marginal gain over the layer before, and the total."""
    out_tiers = []
    for tier in bench["tiers"]:
        res = tier["results"]

        def tps(name: str, res: dict[str, Any] = res) -> float | None:
            r = res.get(name)
            return r["output_tok_per_s"] if r and r.get("completed") else None

        steps, prev = [], None
        for name in STACK:
            key = name
            if name == "candidate_continuous_spec" and name not in res:
                key = "candidate_continuous"  # no speculation: quantization lands on continuous batching
            value = tps(key)
            if value is None:
                continue
            steps.append({"system": key, "label": LABELS[name], "output_tok_per_s": value,
                          "marginal_gain": value / prev if prev else None})
            prev = value
        base = tps("baseline_static")
        alone = {layer: tps(name) / base for name, layer in ALONE if tps(name) and base}
        total = steps[-1]["output_tok_per_s"] / base if steps and base else None
        row = {"concurrency": tier["concurrency"], "steps": steps, "total_speedup": total, "alone_speedup": alone,
               "quantization_speedup": alone.get("quantization")}
        if total and alone:
            # 1: the layers compound; < 1: they overlap (one layer's gain was already taken by another)
            row["stacking_efficiency"] = total / math.prod(alone.values())
        rounds = tier.get("rounds") or {}
        for key, name in (("total_speedup", full_stack_system(list(res))), ("quantization_speedup", "candidate_static")):
            if "baseline_static" in rounds and name in rounds:
                row[f"{key}_rounds"] = ratio_over_rounds(rounds[name], rounds["baseline_static"])
        out_tiers.append(row)
    return {"tiers": out_tiers, "systems": bench["config"]["systems"]}
