"""`qtool bench serve`: systems x concurrency tiers against our server or any OpenAI-compatible endpoint,
interleaved, with ratios (and their intervals over rounds) and the HF baseline. The requests themselves go through
the shared load client (load_client.py): streamed, so TTFT, ITL and TPOT are measured as a user sees them."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..engine.config import EngineConfig
from ..errors import QToolError
from ..model.sources import resolve_model
from ..progress import status
from ..provenance import provenance
from ..server.process import server_process
from .load_client import normalize_endpoint, requests_sha256, run_load, served_models, summarize, warm_up
from .loop import Measure, Tier, TierLoop, TierRecord, fresh_requests, ratio_rounds
from .slo_sweep import slo_sweep
from .spec_ceiling import SpeculationCeiling, scrape_speculative, speculation_ceiling, tier_delta
from .summary import SLO, Distribution, StaticBatches, TierSummary
from .systems import ENDPOINT, HF, System, serve_systems
from .types import BenchRequest, Workload
from .vllm_names import vllm_run_fields
from .workloads import as_workload, build_workload


# ---- HF transformers baseline: the same requests in static batches --------------------------------------------
def hf_generate_tier(model: Any, tokenizer: Any, requests: list[BenchRequest], batch_size: int) -> TierSummary:
    """Run `requests` through HF `generate` in static batches of `batch_size`, EOS ignored like the server.

    A batch runs until its longest request is done; only the tokens each request asked for count as output.
    """
    import torch  # optional: only `--compare hf` runs transformers here

    # No EOS at all rather than min_new_tokens: its logits processor costs more than a small model's step.
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=None, pad_token_id=tokenizer.pad_token_id, do_sample=False)
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        prompts = [r.prompt if r.messages is None else tokenizer.apply_chat_template(
            list(r.messages), tokenize=False, add_generation_prompt=True) for r in batch]
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        config.max_new_tokens = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(**enc, generation_config=config)
        generated += (out.shape[1] - enc["input_ids"].shape[1]) * len(batch)
    duration = time.perf_counter() - start
    return TierSummary.of_static_batches(len(requests), duration, sum(r.max_tokens for r in requests),
                                         StaticBatches(batch_size, generated))


def load_hf(model_path: Any, dtype: str) -> tuple[Any, Any]:
    import torch  # optional: only `--compare hf` loads transformers here
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


# ---- one `qtool bench serve` run: systems x concurrency tiers, interleaved ---------------------------------------
@dataclass(frozen=True)
class RatioPair:
    """A ratio the report gives at every tier: numerator's output tok/s over denominator's. `speculative` is set
    when the pair is a speculative system over itself without speculation (a point of the speedup curve)."""

    numerator: str
    denominator: str
    speculative: System | None = None

    @property
    def key(self) -> str:
        """The ratio's name in the report's `ratios` and `ratios_rounds`."""
        return f"{self.numerator}_over_{self.denominator}"


def _ratio(a: TierSummary | None, b: TierSummary | None) -> float | None:
    if a is None or b is None or not b.output_tok_per_s or a.failed or b.failed:
        return None
    return a.output_tok_per_s / b.output_tok_per_s


def _ratio_pairs(systems: list[System]) -> list[RatioPair]:
    """Continuous over static, and each speculative system over itself without speculation."""
    pairs = [RatioPair("continuous", "static")]
    pairs += [RatioPair(s.label, s.plain.label, s) for s in systems if s.speculative]
    return pairs


def _tier_ratios(results: dict[str, TierSummary], systems: list[System]) -> dict[str, float]:
    ratios = {p.key: _ratio(results.get(p.numerator), results.get(p.denominator)) for p in _ratio_pairs(systems)}
    ratios["engine_over_hf"] = _ratio(results.get("continuous") or results.get("static"), results.get(HF))
    return {k: v for k, v in ratios.items() if v is not None}


def _tier_json(tier: Tier, systems: list[System], rate: float | None) -> dict[str, Any]:
    """A tier as the report holds it: the loop's figures, vLLM's run settings, the ratios (over rounds too)."""
    out = {"concurrency": tier.concurrency, "num_requests": tier.num_requests,
           **vllm_run_fields(tier.concurrency, tier.num_requests, rate),
           "results": {label: r.to_json() for label, r in tier.results.items()},
           "ratios": _tier_ratios(tier.results, systems)}
    if tier.rounds is not None:
        out["rounds"] = tier.rounds
        out["ratios_rounds"] = {p.key: r for p in _ratio_pairs(systems)
                                if (r := ratio_rounds(tier.rounds, p.numerator, p.denominator)) is not None}
    return out


def _add_ceilings(results: dict[str, TierSummary], systems: list[System], concurrency: int,
                  num_speculative_tokens: int) -> None:
    """At concurrency 1: each speculative system's ceiling from its measured costs (see spec_ceiling)."""
    if concurrency != 1:
        return
    for s in systems:
        res, plain = results.get(s.label), results.get(s.plain.label)
        share = plain.prefill_share if s.speculative and plain else None
        if res and res.speculative_engine is not None and share is not None:
            results[s.label] = dataclasses.replace(res, speculative_ceiling=speculation_ceiling(
                res.speculative_engine, prefill_share=share, num_speculative_tokens=num_speculative_tokens))


