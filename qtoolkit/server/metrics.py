"""Prometheus metrics for the server, in a registry of its own (several apps can live in one process)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets sized for a CPU engine: first tokens take tens of ms to seconds, a token 5 ms to a second.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_RATE_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("qtool_requests_running", "Requests the engine is running", registry=r)
        self.waiting = Gauge("qtool_requests_waiting", "Requests queued in the engine", registry=r)
        self.in_flight = Gauge("qtool_requests_in_flight", "Admitted requests not yet finished", registry=r)
        self.kv_used = Gauge("qtool_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_free = Gauge("qtool_kv_blocks_free", "KV cache blocks free", registry=r)
        self.kv_total = Gauge("qtool_kv_blocks_total", "KV cache blocks in total", registry=r)
        self.preemptions = Gauge("qtool_preemptions", "Sequences preempted since start", registry=r)
        self.tokens_per_s = Gauge("qtool_generation_tokens_per_second",
                                  f"Generated tokens per second over the last {_RATE_WINDOW_S:.0f} s", registry=r)
        self.tokens_per_s.set_function(self._recent_rate)
        self.prompt_tokens = Counter("qtool_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("qtool_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("qtool_requests_finished", "Finished requests by reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("qtool_requests_rejected", "Requests answered with an error, by status",
                                ["status"], registry=r)
        self.ttft = Histogram("qtool_time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("qtool_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("qtool_e2e_request_latency_seconds", "Request latency", buckets=_E2E_BUCKETS,
                             registry=r)
        self.spec_draft = Gauge("qtool_spec_draft_tokens", "Speculative tokens proposed and verified", registry=r)
        self.spec_accepted = Gauge("qtool_spec_accepted_tokens", "Speculative tokens accepted", registry=r)
        self.spec_rate = Gauge("qtool_spec_acceptance_rate", "Accepted / proposed speculative tokens", registry=r)
        self.spec_length = Gauge("qtool_spec_mean_accepted_length", "Tokens emitted per verification",
                                 registry=r)
        self.spec_position = Gauge("qtool_spec_acceptance_by_position", "Acceptance rate of the i-th draft token",
                                   ["position"], registry=r)
        self.spec_seconds = Gauge("qtool_spec_seconds", "Time spent proposing and verifying", ["phase"], registry=r)
        # counts as well as rates, so a client can difference two scrapes (e.g. one bench tier)
        self.spec_position_count = Gauge("qtool_spec_position_tokens", "Draft tokens at the i-th position",
                                         ["position", "outcome"], registry=r)
        self.spec_steps = Gauge("qtool_spec_decode_steps", "Decode steps with and without proposals", ["kind"],
                                registry=r)
        self.spec_verifications = Gauge("qtool_spec_verifications", "Sequence verifications carrying proposals",
                                        registry=r)
        self.spec_draft_cost = Gauge("qtool_spec_draft_cost_ratio",
                                     "Policy estimate: one draft step / one verification forward", registry=r)
        self.spec_verify_cost = Gauge("qtool_spec_verify_cost_per_token",
                                      "Policy estimate: a plain step's extra time per verified draft token",
                                      registry=r)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()  # the engine thread appends, the scrape reads

    def record_step(self, new_tokens: int, stats: dict[str, Any]) -> None:
        """Called by the engine thread after each step."""
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            with self._lock:
                self._recent.append((time.monotonic(), new_tokens))
        self.record_stats(stats)

    def record_stats(self, stats: dict[str, Any]) -> None:
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.kv_used.set(stats.get("kv_blocks_used", 0))
        self.kv_free.set(stats.get("kv_blocks_free", 0))
        self.kv_total.set(stats.get("kv_blocks_total", 0))
        self.preemptions.set(stats.get("num_preemptions", 0))
        spec = stats.get("speculative")
        if spec:
            self.spec_draft.set(spec["draft_tokens"])
            self.spec_accepted.set(spec["accepted_tokens"])
            self.spec_rate.set(spec["acceptance_rate"])
            self.spec_length.set(spec["mean_accepted_length"])
            for i, rate in enumerate(spec["acceptance_by_position"]):
                self.spec_position.labels(str(i + 1)).set(rate)
            self.spec_seconds.labels("propose").set(spec["proposer_seconds"])
            self.spec_seconds.labels("verify").set(spec["verify_seconds"])
            for i, (proposed, accepted) in enumerate(zip(spec["proposed_at"], spec["accepted_at"], strict=True)):
                self.spec_position_count.labels(str(i + 1), "proposed").set(proposed)
                self.spec_position_count.labels(str(i + 1), "accepted").set(accepted)
            self.spec_steps.labels("speculative").set(spec["steps_with_speculation"])
            self.spec_steps.labels("plain").set(spec["steps_without_speculation"])
            self.spec_verifications.set(spec["verify_steps"])
            self.spec_draft_cost.set(spec.get("draft_cost_ratio", 0.0))
            self.spec_verify_cost.set(spec.get("verify_cost_per_token", 0.0))

    def record_finished(self, finish_reason: str, ttft: float | None, latency: float, num_tokens: int) -> None:
        self.finished.labels(finish_reason).inc()
        self.e2e.observe(latency)
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_tokens > 1:
                self.tpot.observe((latency - ttft) / (num_tokens - 1))

    def _recent_rate(self) -> float:
        cutoff = time.monotonic() - _RATE_WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < cutoff:
                self._recent.popleft()
            total = sum(n for _, n in self._recent)
        return total / _RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)
