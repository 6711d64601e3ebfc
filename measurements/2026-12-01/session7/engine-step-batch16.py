"""Batch-16 fp32 decode step in the engine alone (no server), for the trees before/after the session-6
restructuring (#19): 16 requests decode 48 tokens each; prints ms per decode step over 2 runs and Python calls
per step under cProfile, with the heaviest functions.

    for t in <worktree of 5e61215> .; do QTOOLKIT_SRC=$t python measurements/2026-12-01/session7/engine-step-batch16.py; done
"""

import cProfile
import json
import pstats
import time

from qtoolkit.engine import Engine, SamplingParams

try:
    from qtoolkit.engine.config import EngineConfig

    engine = Engine("default", EngineConfig(dtype="float32", kv_cache_memory="512MiB"))
except ImportError:  # the tree before the restructuring takes keyword arguments
    engine = Engine("default", dtype="float32", kv_cache_memory="512MiB")
PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'


def run(n: int, batch: int) -> tuple[int, float]:
    for i in range(batch):
        engine.add_request(f"r{i}", PROMPT + f"# {i}\n", SamplingParams(max_tokens=n, ignore_eos=True))
    engine.step()
    while engine.scheduler.waiting:
        engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - t0


run(8, 16)
walls = [run(48, 16) for _ in range(2)]
profile = cProfile.Profile()
profile.enable()
steps, _ = run(48, 16)
profile.disable()
stats = pstats.Stats(profile).stats
calls = sum(s[0] for s in stats.values())
top = sorted(((s[2], f"{k[0].split('/')[-1]}:{k[2]}", s[0]) for k, s in stats.items()), reverse=True)[:14]
print(json.dumps({"steps": steps, "ms_per_step": [1e3 * w / s for s, w in walls], "calls_per_step": calls / steps,
                  "top_tottime_per_step_ms": [(n, round(1e3 * t / steps, 3), c // steps) for t, n, c in top]}))
