"""Where a batch-1 decode token's time goes in the engine, against the DRAM roofline (`qtool bench decode`).

One extra greedy decode per engine checkpoint, after the timed rounds, with timers on: the engine step's wall
time per decode step is split into
- weight GEMV: every Linear of the layers and the LM head (in the C++ layer loop its own timers, else timers
  around each Linear's forward);
- attention: RoPE, the KV-cache append and paged attention;
- other ops: everything else inside the model's forward (norms, SwiGLU, the embedding gather, glue);
- host overhead: the engine step outside the forward (scheduling, batch preparation, sampling, detokenizing).
The roofline is the tok/s at which a step would only stream its weights once at the DRAM bandwidth measured as
`qtool diagnose` measures it (kernels/roofline.measure_bandwidth); the fraction is achieved / roofline. A token
also reads the KV cache of every position before it, which a long prompt makes as large as the weights (2k tokens
of the default model's fp32 cache: 94 MB a token), so the breakdown also states those bytes and the fraction of
the roofline of weights and cache together.

RooflineRounds sets each timed round's rate against the bandwidth measured at the start of that round (a shared
machine's bandwidth moves by half within minutes, so one probe before or after says little of the rounds), and
against the read rate of a buffer as large as a token's weights: where the last-level cache holds a share of them
(480 MiB on some Xeons) the DRAM roofline is no hard ceiling, and that second fraction says how far off the
attainable rate the decode is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from ..diagnose.run import model_bytes
from ..engine import Engine, SamplingParams
from ..model.decode_plan import DecodePlan


@dataclass
class DecodeBreakdown:
    steps: int
    ms_per_token: float  # mean wall time of a batch-1 decode step (one token): the sum of the four parts
    gemv_ms: float
    attention_ms: float
    other_ms: float
    host_ms: float
    layer_loop: str  # "c++" (model/decode_plan.py) or "python"
    weight_bytes_per_token: int
    bandwidth_gb_s: float
    roofline_tok_s: float
    roofline_fraction: float  # (1000 / ms_per_token) / roofline_tok_s
    kv_bytes_per_token: int = 0  # the KV cache a token reads: cache bytes a position x the mean context
    roofline_fraction_with_kv: float = 0.0  # as roofline_fraction, for the weights and that cache read

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RooflineRounds:
    weight_bytes_per_token: int
    bandwidth_gb_s: list[float]  # DRAM read bandwidth at the start of each round
    fractions: list[float]  # each round's tok/s over the roofline at that round's bandwidth
    median_fraction: float
    working_set_bandwidth_gb_s: float  # the read rate of a buffer as large as a token's weights, caches included
    working_set_fraction: float  # the median tok/s over the roofline at that rate

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def roofline_rounds(rates: list[float], bandwidths: list[float], weight_bytes: int,
                    working_set_bandwidth_gb_s: float) -> RooflineRounds:
    """Round-paired roofline fractions of one system's decode rates (tok/s), as the module docstring says."""
    fractions = [round(r * weight_bytes / (bw * 1e9), 3) for r, bw in zip(rates, bandwidths, strict=True)]
    working_set = statistics.median(rates) * weight_bytes / (working_set_bandwidth_gb_s * 1e9)
    return RooflineRounds(weight_bytes, bandwidths, fractions, round(statistics.median(fractions), 3),
                          round(working_set_bandwidth_gb_s, 2), round(working_set, 3))


def format_roofline(name: str, r: RooflineRounds) -> str:
    return (f"{name}: {r.weight_bytes_per_token / 1e6:.1f} MB/token; DRAM roofline reached per round "
            + ", ".join(f"{100 * f:.0f}%" for f in r.fractions)
            + f" (median {100 * r.median_fraction:.0f}%, at {min(r.bandwidth_gb_s):.1f}-{max(r.bandwidth_gb_s):.1f}"
              f" GB/s); against a buffer of that size ({r.working_set_bandwidth_gb_s:.1f} GB/s, caches included) "
              f"{100 * r.working_set_fraction:.0f}%")


