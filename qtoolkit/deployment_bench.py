"""Throughput of two deployments (candidate and baseline endpoints) under the same load, tier by tier.

The load generator, workload and tier sizes are those of `qtool bench serve --endpoint`, so a tier here and a
standalone `qtool bench serve` against the same endpoint send the same requests (same `workload_sha256`). The two
endpoints alternate within each tier, and at the top tier they serve `rounds` rounds of fresh requests back to
back: the throughput gate judges the spread of the per-round ratios, as it does for the local ablation.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Any

from qtoolkit.evals.stats import ratio_over_rounds

from .ablation import fresh_requests
from .bench import requests_per_tier, run_load, summarize
from .deployment import Deployment, EndpointInfo
from .progress import status
from .provenance import provenance, text_sha256
from .workloads import build_workload

ROLES = ("baseline", "candidate")


def _measure(dep: Deployment, info: EndpointInfo, reqs: list[Any], concurrency: int, seed: int,
             ignore_eos: bool) -> dict[str, Any]:
    res, duration = asyncio.run(run_load(info.url, info.model_id, reqs, concurrency=concurrency, seed=seed,
                                         ignore_eos=ignore_eos, api_key=dep.api_key()))
    return {"endpoint": info.url, "model_id": info.model_id, **summarize(res, duration),
            "retried_requests": sum(1 for r in res if r.retries)}


def bench_deployments(deps: dict[str, Deployment], infos: dict[str, EndpointInfo], *, concurrency: list[int],
                      num_requests: int | None = None, mean_output_tokens: int = 64, max_output_tokens: int = 128,
                      workload: str = "mixed", seed: int = 0, rounds: int = 1,
                      ignore_eos: bool = True) -> dict[str, Any]:
    sizes = [requests_per_tier(c, num_requests) for c in concurrency]
    requests = build_workload(workload, sum(sizes), seed=seed, mean_output_tokens=mean_output_tokens,
                              max_output_tokens=max_output_tokens)
    for role in ROLES:  # first requests pay one-off costs (the same warm-up as `qtool bench serve`)
        warm = build_workload("code", 2, seed=seed + 1, mean_output_tokens=4, max_output_tokens=8)
        asyncio.run(run_load(infos[role].url, infos[role].model_id, warm, concurrency=2, ignore_eos=ignore_eos,
                             api_key=deps[role].api_key()))
    tiers, offset = [], 0
    for t, (c, n) in enumerate(zip(concurrency, sizes, strict=True)):
        reqs = requests[offset:offset + n]
        offset += n
        results = {}
        for role in ROLES if t % 2 == 0 else ROLES[::-1]:  # alternate to spread drift over both
            status(f"concurrency {c}: {n} requests against the {role} endpoint {infos[role].url}")
            results[role] = _measure(deps[role], infos[role], reqs, c, seed + t, ignore_eos)
        tiers.append({"concurrency": c, "num_requests": n, "results": {r: results[r] for r in ROLES}})
    round_requests: list[Any] = []
    if rounds > 1:
        top, c, n = tiers[-1], concurrency[-1], sizes[-1]
        top["rounds"] = {r: [top["results"][r]["output_tok_per_s"]] for r in ROLES}
        for k in range(1, rounds):
            reqs = fresh_requests(workload, n, requests + round_requests, seed=seed + 100 + k,
                                  mean_output_tokens=mean_output_tokens, max_output_tokens=max_output_tokens)
            round_requests += reqs
            for role in ROLES if k % 2 == 0 else ROLES[::-1]:
                status(f"concurrency {c}, round {k + 1}/{rounds}: {n} requests against the {role} endpoint")
                top["rounds"][role].append(_measure(deps[role], infos[role], reqs, c, seed + k,
                                                    ignore_eos)["output_tok_per_s"])
    workload_hash = text_sha256(json.dumps([[r.prompt, r.max_tokens] for r in requests]))
    return {**provenance(candidate=infos["candidate"].url, baseline=infos["baseline"].url,
                         workload_sha256=workload_hash,
                         rounds_workload_sha256=text_sha256(json.dumps([[r.prompt, r.max_tokens]
                                                                        for r in round_requests]))),
            "config": {"concurrency": concurrency, "num_requests": num_requests, "workload": workload,
                       "mean_output_tokens": mean_output_tokens, "max_output_tokens": max_output_tokens,
                       "seed": seed, "rounds": rounds, "ignore_eos": ignore_eos, "api": "completions"},
            "endpoints": {r: asdict(infos[r]) for r in ROLES},
            "tiers": tiers}


def throughput_table(bench: dict[str, Any]) -> dict[str, Any]:
    """Per tier: candidate ÷ baseline output tok/s (and over rounds at the top tier), in the shape the throughput
    gate reads: the candidate deployment is the full stack, the baseline deployment what it replaces."""
    rows = []
    for tier in bench["tiers"]:
        res = tier["results"]
        c, b = res["candidate"], res["baseline"]
        ok = c["completed"] and b["completed"] and not c["failed"] and not b["failed"] and b["output_tok_per_s"]
        row = {"concurrency": tier["concurrency"], "num_requests": tier["num_requests"],
               "endpoints": {r: {"endpoint": res[r]["endpoint"], "model_id": res[r]["model_id"],
                                 "output_tok_per_s": res[r]["output_tok_per_s"],
                                 "requests_per_s": res[r]["requests_per_s"], "completed": res[r]["completed"],
                                 "failed": res[r]["failed"], "ttft_p50_s": res[r]["ttft_s"]["p50"],
                                 "tpot_p50_s": res[r]["tpot_s"]["p50"]} for r in ROLES},
               "total_speedup": c["output_tok_per_s"] / b["output_tok_per_s"] if ok else None}
        rounds = tier.get("rounds")
        if ok and rounds:
            row["total_speedup_rounds"] = ratio_over_rounds(rounds["candidate"], rounds["baseline"])
        rows.append(row)
    return {"tiers": rows, "workload_sha256": bench["inputs"]["workload_sha256"]}
