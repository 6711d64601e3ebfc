"""How much continuous batching can buy over static batching on this machine: a replay on the measured step cost.

Static batching runs a batch until its longest request ends, so late in a batch few sequences share each step;
continuous batching refills the freed slots at once. What that is worth depends on how a decode step's time
grows with the batch: on a GPU a step of 32 costs about what a step of 1 does (the weights are read once, the
compute is idle), so idle slots waste most of the step; on a small CPU the step's time grows almost linearly
with the batch, so a half-empty step is also about half as expensive and little is wasted.

`batching_ceiling` replays a workload's output lengths through both schedules with the decode step times
measured by `qtool diagnose` (linear between the measured batch sizes) and returns the ratio of the two
decode times. Prefill and scheduling overheads are left out (they are the same or worse for continuous
batching), so this is an upper bound on continuous / static output tok/s for that workload and concurrency.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np


def step_time_curve(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """Decode step seconds at any batch size from (batch, seconds) measurements: linear in between, the last
    segment's slope beyond the largest batch measured, the first measured time below the smallest."""
    pts = sorted(points)
    xs = np.array([p[0] for p in pts], dtype=float)
    ys = np.array([p[1] for p in pts], dtype=float)

    def at(b: int) -> float:
        if b <= xs[0]:
            return float(ys[0])
        if len(xs) == 1:
            return float(ys[0] * b / xs[0])
        if b <= xs[-1]:
            return float(np.interp(b, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (b - xs[-1]))

    return at


def static_decode_seconds(lengths: Sequence[int], concurrency: int, step: Callable[[int], float]) -> float:
    """Batches of `concurrency` in arrival order; each runs until its longest request is done."""
    total = 0.0
    for i in range(0, len(lengths), concurrency):
        batch = sorted(lengths[i:i + concurrency])
        done = 0
        for j, n in enumerate(batch):  # between consecutive finishes, len(batch) - j sequences share each step
            total += (n - done) * step(len(batch) - j)
            done = n
    return total


def continuous_decode_seconds(lengths: Sequence[int], concurrency: int, step: Callable[[int], float]) -> float:
    """Up to `concurrency` running; a finished request's slot goes to the next waiting one at the next step."""
    pending = list(lengths)[::-1]
    finish: list[int] = []  # step index at which each running request finishes
    now, total = 0, 0.0
    while pending or finish:
        while pending and len(finish) < concurrency:
            heapq.heappush(finish, now + pending.pop())
        nxt = finish[0]
        total += (nxt - now) * step(len(finish))
        now = nxt
        while finish and finish[0] == now:
            heapq.heappop(finish)
    return total


def batching_ceiling(lengths: Sequence[int], concurrency: int, step: Callable[[int], float]) -> float:
    """Upper bound of continuous / static output tok/s: the same tokens, static time over continuous time."""
    return static_decode_seconds(lengths, concurrency, step) / continuous_decode_seconds(lengths, concurrency, step)
