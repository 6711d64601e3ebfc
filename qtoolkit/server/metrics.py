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
from prometheus_client.parser import text_string_to_metric_families

from ..engine.stats import EngineStats, SpeculativeStats

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
        self.stats = EngineStats()  # replaced whole by the engine thread, read by the collector
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

    def record_step(self, new_tokens: int, stats: EngineStats) -> None:
        """Called by the engine thread after each step."""
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            self.rate.add(new_tokens)
        self.record_stats(stats)

    def record_stats(self, stats: EngineStats) -> None:
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
        yield _gauge("vllm:num_requests_running", "Requests the engine is running", st.num_running)
        yield _gauge("vllm:num_requests_waiting", "Requests queued in the engine", st.num_waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)", st.kv_cache_usage)
        yield _gauge("qtool_requests_in_flight", "Admitted requests not yet finished", self.in_flight())
        yield _gauge("qtool_engine_up", "1 while the engine loop runs and admits requests", int(self.engine_up()))
        yield _gauge("qtool_kv_blocks_used", "KV cache blocks in use", st.kv_blocks_used)
        yield _gauge("qtool_kv_blocks_free", "KV cache blocks free", st.kv_blocks_free)
        yield _gauge("qtool_kv_blocks_total", "KV cache blocks in total", st.kv_blocks_total)
        yield _gauge("qtool_kv_cache_capacity_tokens", f"Tokens the KV cache holds ({st.kv_cache_dtype} storage)",
                     st.kv_capacity_tokens)
        yield _gauge("qtool_kv_cache_bytes_per_token", "KV cache bytes one token costs over all layers, scales included",
                     st.kv_bytes_per_token)
        yield _gauge("qtool_generation_tokens_per_second",
                     f"Generated tokens per second over the last {_RATE_WINDOW_S} s", self.metrics.rate.rate())
        yield _gauge("qtool_engine_static_batching", "1 while the engine batches statically (a batch starts only when "
                     "the previous one ended), 0 while it batches continuously", int(st.batching == "static"))
        yield _counter("vllm:num_preemptions", "Sequences preempted since start", st.num_preemptions)
        yield _counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                       st.prefix_cache_hit_tokens)
        if st.speculative is not None:
            yield from _speculative(st.speculative)


# SpeculativeStats' scalar fields as qtool_spec_* families: (field, name, kind, help). The collector renders them
# and `parse_speculative` reads them back, both from this table, so a rename is one line.
_SPEC_SCALARS = [
    ("draft_tokens", "qtool_spec_draft_tokens", "counter", "Speculative tokens proposed and verified"),
    ("accepted_tokens", "qtool_spec_accepted_tokens", "counter", "Speculative tokens accepted"),
    ("verify_steps", "qtool_spec_verifications", "counter", "Sequence verifications carrying proposals"),
    ("draft_cost_ratio", "qtool_spec_draft_cost_ratio", "gauge",
     "Policy estimate: one draft step / one verification forward"),
    ("verify_cost_per_token", "qtool_spec_verify_cost_per_token", "gauge",
     "Policy estimate: a plain step's extra time per verified draft token"),
]
# labelled families: (name, label, {label value: field})
_SPEC_SECONDS = ("qtool_spec_seconds", "phase", {"propose": "proposer_seconds", "verify": "verify_seconds"})
_SPEC_STEPS = ("qtool_spec_decode_steps", "kind",
               {"speculative": "steps_with_speculation", "plain": "steps_without_speculation"})
_SPEC_POSITIONS = "qtool_spec_position_tokens"
# per batch size (decoding sequences in a step): steps and the draft tokens the policy gave them, and the mean
# draft length per sequence that makes (vLLM's num_speculative_tokens_per_batch_size, as chosen at run time)
_SPEC_BATCH = ("qtool_spec_batch_steps", "qtool_spec_batch_draft_tokens", "qtool_spec_chosen_draft_length")


