"""Prometheus metrics for the server, in a registry of its own (several apps can live in one process).

Names follow vLLM's (`vllm:prompt_tokens_total`, `vllm:num_requests_running`, ...) wherever vLLM has the same
quantity, so a dashboard built for vLLM reads this server unchanged; the rest are `qtool_*`. Totals are
counters (rate() works on them); the engine's state is read at scrape time by a collector from the last stats
snapshot the engine thread left, so a step costs one reference assignment, however often /metrics is scraped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Buckets sized for a CPU engine: first tokens take tens of ms to seconds, a token 5 ms to a second.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_RATE_WINDOW_S = 10


class TokenRate:
    """Tokens per second over the last window, from per-second buckets: at most window + 1 entries."""

    def __init__(self, window_s: int = _RATE_WINDOW_S):
        self.window_s = window_s
        self._buckets: deque[list[int]] = deque(maxlen=window_s + 1)  # [second, tokens]
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        second = int(time.monotonic())
        with self._lock:
            if self._buckets and self._buckets[-1][0] == second:
                self._buckets[-1][1] += n
            else:
                self._buckets.append([second, n])

    def rate(self) -> float:
        cutoff = int(time.monotonic()) - self.window_s
        with self._lock:
            return sum(n for s, n in self._buckets if s > cutoff) / self.window_s


class ServerMetrics:
    def __init__(self, in_flight: Callable[[], int] = lambda: 0, engine_up: Callable[[], bool] = lambda: True):
        self.registry = CollectorRegistry()
        r = self.registry
        self.stats: dict[str, Any] = {}  # replaced whole by the engine thread, read by the collector
        self.rate = TokenRate()
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("vllm:request_success", "Finished requests by reason", ["finished_reason"],
                                registry=r)
        self.rejected = Counter("qtool_requests_rejected", "Requests answered with an error, by status",
                                ["status"], registry=r)
        self.loop_failures = Counter("qtool_engine_loop_failures", "Engine loop iterations that raised",
                                     registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency", buckets=_E2E_BUCKETS,
                             registry=r)
        r.register(_EngineCollector(self, in_flight, engine_up))

    def record_step(self, new_tokens: int, stats: dict[str, Any]) -> None:
        """Called by the engine thread after each step."""
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            self.rate.add(new_tokens)
        self.record_stats(stats)

    def record_stats(self, stats: dict[str, Any]) -> None:
        self.stats = stats

    def record_loop_failure(self) -> None:
        self.loop_failures.inc()

    def record_finished(self, finish_reason: str, ttft: float | None, latency: float, num_tokens: int) -> None:
        self.finished.labels(finish_reason).inc()
        self.e2e.observe(latency)
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_tokens > 1:
                self.tpot.observe((latency - ttft) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's state as of its last step, turned into metric families when /metrics is scraped."""

    def __init__(self, metrics: ServerMetrics, in_flight: Callable[[], int], engine_up: Callable[[], bool]):
        self.metrics, self.in_flight, self.engine_up = metrics, in_flight, engine_up

    def collect(self) -> Iterator[Metric]:
        st = self.metrics.stats
        total, used = st.get("kv_blocks_total", 0), st.get("kv_blocks_used", 0)
        yield _gauge("vllm:num_requests_running", "Requests the engine is running", st.get("num_running", 0))
        yield _gauge("vllm:num_requests_waiting", "Requests queued in the engine", st.get("num_waiting", 0))
        yield _gauge("vllm:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)", used / total if total else 0)
        yield _gauge("qtool_requests_in_flight", "Admitted requests not yet finished", self.in_flight())
        yield _gauge("qtool_engine_up", "1 while the engine loop runs and admits requests", int(self.engine_up()))
        yield _gauge("qtool_kv_blocks_used", "KV cache blocks in use", used)
        yield _gauge("qtool_kv_blocks_free", "KV cache blocks free", st.get("kv_blocks_free", 0))
        yield _gauge("qtool_kv_blocks_total", "KV cache blocks in total", total)
        yield _gauge("qtool_generation_tokens_per_second",
                     f"Generated tokens per second over the last {_RATE_WINDOW_S} s", self.metrics.rate.rate())
        yield _counter("vllm:num_preemptions", "Sequences preempted since start", st.get("num_preemptions", 0))
        yield _counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                       st.get("prefix_cache_hit_tokens", 0))
        spec = st.get("speculative")
        if spec:
            yield from _speculative(spec)


def _speculative(spec: dict[str, Any]) -> Iterator[Metric]:
    yield _counter("vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed and verified",
                   spec["draft_tokens"])
    yield _counter("vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted", spec["accepted_tokens"])
    # the qtool_spec_* families are what spec_ceiling.py differences between two scrapes
    yield _counter("qtool_spec_draft_tokens", "Speculative tokens proposed and verified", spec["draft_tokens"])
    yield _counter("qtool_spec_accepted_tokens", "Speculative tokens accepted", spec["accepted_tokens"])
    yield _gauge("qtool_spec_acceptance_rate", "Accepted / proposed speculative tokens", spec["acceptance_rate"])
    yield _gauge("qtool_spec_mean_accepted_length", "Tokens emitted per verification", spec["mean_accepted_length"])
    by_pos = GaugeMetricFamily("qtool_spec_acceptance_by_position", "Acceptance rate of the i-th draft token",
                               labels=["position"])
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by "
                                  "position", labels=["position"])
    counts = CounterMetricFamily("qtool_spec_position_tokens", "Draft tokens at the i-th position",
                                 labels=["position", "outcome"])
    for i, rate in enumerate(spec["acceptance_by_position"]):
        by_pos.add_metric([str(i + 1)], rate)
    for i, (proposed, accepted) in enumerate(zip(spec["proposed_at"], spec["accepted_at"], strict=True)):
        counts.add_metric([str(i + 1), "proposed"], proposed)
        counts.add_metric([str(i + 1), "accepted"], accepted)
        per_pos.add_metric([str(i + 1)], accepted)
    yield from (by_pos, per_pos, counts)
    seconds = CounterMetricFamily("qtool_spec_seconds", "Time spent proposing and verifying", labels=["phase"])
    seconds.add_metric(["propose"], spec["proposer_seconds"])
    seconds.add_metric(["verify"], spec["verify_seconds"])
    steps = CounterMetricFamily("qtool_spec_decode_steps", "Decode steps with and without proposals",
                                labels=["kind"])
    steps.add_metric(["speculative"], spec["steps_with_speculation"])
    steps.add_metric(["plain"], spec["steps_without_speculation"])
    yield from (seconds, steps)
    yield _counter("qtool_spec_verifications", "Sequence verifications carrying proposals", spec["verify_steps"])
    yield _gauge("qtool_spec_draft_cost_ratio", "Policy estimate: one draft step / one verification forward",
                 spec.get("draft_cost_ratio", 0.0))
    yield _gauge("qtool_spec_verify_cost_per_token",
                 "Policy estimate: a plain step's extra time per verified draft token",
                 spec.get("verify_cost_per_token", 0.0))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
