"""One tier's figures as a type: TTFT, TPOT, ITL and E2EL distributions (mean, p50, p90, p99, measured from the
stream as a user sees it), throughput, goodput under an SLO and whether the server kept up with the offered load.

Definitions are vLLM's (`vllm bench serve`): TPOT is (latency - TTFT) / (output tokens - 1) per request with more
than one token, ITL every gap between streamed chunks, E2EL the whole request; goodput the completed requests per
second that meet every SLO (`--goodput ttft:MS tpot:MS`, vllm/benchmarks/serve.py). Saturation is qtoolkit's: an
open-loop run whose completions come out slower than the requests arrive, or whose waits grow over the run, is
past what the server carries (GuideLLM calls it over-saturation), and its latencies measure the queue's length,
not the server: a sweep reports such a rate as saturated instead of averaging it in.

A `TierSummary` is what every bench hands on for one system at one tier: the load client's figures, and beside them
what the bench that measured it adds (the engine's speculation, its ceiling, the endpoint that served it, the KV
cache's figures, HF generate's static batches). On disk it is one flat JSON object per system and tier, the shape
bench JSONs have always had; `from_json` reads older ones too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..engine.params import SpeculativeUsage
from ..errors import QToolError
from .spec_ceiling import SpeculationCeiling, TierSpeculation
from .types import RequestResult
from .vllm_names import is_vllm_metric

# an open-loop run is saturated when completions leave at under this share of the offered rate ...
MIN_ACHIEVED_SHARE = 0.85
# ... or when the median TTFT of the last third of arrivals is this many times the first third's (and 50 ms more),
MAX_TTFT_GROWTH = 2.0
MIN_TTFT_GROWTH_S = 0.05
# ... either one only with TTFT rising with the arrival order (Kendall's tau, one-sided p below this): a sign-off's
# 16-request probe of mixed prompts (short code, long documents) met one of the two by chance alone at a third of
# the server's capacity (measurements/2026-12-05/issue40d/README.md), while a queue that builds raises every later
# arrival's wait, a trend no shuffle of request sizes gives
MAX_TREND_P = 0.01


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency over a tier's requests, seconds; all None when nothing was measured."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls()
        a = np.asarray(values, dtype=float)
        p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
        return cls(float(a.mean()), p50, p90, p99)

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> Distribution:
        d = d or {}
        return cls(d.get("mean"), d.get("p50"), d.get("p90"), d.get("p99"))


@dataclass(frozen=True)
class SLO:
    """Latency objectives, milliseconds (vLLM's --goodput units); None: not bounded."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`ttft_ms=2000,tpot_ms=50` (also vLLM's `ttft:2000 tpot:50`); a bad value is one QToolError line."""
        fields = {"ttft_ms": None, "tpot_ms": None, "e2el_ms": None}
        parts = [p for p in text.replace(" ", ",").split(",") if p.strip()]
        for part in parts:
            key, sep, value = part.replace(":", "=").partition("=")
            key = key.strip().lower()
            key = key if key.endswith("_ms") else f"{key}_ms"
            try:
                number = float(value) if sep else float("nan")
            except ValueError:
                number = float("nan")
            if key not in fields or not np.isfinite(number) or number <= 0:
                raise QToolError(f"--slo {text!r}: {part!r} is not NAME=MILLISECONDS with NAME one of ttft_ms, "
                                 "tpot_ms, e2el_ms and a positive number: pass e.g. --slo ttft_ms=2000,tpot_ms=50")
            fields[key] = number
        if not parts:
            raise QToolError("--slo is empty: pass e.g. --slo ttft_ms=2000,tpot_ms=50")
        return cls(**fields)

    def describe(self) -> str:
        names = {"ttft_ms": "p99 TTFT", "tpot_ms": "p99 TPOT", "e2el_ms": "p99 E2EL"}
        return ", ".join(f"{names[k]} <= {v:g} ms" for k, v in asdict(self).items() if v is not None)

    def request_meets(self, r: RequestResult) -> bool:
        """vLLM's goodput: a completed request is good when each of its own latencies meets its bound."""
        if not r.ok or r.ttft is None:
            return False
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, tpot), (self.e2el_ms, r.latency))
        return all(bound is None or 1000 * value <= bound for bound, value in checks)

    def tier_meets(self, s: TierSummary) -> bool:
        """The sweep's criterion: p99 of every bounded latency within its bound (None fails: nothing measured)."""
        checks = ((self.ttft_ms, s.ttft.p99), (self.tpot_ms, s.tpot.p99), (self.e2el_ms, s.e2el.p99))
        return all(bound is None or (value is not None and 1000 * value <= bound) for bound, value in checks)