def _speculative(spec: SpeculativeStats) -> Iterator[Metric]:
    yield _counter("vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed and verified",
                   spec.draft_tokens)
    yield _counter("vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted", spec.accepted_tokens)
    for attr, name, kind, doc in _SPEC_SCALARS:
        yield (_counter if kind == "counter" else _gauge)(name, doc, getattr(spec, attr))
    yield _gauge("qtool_spec_acceptance_rate", "Accepted / proposed speculative tokens", spec.acceptance_rate)
    yield _gauge("qtool_spec_mean_accepted_length", "Tokens emitted per verification", spec.mean_accepted_length)
    by_pos = GaugeMetricFamily("qtool_spec_acceptance_by_position", "Acceptance rate of the i-th draft token",
                               labels=["position"])
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by "
                                  "position", labels=["position"])
    counts = CounterMetricFamily(_SPEC_POSITIONS, "Draft tokens at the i-th position",
                                 labels=["position", "outcome"])
    for i, rate in enumerate(spec.acceptance_by_position):
        by_pos.add_metric([str(i + 1)], rate)
    for i, (proposed, accepted) in enumerate(zip(spec.proposed_at, spec.accepted_at, strict=True)):
        counts.add_metric([str(i + 1), "proposed"], proposed)
        counts.add_metric([str(i + 1), "accepted"], accepted)
        per_pos.add_metric([str(i + 1)], accepted)
    yield from (by_pos, per_pos, counts)
    steps = CounterMetricFamily(_SPEC_BATCH[0], "Decode steps by batch size", labels=["batch_size"])
    drafts = CounterMetricFamily(_SPEC_BATCH[1], "Draft tokens proposed by batch size", labels=["batch_size"])
    chosen = GaugeMetricFamily(_SPEC_BATCH[2], "Mean draft length per sequence the policy chose, by batch size",
                               labels=["batch_size"])
    for n, length in spec.chosen_length_by_batch.items():
        steps.add_metric([str(n)], spec.steps_by_batch[n])
        drafts.add_metric([str(n)], spec.drafts_by_batch.get(n, 0))
        chosen.add_metric([str(n)], length)
    yield from (steps, drafts, chosen)
    for (name, label, fields), doc in ((_SPEC_SECONDS, "Time spent proposing and verifying"),
                                       (_SPEC_STEPS, "Decode steps with and without proposals")):
        family = CounterMetricFamily(name, doc, labels=[label])
        for value, attr in fields.items():
            family.add_metric([value], getattr(spec, attr))
        yield family


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one /metrics scrape by (sample name, sorted labels): the one reader of Prometheus text
    (prometheus_client's parser) that benchmarks and tests go through."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def parse_speculative(text: str) -> SpeculativeStats | None:
    """The engine's speculative counters from one /metrics scrape of a qtool server; None when it does not
    speculate (or is not ours). The one reader of this exporter's text (spec_ceiling.py differences two)."""
    values: dict[str, Any] = {}
    positions: dict[tuple[int, str], float] = {}
    by_batch: dict[str, dict[int, int]] = {_SPEC_BATCH[0] + "_total": {}, _SPEC_BATCH[1] + "_total": {}}
    # a counter's value is exposed as the sample NAME_total, a gauge's as NAME
    scalars = {name + "_total" * (kind == "counter"): attr for attr, name, kind, _ in _SPEC_SCALARS}
    labelled = {name + "_total": (label, fields) for name, label, fields in (_SPEC_SECONDS, _SPEC_STEPS)}
    for (name, labels), value in samples(text).items():
        tags = dict(labels)
        if name in scalars:
            values[scalars[name]] = value
        elif name in labelled:
            label, fields = labelled[name]
            values[fields[tags[label]]] = value
        elif name == _SPEC_POSITIONS + "_total":
            positions[int(tags["position"]), tags["outcome"]] = value
        elif name in by_batch:
            by_batch[name][int(tags["batch_size"])] = int(value)
    # the labelled samples appear once the engine has reported speculation; a plain server shows none
    if "verify_seconds" not in values:
        return None
    depth = max((p for p, _ in positions), default=0)
    counts = {k: int(v) for k, v in values.items() if k in ("draft_tokens", "accepted_tokens", "verify_steps",
                                                             "steps_with_speculation", "steps_without_speculation")}
    return SpeculativeStats(**{**values, **counts},
                            proposed_at=[int(positions.get((p, "proposed"), 0)) for p in range(1, depth + 1)],
                            accepted_at=[int(positions.get((p, "accepted"), 0)) for p in range(1, depth + 1)],
                            steps_by_batch=by_batch[_SPEC_BATCH[0] + "_total"],
                            drafts_by_batch=by_batch[_SPEC_BATCH[1] + "_total"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
