"""The continuous / static ceiling: both schedules replayed by hand on small cases, and the two cost regimes."""

from __future__ import annotations

import pytest

from qtoolkit.diagnose.batching_ceiling import (
    batching_ceiling,
    continuous_decode_seconds,
    static_decode_seconds,
    step_time_curve,
)
from qtoolkit.diagnose.result import DecodeRow, KVCapacity, ModelBytes, Roofline
from qtoolkit.diagnose.run import classify, continuous_batching_ceiling


def test_schedules_by_hand():
    lengths = [1, 3, 1, 3]
    flat = lambda b: 1.0  # noqa: E731 - a step costs the same at any batch (a GPU's decode)
    # static: two batches of [1, 3], each runs 3 steps; continuous: the slot freed at step 1 takes the next request
    assert static_decode_seconds(lengths, 2, flat) == 6.0
    assert continuous_decode_seconds(lengths, 2, flat) == 5.0
    assert batching_ceiling(lengths, 2, flat) == pytest.approx(1.2)
    # a step whose time is proportional to the batch costs the same per token either way: no gain
    linear = lambda b: 0.5 * b  # noqa: E731
    assert static_decode_seconds(lengths, 2, linear) == 4.0 == continuous_decode_seconds(lengths, 2, linear)
    assert continuous_decode_seconds([2, 2, 2], 1, flat) == 6.0  # one slot: requests run back to back


def test_step_time_curve_interpolates_and_extrapolates():
    step = step_time_curve([(1, 0.02), (8, 0.05), (16, 0.09)])
    assert step(1) == 0.02 and step(8) == 0.05
    assert step(12) == pytest.approx(0.07)
    assert step(32) == pytest.approx(0.09 + 16 * 0.005)  # the last segment's slope
    assert step_time_curve([(4, 0.04)])(8) == pytest.approx(0.08)  # one point: proportional


def test_diagnose_ceiling_tracks_the_cost_curve():
    def rows(ms):
        return [DecodeRow(batch=b, decode_seconds=0.0, tokens_per_s=b / ms(b) * 1000, ms_per_step=ms(b))
                for b in (1, 8, 32)]

    gpu = continuous_batching_ceiling(rows(lambda b: 20.0 + 0.05 * b))["by_concurrency"]
    cpu_like = rows(lambda b: 1.0 * b)
    cpu = continuous_batching_ceiling(cpu_like)["by_concurrency"]
    assert [r["concurrency"] for r in gpu] == [8, 32]
    assert all(r["continuous_over_static"] > 1.3 for r in gpu)
    assert all(r["continuous_over_static"] == pytest.approx(1.0) for r in cpu)
    decode = [DecodeRow(batch=1, decode_seconds=0.0, tokens_per_s=10.0, ms_per_step=100.0),
              DecodeRow(batch=32, decode_seconds=0.0, tokens_per_s=60.0, ms_per_step=533.0)]
    roof = {1: Roofline(decode_memory_bound_tok_s=50, compute_bound_tok_s=100, decode_attainable_tok_s=50)}
    kv = KVCapacity(bytes_per_token=0, blocks=0, block_size=16, context=1024, max_concurrent_at_context=64)
    sizes = ModelBytes(linear_bytes=0, lm_head_bytes=0, decode_bytes_per_step=int(5e8), matmul_weights=0)
    levers = classify(decode, roof, kv, sizes, continuous_batching_ceiling(cpu_like))[1]
    assert "bound continuous / static at 1.00x at concurrency 32" in levers[0]
