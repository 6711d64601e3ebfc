"""The values the bench modules hand each other: one request, one request's result, and the `Workload` protocol
that built-in workloads (workloads.py) and workload files (workload_files.py) both implement.

They live apart from the modules that make and send requests so that those modules import only downward:
types <- workloads, vllm_names <- load_client <- workload_files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..engine.params import SpeculativeUsage


@dataclass(frozen=True)
class BenchRequest:
    index: int
    kind: str  # "code" | "summarization" | a workload file's "completion" | "chat"
    prompt: str  # a chat request's messages as JSON (its identity; the messages are sent as they are)
    max_tokens: int
    messages: tuple[dict[str, str], ...] | None = None  # a chat request, sent to /v1/chat/completions
    item: str | None = None  # a workload file's item, "STEM/ID"


@dataclass
class RequestResult:
    index: int
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds from send to the first generated text
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    error: str | None = None
    speculative: SpeculativeUsage | None = None  # the server's per-request speculative decoding figures, if any
    status: int | None = None  # the HTTP status of a refused request
    retry_after: str | None = None  # its Retry-After header
    retries: int = 0  # 429/503 answers waited out before this result
    sent_at: float = 0.0  # seconds from the run's start to this request's send (saturation reads arrivals)


@runtime_checkable
class Workload(Protocol):
    """Benchmark traffic: seeded requests, a JSON description for the report, and (for traffic whose answer
    lengths are not known in advance) a reference server to measure them on."""

    def requests(self, n: int, *, seed: int, max_output_tokens: int,
                 mean_output_tokens: int = 64) -> list[BenchRequest]:
        """n requests; the same seed gives the same requests."""
        ...

    def describe(self) -> Any:
        """What the report's `config.workload` holds (a built-in's name, a file's paths and hashes)."""
        ...

    def attach_length_probe(self, url: str, model: str, *, name: str, api_key: str | None = None) -> None:
        """Measure answer lengths the traffic does not fix on the server at `url`; a no-op when all are fixed."""
        ...
