"""Python work per batch-1 decode step in two source trees (#19: does the restructured engine step cost more?).

For each tree, one subprocess builds the engine on the default fp32 model, decodes 128 tokens under cProfile and
records, per decode step: Python function calls (exact, independent of machine load), seconds inside the AVX2
dense GEMV (the weight streaming a step is made of) and seconds outside it. The trees alternate over rounds.

    python measurements/2026-12-01/session7/engine-step-overhead.py --before /work/wt/before --after . \
        --rounds 2 --output measurements/2026-12-01/session7/engine-step-overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import cProfile, json, pstats, sys, time
import torch
from qtoolkit.engine import Engine, SamplingParams
try:
    from qtoolkit.engine.config import EngineConfig
    engine = Engine("default", EngineConfig(dtype="float32", kv_cache_memory="256MiB"))
except ImportError:  # the tree before the restructuring takes keyword arguments
    engine = Engine("default", dtype="float32", kv_cache_memory="256MiB")
PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'

def decode(n):
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))
    engine.step()  # the prefill step is not a decode step
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - t0

decode(32)
walls = [decode(128) for _ in range(3)]
profile = cProfile.Profile()
profile.enable()
steps, _ = decode(128)
profile.disable()
stats = pstats.Stats(profile).stats
calls = sum(s[0] for s in stats.values())
total = sum(s[2] for s in stats.values())
gemv = sum(s[2] for k, s in stats.items() if "dense_gemv" in k[2] and k[0] == "~")
print(json.dumps({"steps": steps, "wall_ms_per_step": [1e3 * w / s for s, w in walls],
                  "calls_per_step": calls / steps, "profiled_ms_per_step": 1e3 * total / steps,
                  "gemv_ms_per_step": 1e3 * gemv / steps, "other_ms_per_step": 1e3 * (total - gemv) / steps}))
'''


def measure(tree: str) -> dict:
    env = {**os.environ, "QTOOLKIT_SRC": tree, "QTOOLKIT_QUIET": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output", required=True)
    a = p.parse_args()
    trees = {"before": a.before, "after": a.after}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(a.rounds):
        for which in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
            runs[which].append(measure(trees[which]))
            print(r, which, runs[which][-1], flush=True)
    summary = {}
    for key in ("calls_per_step", "other_ms_per_step", "gemv_ms_per_step"):
        b = statistics.median(x[key] for x in runs["before"])
        f = statistics.median(x[key] for x in runs["after"])
        summary[key] = {"before": b, "after": f, "after_minus_before": f - b}
    wall = {w: statistics.median(v for x in runs[w] for v in x["wall_ms_per_step"]) for w in runs}
    summary["wall_ms_per_step"] = {**wall, "after_over_before": wall["after"] / wall["before"]}
    Path(a.output).write_text(json.dumps({"trees": trees, "rounds": a.rounds, "load_average": os.getloadavg(),
                                          "summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
