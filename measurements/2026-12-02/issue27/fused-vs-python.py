"""Issue 27, before/after in one process: the engine's decode step with the Python layer loop (before) and with
the C++ layer loop (model/decode_plan.py, after), alternating every round on the same engine, so machine load hits
both alike. Batch 1 (tok/s of one greedy stream, prefill left out) and batch 32 (generated tok/s of 32 streams, prefill
included, tokens/3 each).

--clock cpu with --threads 1 times the decoding thread's CPU time (time.thread_time), which other processes on a
shared machine disturb far less than wall time; --clock wall times the wall clock.

    python measurements/2026-12-02/issue27/fused-vs-python.py --model default --model /tmp/ckpt-int4 \
        --rounds 4 --tokens 48 --threads 1 --clock cpu --output measurements/2026-12-02/issue27/fused-vs-python-1t-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from qtoolkit.bench.decode import PROMPT
from qtoolkit.engine import Engine, EngineConfig, SamplingParams


def batch1(engine: Engine, clock, tokens: int) -> float:
    engine.add_request("b1", PROMPT, SamplingParams(max_tokens=tokens, ignore_eos=True))
    engine.step()  # prefill
    t, steps = clock(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (clock() - t)


def batch32(engine: Engine, clock, tokens: int) -> float:
    prompts = [f"{PROMPT}# variant {i}\n" for i in range(32)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    t = clock()
    outs = engine.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (clock() - t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=["cpu", "wall"], default="wall")
    p.add_argument("--output", required=True)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    results = {}
    for spec in a.model:
        engine = Engine(spec, EngineConfig(dtype="float32", kv_cache_memory="512MiB"))
        runs = {f"{shape}_{loop}": [] for shape in ("batch1", "batch32") for loop in ("python", "cpp")}
        batch1(engine, clock, 8)
        for r in range(a.rounds):
            for loop in (["python", "cpp"] if r % 2 == 0 else ["cpp", "python"]):
                engine.model.decode_plan = False if loop == "python" else None
                runs[f"batch1_{loop}"].append(batch1(engine, clock, a.tokens))
                runs[f"batch32_{loop}"].append(batch32(engine, clock, a.tokens // 3))
                print(spec, r, loop, {k: round(v[-1], 1) for k, v in runs.items() if v}, flush=True)
        med = {k: statistics.median(v) for k, v in runs.items()}
        ratios = {f"{s}_cpp_over_python": med[f"{s}_cpp"] / med[f"{s}_python"] for s in ("batch1", "batch32")}
        per_round = {f"{s}_cpp_over_python_per_round": [c / py for c, py in zip(runs[f"{s}_cpp"], runs[f"{s}_python"],
                                                                                 strict=True)]
                     for s in ("batch1", "batch32")}
        results[spec] = {"tok_per_s_median": med, "ratios": ratios, **per_round, "samples": runs}
        print(spec, json.dumps(ratios), flush=True)
        report = {"clock": a.clock, "threads": torch.get_num_threads(), "rounds": a.rounds, "tokens": a.tokens,
                  "batch32_tokens": a.tokens // 3, "load_average": os.getloadavg(), "results": results}
        with open(a.output, "w") as f:  # after every model: a late kill keeps what was measured
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
