"""Layer-by-layer ablation: each serving optimisation measured alone and stacked, on one workload, interleaved.

Layers stack in the order of the thesis: baseline (unquantized, static batching) -> + continuous batching ->
+ speculative decoding (when the engine offers it) -> + quantization. Each layer is also measured alone on top of
the baseline (quantized weights with static batching, ...), so the report shows where savings overlap: the
stacked gain divided by the product of the alone gains is 1 when layers compound and < 1 when they overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path
from typing import Any

from qtoolkit.evals.stats.paired import ratio_over_rounds

from ..engine.config import EngineConfig
from ..progress import status
from ..provenance import provenance
from ..server.process import server_process
from .load_client import requests_sha256, run_load, served_models, summarize, warm_up
from .loop import fresh_requests, measure_tier, repeat_rounds, requests_per_tier
from .systems import System
from .workload_files import attach_length_probe, describe_workload
from .workloads import build_workload

# order = stacking order
BASE_SYSTEMS: list[System] = [System("static", quant="baseline"), System("continuous", quant="baseline"),
                              System("static", quant="candidate"), System("continuous", quant="candidate")]
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


def speculative_systems(speculative: str | None) -> list[System]:
    """Systems with speculation, when the engine offers it (`qtool serve --speculative`)."""
    if not speculative:
        return []
    return [System("static", speculative, "baseline"), System("continuous", speculative, "baseline"),
            System("continuous", speculative, "candidate")]


def full_stack_system(systems: list[str]) -> str:
    """The system the total speedup is read from: quantization on top of every other layer offered."""
    return "candidate_continuous_spec" if "candidate_continuous_spec" in systems else "candidate_continuous"


def _start(stack: contextlib.ExitStack, systems: list[System], models: dict[str, str], engine: EngineConfig,
           seed: int) -> dict[str, tuple[str, str]]:
    """One warmed-up `qtool serve` per system; label -> (base URL, served model name)."""
    urls = {}
    for system in systems:
        status(f"starting server {system.label}")
        url = stack.enter_context(server_process(models[system.quant], system.engine_config(engine)))
        served = asyncio.run(served_models(url))[0]
        warm_up(url, served, seed=seed)
        urls[system.label] = (url, served)
    return urls


def bench_ablation(baseline: str | Path, candidate: str | Path, engine: EngineConfig | None = None, *,
                   concurrency: list[int], num_requests: int | None = None, mean_output_tokens: int = 48,
                   max_output_tokens: int = 96, workload: Any = "mixed", seed: int = 0, rounds: int = 1,
                   repeat: tuple[str, ...] = ("baseline_static", "full_stack")) -> dict[str, Any]:
    """Every system on the same requests, tier by tier, alternating the order between tiers.

    `engine` holds the servers' engine options; its proposer (`speculative`) is the speculative layer's, and
    without one the layer is left out. With rounds > 1 the systems in `repeat` ("full_stack" names the top of
    the stack) serve the top tier again, rounds - 1 more times, each round on fresh requests and in alternating
    order: the throughput gates read the spread of the per-round ratios, i.e. how much a rerun could move them."""
    # every server admits the top tier at once, whatever the caller's max_num_seqs
    engine = (engine or EngineConfig()).replace(max_num_seqs=max(concurrency))
    systems = BASE_SYSTEMS + speculative_systems(engine.speculative)
    models = {"baseline": str(baseline), "candidate": str(candidate)}
    sizes = [requests_per_tier(c, num_requests) for c in concurrency]
    tiers, round_requests = [], []
    with contextlib.ExitStack() as stack:
        urls = _start(stack, systems, models, engine, seed)

        def measure(label: str, reqs: list[Any], c: int, s: int) -> dict[str, Any]:
            res, duration = asyncio.run(run_load(*urls[label], reqs, concurrency=c, seed=s))
            return summarize(res, duration)

        # a workload file's lines without max_tokens: the baseline's answer lengths (workload_files.py)
        attach_length_probe(workload, *urls["baseline_static"], name="baseline_static")
        requests = build_workload(workload, sum(sizes), seed=seed, mean_output_tokens=mean_output_tokens,
                                  max_output_tokens=max_output_tokens)
        offset = 0
        for t, (c, n) in enumerate(zip(concurrency, sizes, strict=True)):
            results = measure_tier(list(urls), requests[offset:offset + n], c, t, seed + t, measure)
            offset += n
            tiers.append({"concurrency": c, "num_requests": n, "results": results})
        again = [full_stack_system(list(urls)) if x == "full_stack" else x for x in repeat]
        again = [x for x in urls if x in again]
        if rounds > 1 and again:
            def fresh(r: int) -> list[Any]:
                reqs = fresh_requests(workload, sizes[-1], requests + round_requests, seed=seed + 100 + r,
                                      mean_output_tokens=mean_output_tokens, max_output_tokens=max_output_tokens)
                round_requests.extend(reqs)
                return reqs

            tiers[-1]["rounds"] = repeat_rounds(again, tiers[-1]["results"], rounds, fresh, concurrency[-1], seed,
                                                measure)
    return {**provenance(baseline=models["baseline"], candidate=models["candidate"],
                         workload_sha256=requests_sha256(requests), rounds_workload_sha256=requests_sha256(round_requests)),
            "config": {"concurrency": concurrency, "workload": describe_workload(workload),
                       "speculative": engine.speculative, "mean_output_tokens": mean_output_tokens,
                       "max_output_tokens": max_output_tokens, "seed": seed,
                       "systems": [s.label for s in systems], "rounds": rounds},
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