@dataclass(frozen=True)
class CurvePoint:
    """One point of a speculative system's speedup curve: spec / no-spec output tok/s at one concurrency, its
    95% interval over rounds (when the run repeated them) and, at concurrency 1, its ceiling."""

    concurrency: int
    speedup: float
    over_rounds: bool = False  # whether the run repeated the tier (then `ci95` is its interval, None if none)
    ci95: list[float] | None = None
    ceiling: SpeculationCeiling | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"concurrency": self.concurrency, "speedup": self.speedup}
        if self.over_rounds:
            out["ci95"] = self.ci95
        if self.ceiling is not None:
            out["ceiling"] = self.ceiling.measured_acceptance.request_speedup
            out["ceiling_at_full_acceptance"] = self.ceiling.full_acceptance.request_speedup
        return out


def _speculative_curve(tiers: list[Tier], systems: list[System]) -> dict[str, list[CurvePoint]]:
    """Per speculative system: spec / no-spec output tok/s at each concurrency (the load-aware policy's curve),
    with its 95% interval over rounds when the run repeated them."""
    curve: dict[str, list[CurvePoint]] = {}
    for tier in tiers:
        for pair in _ratio_pairs(systems):
            speedup = _ratio(tier.results.get(pair.numerator), tier.results.get(pair.denominator))
            if pair.speculative is None or speedup is None:
                continue
            rounds = None if tier.rounds is None else ratio_rounds(tier.rounds, pair.numerator, pair.denominator)
            curve.setdefault(pair.numerator, []).append(CurvePoint(
                tier.concurrency, speedup, rounds is not None, None if rounds is None else rounds.get("ci95"),
                tier.results[pair.numerator].speculative_ceiling))
    return curve