class _Timers:
    def __init__(self):
        self.gemv = self.attention = self.attention_linears = self.forward = 0.0
        self.wrapped: list = []

    def wrap(self, module, field: str) -> None:
        """Time `module.forward` into `field` (an instance attribute shadows the class's method)."""
        inner = module.forward

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t)

        module.__dict__["forward"] = timed
        self.wrapped.append(module)


@contextmanager
def _instrumented(model) -> Iterator[_Timers]:
    timers = _Timers()
    timers.wrap(model, "forward")
    timers.wrap(model.lm_head, "gemv")
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj):
            timers.wrap(lin, "attention_linears")
        timers.wrap(attn, "attention")
        for lin in (getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)):
            if lin is not None:
                timers.wrap(lin, "gemv")
    try:
        yield timers
    finally:
        for module in timers.wrapped:
            module.__dict__.pop("forward", None)


def _timed_steps(engine: Engine) -> list[float]:
    walls = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    return walls


def measure_breakdown(engine: Engine, prompt: str, tokens: int, bandwidth_gb_s: float) -> DecodeBreakdown:
    """One timed greedy decode of `tokens` tokens at batch 1, split as the module docstring says."""
    model = engine.model
    engine.add_request("decode-breakdown", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    engine.step()  # the prefill step is not a decode step
    engine.step()  # the first decode step binds the C++ plan
    plan = model.decode_plan
    if isinstance(plan, DecodePlan):
        plan.plan.reset_times()
    with _instrumented(model) as timers:
        walls = _timed_steps(engine)
    plan = model.decode_plan
    fused = isinstance(plan, DecodePlan) and plan.plan.times()[0] > 0
    gemv, attention = timers.gemv, timers.attention - timers.attention_linears
    gemv += timers.attention_linears
    other = timers.forward - gemv - attention
    if fused:
        loop_gemv, loop_attention, _ = plan.plan.times()
        gemv += loop_gemv
        attention += loop_attention
        other -= loop_gemv + loop_attention
    n = len(walls)
    per_token = statistics.fmean(walls)
    weight_bytes = model_bytes(model).decode_bytes_per_step
    roof = bandwidth_gb_s * 1e9 / weight_bytes
    # step i of the timed ones attends over the prompt and the 2 + i tokens decoded before it
    context = len(engine.tokenizer(prompt).input_ids) + 2 + (n - 1) / 2
    kv_bytes = round(engine.kv_bytes_per_token * context)
    ms = 1e3 / n
    return DecodeBreakdown(
        steps=n, ms_per_token=round(1e3 * per_token, 3), gemv_ms=round(gemv * ms, 3),
        attention_ms=round(attention * ms, 3), other_ms=round(other * ms, 3),
        host_ms=round((sum(walls) - timers.forward) * ms, 3), layer_loop="c++" if fused else "python",
        weight_bytes_per_token=weight_bytes, bandwidth_gb_s=round(bandwidth_gb_s, 2), roofline_tok_s=round(roof, 1),
        roofline_fraction=round(1.0 / per_token / roof, 3), kv_bytes_per_token=kv_bytes,
        roofline_fraction_with_kv=round((weight_bytes + kv_bytes) / per_token / (bandwidth_gb_s * 1e9), 3))


def format_breakdown(name: str, b: DecodeBreakdown) -> str:
    return (f"{name}: {b.ms_per_token:.2f} ms/token ({b.layer_loop} layer loop) = GEMV {b.gemv_ms:.2f} + "
            f"attention {b.attention_ms:.2f} + other ops {b.other_ms:.2f} + host {b.host_ms:.2f} ms; "
            f"{b.weight_bytes_per_token / 1e6:.1f} MB/token at {b.bandwidth_gb_s:.1f} GB/s: roofline "
            f"{b.roofline_tok_s:.0f} tok/s, reached {100 * b.roofline_fraction:.0f}%; with the KV cache read "
            f"({b.kv_bytes_per_token / 1e6:.1f} MB/token) {100 * b.roofline_fraction_with_kv:.0f}%")