@dataclass(frozen=True)
class Saturation:
    """Whether an open-loop run kept up: completions per second against the offered rate, and TTFT growth."""

    offered_rate: float
    achieved_rate: float | None
    ttft_growth: float | None  # median TTFT of the last third of arrivals / the first third's
    saturated: bool
    ttft_trend_p: float | None = None  # Kendall's tau of TTFT on arrival order, one-sided p (older files: None)

    @classmethod
    def of(cls, results: list[RequestResult], rate: float) -> Saturation:
        """Completions must leave at the rate requests arrive (spans between the first and last of each), and
        the waits of late arrivals must not grow: a queue that builds over the run is a server past capacity."""
        ok = sorted((r for r in results if r.ok), key=lambda r: r.sent_at)
        if len(ok) < 3:
            return cls(rate, None, None, len(ok) < len(results), None)
        sent = [r.sent_at for r in sorted(results, key=lambda r: r.sent_at)]
        offered = (len(sent) - 1) / (sent[-1] - sent[0]) if sent[-1] > sent[0] else rate
        done = sorted(r.sent_at + r.latency for r in ok)
        achieved = (len(done) - 1) / (done[-1] - done[0]) if done[-1] > done[0] else None
        third = max(1, len(ok) // 3)
        first = float(np.median([r.ttft for r in ok[:third]]))
        last = float(np.median([r.ttft for r in ok[-third:]]))
        growth = last / first if first > 0 else None
        grew = growth is not None and growth > MAX_TTFT_GROWTH and last - first > MIN_TTFT_GROWTH_S
        slow = achieved is not None and achieved < MIN_ACHIEVED_SHARE * offered
        trend = _trend_p([float(r.ttft or 0.0) for r in ok])
        rising = trend is not None and trend < MAX_TREND_P
        return cls(offered, achieved, growth, (rising and (grew or slow)) or len(ok) < len(results), trend)


def _trend_p(values: list[float]) -> float | None:
    """One-sided p of Kendall's tau of `values` on their order (None when they do not vary)."""
    from scipy.stats import kendalltau

    if len(set(values)) < 2:
        return None
    p = float(kendalltau(range(len(values)), values, alternative="greater").pvalue)
    return None if math.isnan(p) else p


@dataclass(frozen=True)
class ServedBy:
    """The endpoint a deployment bench's tier result comes from, and how many of its requests were sent again
    after a 429/503."""

    endpoint: str
    model_id: str
    retried_requests: int


@dataclass(frozen=True)
class KVFigures:
    """The KV cache layer's figures beside a tier summary: the server's cache, its capacity and bytes per token
    (from /metrics) and the preemptions during the tier."""

    kv_cache_dtype: str
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    preemptions: float


@dataclass(frozen=True)
class StaticBatches:
    """HF generate's run of a tier (`qtool bench serve --compare hf`): static batches of `batch_size`, offline,
    so only counts and throughput, no latencies; `generated_tokens` includes what a batch's shorter requests
    generated past their own length."""

    batch_size: int
    generated_tokens: int


@dataclass(frozen=True)
class TierSummary:
    """One system at one tier: counts, throughput, latency distributions (seconds), goodput when an SLO is
    given, saturation when arrivals were open-loop; the speculation counters the server reported, the same run in
    vLLM's names and units, and what the measuring bench adds (see the module's docstring)."""

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    output_tok_per_s: float
    requests_per_s: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    errors: list[str]
    goodput: float | None = None  # requests/s meeting every SLO (vLLM's request_goodput)
    saturation: Saturation | None = None
    speculative: SpeculativeUsage | None = None  # the requests' usage blocks summed (a speculating server's)
    # vLLM's name -> figure (vllm_names.vllm_metrics), kept as measured for a reader beside a vLLM run; qtoolkit
    # reads its own fields above
    vllm: dict[str, float | None] = field(default_factory=dict)
    speculative_engine: TierSpeculation | None = None  # the engine's side, from /metrics (bench serve)
    speculative_ceiling: SpeculationCeiling | None = None  # at concurrency 1 (bench serve)
    served_by: ServedBy | None = None  # a deployment bench's endpoint
    kv: KVFigures | None = None  # the KV cache layer's
    static_batches: StaticBatches | None = None  # HF generate's tier

    @property
    def prefill_share(self) -> float | None:
        """Share of a request's time before its first token (its mean TTFT over its mean latency)."""
        ttft, latency = self.ttft.mean, self.e2el.mean
        return ttft / latency if ttft and latency else None

    @classmethod
    def of(cls, results: list[RequestResult], duration: float, *, slo: SLO | None = None,
           rate: float | None = None) -> TierSummary:
        """qtoolkit's figures of a tier: throughput over the whole run, latency distributions over completed
        requests, goodput under `slo`, saturation under open-loop `rate` (load_client.summarize adds the
        speculation counters and vLLM's figures)."""
        ok = [r for r in results if r.ok]
        out = sum(r.output_tokens for r in ok)
        tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
                if r.ttft is not None and r.output_tokens > 1]
        per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
        return cls(len(results), len(ok), len(results) - len(ok), duration, sum(r.prompt_tokens for r in ok), out,
                   per_s(out), per_s(len(ok)), Distribution.of([r.ttft for r in ok if r.ttft is not None]),
                   Distribution.of(tpot), Distribution.of([x for r in ok for x in r.itl]),
                   Distribution.of([r.latency for r in ok]), sorted({r.error for r in results if r.error})[:5],
                   None if slo is None else per_s(sum(slo.request_meets(r) for r in ok)),
                   None if not rate else Saturation.of(results, rate))

    @classmethod
    def of_static_batches(cls, num_requests: int, duration: float, output_tokens: int,
                          batches: StaticBatches) -> TierSummary:
        """HF generate's tier: every request completes; only the tokens each request asked for count."""
        return cls(num_requests, num_requests, 0, duration, 0, output_tokens, output_tokens / duration,
                   num_requests / duration, Distribution(), Distribution(), Distribution(), Distribution(), [],
                   static_batches=batches)

    def to_json(self) -> dict[str, Any]:
        """qtoolkit's keys (seconds; ttft_s / tpot_s / itl_s / latency_s with mean, p50, p90, p99), then vLLM's
        and the measuring bench's, in one flat object."""
        if self.static_batches is not None:  # HF generate measures no latencies: its counts and throughput only
            return {"num_requests": self.num_requests, "completed": self.completed, "failed": self.failed,
                    "duration_s": self.duration_s, "batch_size": self.static_batches.batch_size,
                    "output_tokens": self.output_tokens, "generated_tokens": self.static_batches.generated_tokens,
                    "output_tok_per_s": self.output_tok_per_s, "requests_per_s": self.requests_per_s}
        by = self.served_by
        out: dict[str, Any] = {} if by is None else {"endpoint": by.endpoint, "model_id": by.model_id}
        out |= {
            "num_requests": self.num_requests, "completed": self.completed, "failed": self.failed,
            "duration_s": self.duration_s, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "output_tok_per_s": self.output_tok_per_s, "requests_per_s": self.requests_per_s,
            "ttft_s": asdict(self.ttft), "tpot_s": asdict(self.tpot), "itl_s": asdict(self.itl),
            "latency_s": asdict(self.e2el), "errors": list(self.errors)}
        if self.goodput is not None:
            out["request_goodput"] = self.goodput
        if self.saturation is not None:
            out["saturation"] = asdict(self.saturation)
        if self.speculative is not None:
            out["speculative"] = self.speculative.as_dict()
        out |= self.vllm
        if self.speculative_engine is not None:
            out["speculative_engine"] = self.speculative_engine.to_json()
        if self.speculative_ceiling is not None:
            out["speculative_ceiling"] = self.speculative_ceiling.to_json()
        if self.kv is not None:
            out |= asdict(self.kv)
        if by is not None:
            out["retried_requests"] = by.retried_requests
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TierSummary:
        """A tier result as any qtoolkit bench wrote it. Older files and HF generate's results lack some figures:
        token counts read as 0, latencies and errors as not measured, and `num_requests` (absent before the
        saturation check) as completed + failed, the requests the tier sent."""
        sat, spec, engine, ceiling = (d.get(k) for k in ("saturation", "speculative", "speculative_engine",
                                                          "speculative_ceiling"))
        completed, failed = int(d["completed"]), int(d["failed"])
        return cls(int(d.get("num_requests", completed + failed)), completed, failed, float(d["duration_s"]),
                   int(d.get("prompt_tokens", 0)), int(d.get("output_tokens", 0)), float(d["output_tok_per_s"]),
                   float(d["requests_per_s"]), Distribution.from_json(d.get("ttft_s")),
                   Distribution.from_json(d.get("tpot_s")), Distribution.from_json(d.get("itl_s")),
                   Distribution.from_json(d.get("latency_s")), list(d.get("errors") or []), d.get("request_goodput"),
                   None if sat is None else Saturation(**sat),
                   None if spec is None else SpeculativeUsage.from_dict(spec),
                   {k: v for k, v in d.items() if is_vllm_metric(k)},
                   None if engine is None else TierSpeculation.from_json(engine),
                   None if ceiling is None else SpeculationCeiling.from_json(ceiling),
                   ServedBy(d["endpoint"], d["model_id"], int(d.get("retried_requests", 0))) if "endpoint" in d
                   else None,
                   KVFigures(d["kv_cache_dtype"], int(d["kv_capacity_tokens"]), int(d["kv_bytes_per_token"]),
                             float(d["preemptions"])) if "kv_capacity_tokens" in d else None,
                   StaticBatches(int(d["batch_size"]), int(d["generated_tokens"])) if "batch_size" in d else None)
