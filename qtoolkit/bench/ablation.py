"""Layer-by-layer ablation: each serving optimisation measured alone and stacked, on one workload, interleaved.

Layers stack in the order of the thesis: baseline (unquantized, static batching) -> + continuous batching ->
+ speculative decoding (when the engine offers it) -> + quantization. Each layer is also measured alone on top of
the baseline (quantized weights with static batching, ...), so the report shows where savings overlap: the
stacked gain divided by the product of the alone gains is 1 when layers compound and < 1 when they overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtoolkit.evals.stats.paired import CONFIDENCE, ratio_over_rounds

from ..engine.config import EngineConfig
from ..errors import QToolError
from ..progress import status
from ..provenance import provenance
from ..server.process import ControlledServer, controlled_server
from .capacity import CapacityPlan, CapacityRounds, PairProbe, capacity_starts, paired_capacity
from .load_client import requests_sha256, run_load, served_models, summarize, warm_up
from .loop import Tier, TierLoop, TierRecord
from .memory import peak_memory, sized_engine
from .summary import TierSummary
from .systems import System
from .types import BenchRequest, Workload
from .workloads import as_workload

BASELINE_STATIC = System("static", quant="baseline")
BASE_SYSTEMS: list[System] = [BASELINE_STATIC, System("continuous", quant="baseline"),
                              System("static", quant="candidate"), System("continuous", quant="candidate")]
FULL_STACK = System("continuous", "speculative", "candidate")  # stands for whichever proposer the run uses
FULL_STACK_PLAIN = FULL_STACK.plain  # the top of the stack when the engine offers no speculation


@dataclass(frozen=True)
class Layer:
    """One row of the ablation: the system that measures it and what the report calls it."""

    system: System
    label: str


# stacking order: each layer on top of the ones before it
STACK = (Layer(BASELINE_STATIC, "baseline (static batching)"),
         Layer(System("continuous", quant="baseline"), "+ continuous batching"),
         Layer(System("continuous", "speculative", "baseline"), "+ speculative decoding"),
         Layer(FULL_STACK, "+ quantization (full stack)"))
# each layer alone over the baseline
ALONE = (Layer(System("continuous", quant="baseline"), "continuous batching"),
         Layer(System("static", "speculative", "baseline"), "speculative decoding"),
         Layer(System("static", quant="candidate"), "quantization"))
QUANTIZATION_ALONE = ALONE[2].system


def speculative_systems(speculative: str | None) -> list[System]:
    """Systems with speculation, when the engine offers it (`qtool serve --speculative`)."""
    if not speculative:
        return []
    return [System("static", speculative, "baseline"), System("continuous", speculative, "baseline"),
            System("continuous", speculative, "candidate")]


def full_stack_system(systems: list[str]) -> str:
    """The system the total speedup is read from: quantization on top of every other layer offered."""
    return FULL_STACK.label if FULL_STACK.label in systems else FULL_STACK_PLAIN.label


def speed_pair(labels: list[str]) -> tuple[str, str]:
    """The speed gates' like-with-like pair: the baseline and the candidate under the same serving configuration
    (continuous batching, with speculation when the run has a proposer, the same KV budget): what the recipe
    changes and nothing else."""
    spec = System("continuous", "speculative", "baseline")
    if spec.label in labels:
        return spec.label, FULL_STACK.label
    return System("continuous", quant="baseline").label, FULL_STACK_PLAIN.label


@dataclass(frozen=True)
class SpeedRounds:
    """bench.json's `speed_rounds`: the speed gates' pair, the planned round counts of its looks and the rounds
    it served (at every tier)."""

    pair: list[str]
    looks: list[int]
    rounds: int | None

    def to_json(self) -> dict[str, Any]:
        return {"pair": list(self.pair), "looks": list(self.looks), "rounds": self.rounds}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SpeedRounds:
        return cls(list(d["pair"]), list(d.get("looks") or ()), d.get("rounds"))


@dataclass(frozen=True)
class AblationBench:
    """bench.json of a local sign-off as the gates read it: every tier with its paired rounds, the systems, the
    rounds configured and the speed gates' further looks (the rest of the file is provenance), judged at `level`
    (not in the file: 95%, or 1 - a sweep's family-wise share of a candidate)."""

    tiers: list[TierRecord]
    systems: list[str] = field(default_factory=list)
    rounds: int | None = None  # config.rounds: every system's rounds at every tier (the speed gates' first look)
    speed_rounds: SpeedRounds | None = None
    level: float = CONFIDENCE  # the rounds' intervals and the speed gates' overall error 1 - level
    capacity: CapacityRounds | None = None  # the capacity gate's paired searches, when the policy sets an SLO

    @classmethod
    def from_json(cls, d: dict[str, Any], level: float = CONFIDENCE) -> AblationBench:
        config = d.get("config")
        speed, capacity = d.get("speed_rounds"), d.get("capacity")
        return cls([TierRecord.from_json(t) for t in d.get("tiers") or []],
                   list(config.get("systems") or []) if config else [], config.get("rounds") if config else None,
                   SpeedRounds.from_json(speed) if speed else None, level,
                   CapacityRounds.from_json(capacity) if capacity else None)

    @property
    def table(self) -> AblationTable:
        return AblationTable([AblationRow.from_tier(t, self.level) for t in self.tiers], list(self.systems))


@dataclass(frozen=True)
class SpeedLooks:
    """Rounds added until the speed gates decide: `looks` are the planned round counts of the pair at every tier
    (the first is the ablation's own --rounds); after each look `decided(bench)` says whether to stop, `bench`
    holding the tiers and the speed gates' rounds so far. The caller (the sign-off) sets each look's level."""

    looks: tuple[int, ...]
    decided: Callable[[AblationBench], bool]

    def serve(self, pair: list[str], labels: list[str], rounds: int, records: Callable[[], list[TierRecord]],
              more: Callable[[int], None]) -> SpeedRounds:
        """The looks after the first: while `decided` says no, `more(n)` serves the pair's rounds at every tier up
        to n; `records()` reads the tiers as they stand."""
        measured = rounds
        for target in self.looks[1:]:
            if self.decided(AblationBench(records(), labels, rounds, SpeedRounds(pair, list(self.looks), measured))):
                break
            status(f"speed gates undecided after {measured} rounds: {target} rounds of {' and '.join(pair)}")
            more(target)
            measured = target
        return SpeedRounds(pair, list(self.looks), measured)


def _mode(system: System, engine: EngineConfig) -> dict[str, Any]:
    """The engine-mode switch that makes a loaded server run `system` (speculation only when a proposer is
    loaded: without one every system is plain)."""
    return {"batching": system.batching, "speculative": bool(system.speculative) if engine.speculative else None}


@dataclass
class _Bench:
    """One sweep's shared parts: the engine options, the traffic, the systems and the running servers (at most
    the baseline's and one candidate's), each switched to a system's mode before it is measured."""

    engine: EngineConfig
    traffic: Workload
    systems: list[System]
    seed: int
    mean_output_tokens: int
    max_output_tokens: int
    rounds: int
    repeat: list[str]
    every_tier: bool = False
    speed: SpeedLooks | None = None
    capacity: CapacityPlan | None = None
    servers: dict[str, tuple[ControlledServer, str]] = field(default_factory=dict)

    def start(self, stack: contextlib.ExitStack, quant: str, model: str) -> None:
        status(f"starting the {quant} server ({model})")
        # a quantized KV cache belongs to the candidate: the baseline keeps the model's own cache
        engine = self.engine.replace(kv_cache_dtype="auto") if quant == "baseline" else self.engine
        server = stack.enter_context(controlled_server(model, engine))
        served = asyncio.run(served_models(server.url))[0]
        warm_up(server.url, served, seed=self.seed)
        self.servers[quant] = (server, served)

    def measure(self, label: str, reqs: list[BenchRequest], c: int, s: int) -> TierSummary:
        system = next(x for x in self.systems if x.label == label)
        server, served = self.servers[str(system.quant)]
        server.set_mode(**_mode(system, self.engine))  # also empties the prefix cache: a fresh server's state
        res, duration = asyncio.run(run_load(server.url, served, reqs, concurrency=c, seed=s))
        return summarize(res, duration)

    def capacity_probe(self, loop: TierLoop) -> PairProbe:
        """One open-loop probe of a system at a rate on requests no tier or round had (the prefix cache would
        serve a repeated prompt)."""
        assert self.capacity is not None
        plan = self.capacity

        def probe(label: str, rate: float, k: int) -> TierSummary:
            system = next(x for x in self.systems if x.label == label)
            server, served = self.servers[str(system.quant)]
            server.set_mode(**_mode(system, self.engine))
            reqs = loop.probe_requests(plan.requests_per_probe, k)
            res, duration = asyncio.run(run_load(server.url, served, reqs, concurrency=len(reqs), rate=rate,
                                                 seed=self.seed + k))
            return TierSummary.of(res, duration, slo=plan.slo, rate=rate)

        return probe

    def loop(self, labels: list[str]) -> TierLoop:
        return TierLoop(labels, self.measure, self.traffic, self.seed, self.mean_output_tokens,
                        self.max_output_tokens, self.rounds, repeat=[x for x in self.repeat if x in labels],
                        every_tier=self.every_tier)


def _split(systems: list[System], repeat: list[str]) -> tuple[list[str], list[str]]:
    """(labels measured once on the baseline, labels measured with each candidate): each candidate's loop holds
    its systems and the baseline systems its ratios pair with (baseline_static and any repeated one)."""
    paired = [s.label for s in systems if s.quant == "candidate" or s == BASELINE_STATIC or s.label in repeat]
    return [s.label for s in systems if s.label not in paired], paired


def _merge(shared: list[Tier], own: list[Tier], labels: list[str]) -> list[Tier]:
    """A candidate's tiers: the shared baseline figures and its own loop's (paired in time), in `labels` order."""
    out = []
    for a, b in zip(shared, own, strict=True):
        both = {**a.results, **b.results}
        results = {x: both[x] for x in labels if x in both}
        tier = Tier(b.concurrency, b.requests, results)
        for name in ("rounds", "rounds_tpot", "rounds_ttft"):
            x, y = getattr(a, name), getattr(b, name)
            setattr(tier, name, None if x is None and y is None else {**(x or {}), **(y or {})})
        out.append(tier)
    return out


def bench_candidates(baseline: str | Path, candidates: dict[str, str | Path], engine: EngineConfig | None = None, *,
                     concurrency: list[int], num_requests: int | None = None, mean_output_tokens: int = 48,
                     max_output_tokens: int = 96, workload: str | Workload = "mixed", seed: int = 0,
                     rounds: int = 1, repeat: tuple[str, ...] | None = ("baseline_static", "full_stack"),
                     speed: SpeedLooks | None = None, capacity: CapacityPlan | None = None,
                     on_candidate: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, dict[str, Any]]:
    """The ablation of each candidate against one baseline, holding at most two servers (the baseline's, kept,
    and one candidate's at a time), each switched between batching modes and speculation between measurements.

    The baseline-only layers are measured once; each candidate's loop measures its systems with baseline_static
    (and any repeated baseline system) interleaved on the same requests and rounds, so its ratios are paired in
    time. Each result has bench_ablation's shape (the shared baseline figures included) plus `peak_memory`; a
    candidate whose server fails gets {"error": ...} instead and the others go on. `on_candidate(name, result)`
    runs as each one finishes.

    `repeat` None: every system serves `rounds` rounds at every tier (each layer gets an interval per tier);
    `speed` then adds rounds of the speed gates' pair (speed_pair) until they decide; `capacity` then runs the
    pair's paired capacity searches (bench/capacity.py) into the result's `capacity`."""
    traffic = as_workload(workload)
    # every server admits the top tier at once, whatever the caller's max_num_seqs
    engine = (engine or EngineConfig()).replace(max_num_seqs=max(concurrency))
    engine = sized_engine(engine, str(baseline), traffic, concurrency=max(concurrency), seed=seed,
                          mean_output_tokens=mean_output_tokens, max_output_tokens=max_output_tokens)
    systems = BASE_SYSTEMS + speculative_systems(engine.speculative)
    labels = [s.label for s in systems]
    everything = repeat is None
    repeat = tuple(labels) if repeat is None else repeat
    bench = _Bench(engine, traffic, systems, seed, mean_output_tokens, max_output_tokens, rounds,
                   [full_stack_system(labels) if x == "full_stack" else x for x in repeat], everything, speed,
                   capacity)
    once, paired = _split(systems, bench.repeat)
    results: dict[str, dict[str, Any]] = {}
    with peak_memory() as peak, contextlib.ExitStack() as stack:
        bench.start(stack, "baseline", str(baseline))
        server, served = bench.servers["baseline"]
        server.set_mode(**_mode(BASELINE_STATIC, engine))
        # a workload file's lines without max_tokens: the baseline's answer lengths (workload_files.py)
        traffic.attach_length_probe(server.url, served, name=BASELINE_STATIC.label)
        shared_loop = bench.loop(once)
        shared = shared_loop.run(shared_loop.plan(concurrency, num_requests))
        floor = peak.to_json()
        for i, (name, path) in enumerate(candidates.items()):
            status(f"bench: candidate {name} ({i + 1}/{len(candidates)})")
            peak.new_window()
            try:
                result = _candidate(bench, str(baseline), str(path), shared, paired, concurrency, num_requests)
                result["peak_memory"] = peak.to_json(window=True, floor=floor)
            except QToolError as e:  # a candidate whose server cannot start must not cost the others theirs
                result = {"error": f"{name}: {e}", "candidate": str(path)}
            results[name] = result
            if on_candidate is not None:
                on_candidate(name, result)
    return results


def _candidate(bench: _Bench, baseline: str, candidate: str, shared: list[Tier], paired: list[str],
               concurrency: list[int], num_requests: int | None) -> dict[str, Any]:
    """One candidate's server started, its loop run, its server stopped; its bench.json."""
    with contextlib.ExitStack() as stack:
        bench.start(stack, "candidate", candidate)
        loop = bench.loop(paired)
        own = loop.run(loop.plan(concurrency, num_requests))
        looks = _speed_rounds(bench, loop, shared, own)
        capacity = _capacity(bench, loop, shared, own)
    bench.servers.pop("candidate", None)
    engine = bench.engine
    extra = ({} if looks is None else {"speed_rounds": looks.to_json()}) | (
        {} if capacity is None else {"capacity": capacity.to_json()})
    return {**extra, **provenance(baseline=baseline, candidate=candidate, workload_sha256=requests_sha256(loop.requests),
                         rounds_workload_sha256=requests_sha256(loop.round_requests)),
            "config": {"concurrency": concurrency, "workload": bench.traffic.describe(),
                       "speculative": engine.speculative, "mean_output_tokens": bench.mean_output_tokens,
                       "max_output_tokens": bench.max_output_tokens, "seed": bench.seed,
                       "systems": [s.label for s in bench.systems], "rounds": bench.rounds,
                       "kv_cache_tokens": engine.kv_cache_tokens},
            "tiers": [t.to_json() for t in _merge(shared, own, [s.label for s in bench.systems])]}


def _speed_rounds(bench: _Bench, loop: TierLoop, shared: list[Tier], own: list[Tier]) -> SpeedRounds | None:
    """The speed gates' further looks: rounds of the pair at every tier until `decided` or the last look."""
    if bench.speed is None or not bench.every_tier:
        return None
    labels = [s.label for s in bench.systems]
    pair = list(speed_pair(labels))
    return bench.speed.serve(pair, labels, bench.rounds,
                             lambda: [TierRecord.of(t) for t in _merge(shared, own, labels)],
                             lambda n: loop.more_rounds(own, pair, n))


def _capacity(bench: _Bench, loop: TierLoop, shared: list[Tier], own: list[Tier]) -> CapacityRounds | None:
    """The capacity gate's paired searches of the speed gates' pair, after its rounds."""
    if bench.capacity is None:
        return None
    labels = [s.label for s in bench.systems]
    pair = speed_pair(labels)
    starts = capacity_starts(TierRecord.of(_merge(shared, own, labels)[-1]), pair)
    return paired_capacity(bench.capacity_probe(loop), pair, bench.capacity, starts)


def bench_ablation(baseline: str | Path, candidate: str | Path, engine: EngineConfig | None = None, *,
                   concurrency: list[int], num_requests: int | None = None, mean_output_tokens: int = 48,
                   max_output_tokens: int = 96, workload: str | Workload = "mixed", seed: int = 0, rounds: int = 1,
                   repeat: tuple[str, ...] | None = ("baseline_static", "full_stack"),
                   speed: SpeedLooks | None = None, capacity: CapacityPlan | None = None) -> dict[str, Any]:
    """Every system on the same requests, tier by tier, alternating the order between tiers: bench_candidates
    with one candidate (two servers, switched between systems); its failure is raised.

    `engine` holds the servers' engine options; its proposer (`speculative`) is the speculative layer's, and
    without one the layer is left out. With rounds > 1 the systems in `repeat` ("full_stack" names the top of
    the stack) serve the top tier again, rounds - 1 more times, each round on fresh requests and in alternating
    order: the throughput gates read the spread of the per-round ratios, i.e. how much a rerun could move them."""
    result = bench_candidates(baseline, {"candidate": candidate}, engine, concurrency=concurrency,
                              num_requests=num_requests, mean_output_tokens=mean_output_tokens,
                              max_output_tokens=max_output_tokens, workload=workload, seed=seed, rounds=rounds,
                              repeat=repeat, speed=speed, capacity=capacity)["candidate"]
    if "error" in result:
        raise QToolError(result["error"])
    return result


@dataclass(frozen=True)
class AblationStep:
    """One stacked layer at one tier: its system's tok/s and its gain over the layer below."""

    system: str  # the measured system's label (the JSON key of its figures)
    label: str
    output_tok_per_s: float
    marginal_gain: float | None

    def to_json(self) -> dict[str, Any]:
        return {"system": self.system, "label": self.label, "output_tok_per_s": self.output_tok_per_s,
                "marginal_gain": self.marginal_gain}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AblationStep:
        return cls(d["system"], d["label"], d["output_tok_per_s"], d.get("marginal_gain"))


@dataclass(frozen=True)
class AblationRow:
    """One tier of the ablation table: the stacked steps, the total and each layer alone over the baseline;
    with rounds, the total and the quantization-alone speedups over them (ratio_over_rounds' figures)."""

    concurrency: int
    steps: list[AblationStep]
    total_speedup: float | None
    alone_speedup: dict[str, float]  # layer name -> its speedup alone over the baseline
    stacking_efficiency: float | None = None  # 1: the layers compound; < 1: one's gain was taken by another
    total_speedup_rounds: dict[str, Any] | None = None
    quantization_speedup_rounds: dict[str, Any] | None = None
    # with rounds of every system at this tier: each stacked layer's gain over the layer below and each layer
    # alone over the baseline, as ratio_over_rounds' figures (95% t-intervals over the paired rounds)
    marginal_rounds: dict[str, dict[str, Any]] | None = None
    alone_rounds: dict[str, dict[str, Any]] | None = None

    @property
    def speculation_pays(self) -> str | None:
        """Whether the speculative layer (on continuous batching) still pays at this tier: "yes" when its gain's
        interval is above 1, "no" when below (its gain compresses under load), "undecided" when it straddles 1;
        None without speculation or rounds."""
        r = (self.marginal_rounds or {}).get(STACK[2].label)
        ci = (r or {}).get("ci95")
        if not ci or None in ci:
            return None
        return "yes" if ci[0] > 1 else "no" if ci[1] < 1 else "undecided"

    @property
    def quantization_speedup(self) -> float | None:
        return self.alone_speedup.get(ALONE[2].label)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"concurrency": self.concurrency, "steps": [s.to_json() for s in self.steps],
                               "total_speedup": self.total_speedup, "alone_speedup": dict(self.alone_speedup),
                               "quantization_speedup": self.quantization_speedup}
        for key in ("stacking_efficiency", "total_speedup_rounds", "quantization_speedup_rounds", "marginal_rounds",
                    "alone_rounds", "speculation_pays"):
            if (value := getattr(self, key)) is not None:
                out[key] = value
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AblationRow:
        return cls(d["concurrency"], [AblationStep.from_json(s) for s in d["steps"]], d.get("total_speedup"),
                   dict(d.get("alone_speedup") or {}), d.get("stacking_efficiency"), d.get("total_speedup_rounds"),
                   d.get("quantization_speedup_rounds"), d.get("marginal_rounds"), d.get("alone_rounds"))

    @classmethod
    def from_tier(cls, tier: TierRecord, level: float = CONFIDENCE) -> AblationRow:
        """Per tier: tok/s of each stacked layer, its marginal gain over the layer before, and the total (the
        intervals over rounds at `level`)."""
        steps: list[AblationStep] = []
        prev = None
        for layer in STACK:
            system = layer.system
            if system == FULL_STACK and system.label not in tier.results:
                system = FULL_STACK_PLAIN  # no speculation: quantization lands on continuous batching
            value = tier.tok_per_s(system.label)
            if value is None:
                continue
            steps.append(AblationStep(system.label, layer.label, value, value / prev if prev else None))
            prev = value
        base = tier.tok_per_s(BASELINE_STATIC.label)
        alone = {layer.label: v / base for layer in ALONE if (v := tier.tok_per_s(layer.system.label)) and base}
        total = steps[-1].output_tok_per_s / base if steps and base else None
        rounds = tier.rounds or {}

        def over_rounds(system: str, below: str = BASELINE_STATIC.label) -> dict[str, Any] | None:
            return paired_rounds(rounds, system, below, level)

        marginal = {s.label: r for s, below in zip(steps[1:], steps, strict=False)
                    if (r := over_rounds(s.system, below.system)) is not None}
        alone_r = {layer.label: r for layer in ALONE if (r := over_rounds(layer.system.label)) is not None}
        return cls(tier.concurrency, steps, total, alone,
                   total / math.prod(alone.values()) if total and alone else None,
                   over_rounds(full_stack_system(list(tier.results))), over_rounds(QUANTIZATION_ALONE.label),
                   marginal or None, alone_r or None)


def paired_rounds(rounds: dict[str, list[float]], numerator: str, denominator: str,
                  level: float = CONFIDENCE) -> dict[str, Any] | None:
    """numerator / denominator over the rounds both served (paired by round index: the speed gates' pair may
    have served more rounds than the other systems); None with fewer than two such rounds."""
    a, b = rounds.get(numerator) or [], rounds.get(denominator) or []
    n = min(len(a), len(b))
    if n < 2 or min(a[:n]) <= 0 or min(b[:n]) <= 0:
        return None
    return ratio_over_rounds(a[:n], b[:n], level)


@dataclass(frozen=True)
class AblationTable:
    tiers: list[AblationRow]
    systems: list[str] = field(default_factory=list)

    @property
    def top(self) -> AblationRow | None:
        """The highest concurrency tier, where the older throughput gates judge."""
        return self.tiers[-1] if self.tiers else None

    def to_json(self) -> dict[str, Any]:
        return {"tiers": [t.to_json() for t in self.tiers], "systems": list(self.systems)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AblationTable:
        return cls([AblationRow.from_json(t) for t in d["tiers"]], list(d.get("systems") or []))
