"""Batch-1 decode with the decode plan's single-row path on and off in one engine (DecodePlan.row_path toggled
between runs), rounds interleaved, then one timed breakdown of each (qtoolkit/bench/decode_breakdown.py).

    python measurements/2026-12-02/issue27/row-path/decode_ab.py CHECKPOINT OUT.json [ROUNDS]
"""

import json
import statistics
import sys
import time

from qtoolkit.kernels.roofline import measure_bandwidth

from qtoolkit.bench.decode import PROMPT
from qtoolkit.bench.decode_breakdown import format_breakdown, measure_breakdown
from qtoolkit.engine import Engine, EngineConfig, SamplingParams

TOKENS = 128


def decode_rate(engine: Engine) -> float:
    engine.add_request("ab", PROMPT, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps += [time.perf_counter()] * len(out.new_token_ids)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main(checkpoint: str, out: str, rounds: int) -> None:
    engine = Engine(checkpoint, EngineConfig(kv_cache_memory="256MiB"))
    decode_rate(engine)  # warm-up, binds the plan
    plan = engine.model.decode_plan.plan
    samples = {"row_path": [], "batched_path": []}
    for _ in range(rounds):
        for name in samples:
            plan.row_path = name == "row_path"
            samples[name].append(decode_rate(engine))
    ratios = [a / b for a, b in zip(samples["row_path"], samples["batched_path"], strict=True)]
    bandwidth = measure_bandwidth()
    breakdowns = {}
    for name in samples:
        plan.row_path = name == "row_path"
        breakdowns[name] = measure_breakdown(engine, PROMPT, TOKENS, bandwidth)
        print(format_breakdown(name, breakdowns[name]))
    result = {"checkpoint": checkpoint, "tokens": TOKENS, "rounds": rounds, "decode_tok_per_s": samples,
              "row_over_batched": ratios, "median_ratio": statistics.median(ratios),
              "memory_bandwidth_gb_s": bandwidth, "breakdown": {k: v.to_json() for k, v in breakdowns.items()}}
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"row/batched per round {[round(r, 3) for r in ratios]}, median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5)