def _check_serve_args(endpoint: str | None, concurrency: list[int], compare_hf: bool, rounds: int,
                      engine: EngineConfig) -> None:
    if any(c <= 0 for c in concurrency):
        raise QToolError(f"--concurrency takes positive integers, got {concurrency}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise QToolError(f"--rounds {rounds!r} is not a positive integer: pass 1 (no interval) or more")
    if endpoint and compare_hf:
        raise QToolError("--compare hf needs a local --model to load; drop --endpoint or --compare")
    if not endpoint and max(concurrency) > engine.max_num_seqs:
        raise QToolError(f"concurrency {max(concurrency)} exceeds --max-num-seqs {engine.max_num_seqs}: raise it")


def _endpoint_model(url: str, model: str, api_key: str | None) -> str:
    """The model name to send to someone's endpoint: `model` if it serves it, its only one for `default`."""
    try:
        names = asyncio.run(served_models(url, api_key))
    except httpx.HTTPError as e:
        raise QToolError(f"cannot list models at {url} ({type(e).__name__}: {e}): check the URL and --api-key") \
            from None
    if model in names:
        return model
    if model != "default" or not names:
        raise QToolError(f"the endpoint serves {names}, not {model!r}: pass one of them as --model")
    return names[0]


def _start_servers(stack: contextlib.ExitStack, model: str, systems: list[System],
                   engine: EngineConfig) -> dict[str, str]:
    """One `qtool serve` subprocess per system, stopped when `stack` closes; label -> base URL."""
    urls = {}
    for s in systems:
        status(f"starting a {s.batching}-batching server for {model}"
               + (f" with --speculative {s.speculative}" if s.speculative else ""))
        urls[s.label] = stack.enter_context(server_process(model, s.engine_config(engine)))
    return urls


@dataclass(frozen=True)
class Arrivals:
    """How a tier's requests arrive: closed-loop (rate None: all at once, at most the tier's concurrency in
    flight) or open-loop at `rate`/s (Poisson; gamma gaps of shape `burstiness` otherwise), and the SLO that
    goodput counts against and the sweep searches under."""

    rate: float | None = None
    burstiness: float = 1.0
    slo: SLO | None = None
    slo_requests: int = 24  # requests per probe of the SLO sweep
    slo_start_rate: float | None = None  # None: the system's closed-loop requests/s at the first tier


def _measurer(urls: dict[str, str], systems: list[System], model: str, *, arrivals: Arrivals, api: str,
              ignore_eos: bool, api_key: str | None) -> Measure:
    """How one system serves one batch of requests: the load generator's summary, plus, for a speculative
    system, what its engine did meanwhile (two /metrics scrapes differenced)."""
    speculative = {s.label for s in systems if s.speculative}

    def measure(label: str, reqs: list[BenchRequest], concurrency: int, seed: int) -> TierSummary:
        before = scrape_speculative(urls[label], api_key) if label in speculative else None
        res, duration = asyncio.run(run_load(urls[label], model, reqs, concurrency=concurrency, rate=arrivals.rate,
                                             seed=seed, api=api, ignore_eos=ignore_eos, api_key=api_key,
                                             burstiness=arrivals.burstiness))
        summary = summarize(res, duration, slo=arrivals.slo, rate=arrivals.rate)
        if label in speculative and (engine := tier_delta(before, scrape_speculative(urls[label], api_key))):
            summary = dataclasses.replace(summary, speculative_engine=engine)
        return summary

    return measure


def bench_serve(model: str = "default", engine: EngineConfig | None = None, *, endpoint: str | None = None,
                concurrency: list[int] | None = None, batching: list[str] | None = None,
                speculative: list[str] | None = None, workload: str | Workload = "mixed", rate: float | None = None,
                arrivals: Arrivals | None = None, num_requests: int | None = None, compare_hf: bool = False, seed: int = 0,
                mean_output_tokens: int = 64, max_output_tokens: int = 128, api: str = "completions",
                ignore_eos: bool = True, api_key: str | None = None, rounds: int = 1,
                on_tier: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure every system on the same requests, tier by tier; returns the report (see `format_table`).

    `engine` holds the started servers' engine options; each system sets its own batching mode and proposer
    (`batching` x [no speculation, *`speculative`]). With rounds > 1 each tier is served again on fresh requests,
    rounds - 1 more times, interleaved, and every ratio gets a 95% interval over the rounds.
    `on_tier(report)` is called after each measured system with the report so far (`complete` stays False until
    the end). `arrivals` (or `rate` alone) sets open-loop arrivals; with an SLO each system also gets an SLO
    sweep after the tiers (report["slo_sweep"][label]: capacity, probes, saturated rates)."""
    engine = engine or EngineConfig()
    arrivals = arrivals or Arrivals(rate)
    rate = arrivals.rate
    concurrency = concurrency or [1, 4, 16, 32]
    _check_serve_args(endpoint, concurrency, compare_hf, rounds, engine)
    systems = [System(kind=ENDPOINT)] if endpoint else serve_systems(batching or ["continuous"], speculative or [])
    source = None if endpoint else resolve_model(model)
    traffic = as_workload(workload)
    with contextlib.ExitStack() as stack:
        if endpoint:
            urls = {ENDPOINT: normalize_endpoint(endpoint)}
            model = _endpoint_model(urls[ENDPOINT], model, api_key)
        else:
            urls = _start_servers(stack, model, systems, engine)
        for url in urls.values():
            warm_up(url, model, seed=seed, api=api, ignore_eos=ignore_eos, api_key=api_key)
        first = next(iter(urls))  # a workload file's lines without max_tokens: their answer length here
        traffic.attach_length_probe(urls[first], model, name=first, api_key=api_key)
        measure = _measurer(urls, systems, model, arrivals=arrivals, api=api, ignore_eos=ignore_eos,
                            api_key=api_key)
        loop = TierLoop(list(urls), measure,
                        traffic, seed, mean_output_tokens, max_output_tokens, rounds, every_tier=True)
        tiers = loop.plan(concurrency, num_requests)
        hf = _load_hf_warm(source, engine.dtype, seed) if compare_hf else None
        config = {"model": model, "endpoint": endpoint, "systems": list(urls) + ([HF] if hf else []),
                  "concurrency": concurrency, "workload": traffic.describe(), "rate_qps": rate,
                  "burstiness": arrivals.burstiness, "slo": None if arrivals.slo is None else vars(arrivals.slo),
                  "seed": seed,
                  "mean_output_tokens": mean_output_tokens, "max_output_tokens": max_output_tokens, "api": api,
                  "ignore_eos": ignore_eos, "kv_cache_memory": engine.kv_cache_memory,
                  "max_num_seqs": engine.max_num_seqs, "dtype": engine.dtype, "speculative": speculative or [],
                  "num_speculative_tokens": engine.num_speculative_tokens, "rounds": rounds,
                  "engine": dataclasses.asdict(engine),
                  "hf_note": "HF runs the tier's requests offline in static batches of the tier's concurrency "
                             "(no arrivals); only requested tokens count"}
        inputs = {"model": source.describe() if source else {"name": model, "endpoint": endpoint},
                  "workload_sha256": requests_sha256(loop.requests)}
        report = {**provenance(**inputs), "config": config, "complete": False, "tiers": []}
        _measure_tiers(loop, tiers, hf, _Reporter(report, systems, rate, engine.num_speculative_tokens, on_tier))
        if arrivals.slo is not None:
            report["slo_sweep"] = _sweep_systems(loop, urls, model, arrivals, tiers, api=api,
                                                 ignore_eos=ignore_eos, api_key=api_key)
    if rounds > 1:
        report["inputs"] = {**inputs, "rounds_workload_sha256": requests_sha256(loop.round_requests)}
    report["complete"] = True
    return report


def _sweep_systems(loop: TierLoop, urls: dict[str, str], model: str, arrivals: Arrivals, tiers: list[Tier],
                   **client: Any) -> dict[str, Any]:
    """Each system's SLO sweep, open-loop (no concurrency cap), on prompts no tier had, after the tiers; each
    starts at its closed-loop requests/s at the first tier unless the arrivals set a start."""
    assert arrivals.slo is not None
    out: dict[str, Any] = {}
    for label, url in urls.items():
        first = tiers[0].results.get(label)
        start = arrivals.slo_start_rate or (first.requests_per_s if first else None) or 1.0

        def probe(rate: float, k: int, url: str = url) -> TierSummary:
            reqs = fresh_requests(loop.workload, arrivals.slo_requests, loop.requests + loop.round_requests,
                                  seed=loop.seed + 1000 + k, mean_output_tokens=loop.mean_output_tokens,
                                  max_output_tokens=loop.max_output_tokens)
            loop.round_requests.extend(reqs)
            res, duration = asyncio.run(run_load(url, model, reqs, concurrency=len(reqs), rate=rate,
                                                 seed=loop.seed + k, burstiness=arrivals.burstiness, **client))
            return TierSummary.of(res, duration, slo=arrivals.slo, rate=rate)

        out[label] = slo_sweep(probe, arrivals.slo, start_rate=start).to_json()
        out[label]["burstiness"] = arrivals.burstiness
        out[label]["requests_per_probe"] = arrivals.slo_requests
    return out


def _load_hf_warm(source: Any, dtype: str, seed: int) -> tuple[Any, Any]:
    hf = load_hf(source.path, dtype)
    hf_generate_tier(*hf, build_workload("code", 1, seed=seed + 1, mean_output_tokens=4, max_output_tokens=8), 1)
    return hf


@dataclass
class _Reporter:
    """Keeps the report's tiers current as the loop measures, and hands the report to `on_tier`: long CPU runs
    keep what they measured if stopped."""

    report: dict[str, Any]
    systems: list[System]
    rate: float | None
    num_speculative_tokens: int
    on_tier: Callable[[dict[str, Any]], None] | None

    tiers: dict[int, Tier] = field(default_factory=dict)  # the tiers measured so far, by index

    def __call__(self, t: int, tier: Tier) -> None:
        _add_ceilings(tier.results, self.systems, tier.concurrency, self.num_speculative_tokens)
        self.tiers[t] = tier
        self.report["tiers"][t:t + 1] = [_tier_json(tier, self.systems, self.rate)]
        curve = _speculative_curve([self.tiers[i] for i in sorted(self.tiers)], self.systems)
        self.report["speculative_curve"] = {label: [p.to_json() for p in points] for label, points in curve.items()}
        if self.on_tier is not None:
            self.on_tier(self.report)


def _measure_tiers(loop: TierLoop, tiers: list[Tier], hf: tuple[Any, Any] | None, reporter: _Reporter) -> None:
    """The loop's tiers and rounds, then (with --compare hf) HF generate on each tier's requests."""

    def hf_tier(t: int, tier: Tier) -> None:
        if hf is None:
            return
        status(f"concurrency {tier.concurrency}: {tier.num_requests} requests through HF generate "
               f"(static batches of {tier.concurrency})")
        tier.results[HF] = hf_generate_tier(*hf, tier.requests, tier.concurrency)
        reporter(t, tier)

    loop.on_result = reporter
    loop.run(tiers, after_tier=hf_tier)


def format_table(report: dict[str, Any]) -> str:
    """A `qtool bench serve` report (bench_serve's, or its JSON read back) as the terminal's table."""
    def ms(d: Distribution) -> str:
        return "/".join("-" if v is None else f"{1000 * v:.0f}" for v in (d.p50, d.p99))

    head = (f"{'system':<11}{'conc':>5}{'ok':>7}{'out tok/s':>11}{'req/s':>8}{'TTFT p50/p99 ms':>17}"
            f"{'TPOT p50/p99 ms':>17}{'ITL p50/p99 ms':>16}")
    lines = [head, "-" * len(head)]
    for tier in report["tiers"]:
        record = TierRecord.from_json(tier)
        for name, r in record.results.items():
            lines.append(f"{name:<11}{record.concurrency:>5}{r.completed:>4}/{r.num_requests:<2}"
                         f"{r.output_tok_per_s:>11.1f}{r.requests_per_s:>8.2f}{ms(r.ttft):>17}{ms(r.tpot):>17}"
                         f"{ms(r.itl):>16}")
        for k, v in tier["ratios"].items():
            over_rounds = tier.get("ratios_rounds", {}).get(k)
            lines.append(f"{'':<16}{k} = {v:.2f}x" + (_rounds_text(over_rounds) if over_rounds else ""))
        for name, r in record.results.items():
            if (e := r.speculative_engine) is not None:
                lines.append(f"{'':<16}{name}: drafted {e.usage.draft_tokens}, accepted {e.usage.accepted_tokens} "
                             f"(by position {e.acceptance_by_position[:4]}), proposer {e.proposer_share:.0%}"
                             f" of spec time, draft cost r={e.draft_cost_ratio:.2f}, "
                             f"verify cost v={e.verify_cost_per_token:.2f}/token")
            if (cl := r.speculative_ceiling) is not None:
                m, f = cl.measured_acceptance, cl.full_acceptance
                lines.append(f"{'':<16}{name}: ceiling at these costs {m.request_speedup:.2f}x "
                             f"(k={m.best_k}), at acceptance 1 {f.request_speedup:.2f}x (k={f.best_k}); "
                             f"prefill is {cl.prefill_share:.0%} of a request")
    for label, sweep in (report.get("slo_sweep") or {}).items():
        cap = sweep["capacity_rps"]
        lines.append(f"{label}: capacity at {sweep['slo_text']}: "
                     + (f"{cap:.3g} requests/s" if cap is not None else "no rate tried meets it")
                     + (f"; {sweep['first_failing_rps']:.3g}/s fails" if sweep["first_failing_rps"] else "")
                     + (f"; saturated at {', '.join(f'{r:.3g}' for r in sweep['saturated_rps'])}/s"
                        if sweep["saturated_rps"] else ""))
    return "\n".join(lines)


def _rounds_text(over_rounds: dict[str, Any]) -> str:
    """A ratio's figure over rounds: geometric mean and 95% interval (none from one round)."""
    ci = over_rounds.get("ci95")
    interval = f", 95% CI [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
    return f"; over {over_rounds['rounds']} rounds {over_rounds['ratio']:.2f}x{interval}"
