"""Issue 27 diagnosis: where a batch-1 decode step's time goes, by cProfile over the decoding thread's CPU time
(time.thread_time, 1 thread), with the Python layer loop (QTOOLKIT_FUSED_DECODE=0) or the C++ one.

    QTOOLKIT_FUSED_DECODE=0 python measurements/2026-12-02/issue27/profile-step.py /tmp/ckpt-int4 \
        measurements/2026-12-02/issue27/profile-step-int4-python.json
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import time

import torch

from qtoolkit.bench.decode import PROMPT
from qtoolkit.engine import Engine, EngineConfig, SamplingParams


def decode(engine: Engine, n: int) -> tuple[int, float]:
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))
    engine.step()  # prefill
    t0, steps = time.thread_time(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.thread_time() - t0


def main() -> None:
    torch.set_num_threads(1)
    engine = Engine(sys.argv[1], EngineConfig(dtype="float32", kv_cache_memory="256MiB"))
    decode(engine, 16)
    plain = [1e3 * t / s for s, t in (decode(engine, 64) for _ in range(3))]
    profile = cProfile.Profile(time.thread_time)
    profile.enable()
    steps, _ = decode(engine, 64)
    profile.disable()
    stats = pstats.Stats(profile).stats
    builtin = {}
    for (file, _, name), (_, calls, tottime, _, _) in stats.items():
        if file == "~" and tottime > 0:
            builtin[name] = {"calls_per_step": calls / steps, "ms_per_step": 1e3 * tottime / steps}
    total = sum(s[2] for s in stats.values())
    kernels = sum(v["ms_per_step"] for k, v in builtin.items() if "qtoolkit_" in k)
    top = dict(sorted(builtin.items(), key=lambda kv: -kv[1]["ms_per_step"])[:12])
    report = {"model": sys.argv[1], "fused_decode": os.environ.get("QTOOLKIT_FUSED_DECODE", "1"),
              "cpu_ms_per_step_unprofiled": plain, "profiled_ms_per_step": 1e3 * total / steps,
              "python_calls_per_step": sum(s[1] for s in stats.values()) / steps,
              "kernel_ms_per_step": kernels, "outside_kernels_ms_per_step": 1e3 * total / steps - kernels,
              "top_builtins": top, "load_average": os.getloadavg()}
    with open(sys.argv[2], "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "top_builtins"}))


if __name__ == "__main__":
    main()
