"""What a benchmark costs in memory: the peak resident memory of the whole process tree (this process and every
server it started), sampled in a background thread, and the KV budget its workload needs.

The sampler sums RSS over the tree (shared pages count once per process, as `ps` shows them), so the figure is
an upper bound on what the machine must hold; with `pss=True` (a sweep's report) it also sums PSS once a second,
where a shared page counts once (bench/tree_memory.py). `servers` is the most `qtool serve` children alive at
once."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
from transformers import AutoTokenizer

from ..engine.config import EngineConfig
from ..errors import QToolError
from ..model.sources import resolve_model
from .tree_memory import Peak, tree_sample
from .types import BenchRequest, Workload

SAMPLE_EVERY_S = 0.25
KV_HEADROOM = 1.25  # round requests draw fresh prompts from the same pool; a longer one must still fit


PSS_EVERY = 4  # samples: a PSS reading walks the page tables (~10 ms a GiB), so it is taken once a second


@dataclass
class PeakMemory:
    """Peak RSS of the tree overall and since the last `new_window()` (one candidate's share of a sweep), and
    with `pss` the overall peak of summed PSS."""

    rss_bytes: int = 0
    processes: int = 0
    servers: int = 0
    window: dict[str, int] = field(default_factory=lambda: {"rss_bytes": 0, "processes": 0, "servers": 0})
    pss: bool = False
    pss_peak: Peak = field(default_factory=Peak)
    _samples: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self) -> None:
        s = tree_sample(psutil.Process(), pss=self.pss and self._samples % PSS_EVERY == 0)
        self._samples += 1
        with self._lock:
            for peak in (self.__dict__, self.window):
                if s.rss_bytes > peak["rss_bytes"]:
                    peak["rss_bytes"], peak["processes"] = s.rss_bytes, s.processes
                peak["servers"] = max(peak["servers"], s.servers)
            self.pss_peak.offer(s.pss_bytes, 0.0, s.processes)

    def new_window(self) -> None:
        with self._lock:
            self.window = {"rss_bytes": 0, "processes": 0, "servers": 0}

    def to_json(self, *, window: bool = False, floor: dict[str, int] | None = None) -> dict[str, Any]:
        """The overall peak, or the window's (never below `floor`, e.g. the shared baseline phase's peak)."""
        with self._lock:
            peak = dict(self.window) if window else {k: getattr(self, k) for k in ("rss_bytes", "processes",
                                                                                 "servers")}
        if floor is not None and floor["rss_bytes"] > peak["rss_bytes"]:
            peak = {**floor, "servers": max(floor["servers"], peak["servers"])}
        pss = {"pss_bytes": self.pss_peak.bytes, "pss_processes": self.pss_peak.processes} if self.pss and not window else {}
        return {**peak, **pss, "what": "summed RSS of the bench process and its servers, sampled every "
                                       f"{SAMPLE_EVERY_S} s" + (", and summed PSS (shared pages counted once) "
                                                                "every second" if pss else "")}


@contextlib.contextmanager
def peak_memory(pss: bool = False) -> Iterator[PeakMemory]:
    """Sample the tree's memory until the block ends (with `pss`, summed PSS too, once a second)."""
    peak = PeakMemory(pss=pss)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            peak.sample()
            stop.wait(SAMPLE_EVERY_S)

    thread = threading.Thread(target=run, name="qtool-peak-memory", daemon=True)
    peak.sample()
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak.sample()


def workload_kv_tokens(model: str, requests: list[BenchRequest], concurrency: int, max_output_tokens: int,
                       block_size: int = 16) -> int:
    """KV tokens the workload needs at once: `concurrency` x (longest prompt + most output tokens), with headroom,
    plus one partial block per sequence. Prompts are counted with the model's own tokenizer and chat template."""
    tok = AutoTokenizer.from_pretrained(resolve_model(model).path)
    longest = 0
    for r in requests:
        if r.messages is not None and getattr(tok, "chat_template", None):
            n = len(tok.apply_chat_template(list(r.messages), tokenize=True, add_generation_prompt=True))
        else:
            n = len(tok(r.prompt).input_ids)
        longest = max(longest, n)
    output = max([max_output_tokens, *(r.max_tokens for r in requests if r.max_tokens)])
    return int(concurrency * ((longest + output) * KV_HEADROOM + block_size))


def sized_engine(engine: EngineConfig, model: str, workload: Workload, *, concurrency: int, seed: int,
                 mean_output_tokens: int, max_output_tokens: int) -> EngineConfig:
    """`engine` with its KV cache sized to the workload's requests (a seeded pool of 512, as large as the tiers
    and rounds draw from), unless the caller chose a size (tokens, or memory other than the default). A workload
    whose answer lengths are measured on the baseline server (a file without max_tokens) cannot be drawn before
    that server runs: it keeps the configured budget."""
    if engine.kv_cache_tokens is not None or engine.kv_cache_memory != EngineConfig().kv_cache_memory:
        return engine
    try:
        requests = workload.requests(512, seed=seed, max_output_tokens=max_output_tokens,
                                     mean_output_tokens=mean_output_tokens)
    except QToolError:
        return engine
    return engine.replace(kv_cache_tokens=workload_kv_tokens(model, requests, concurrency, max_output_tokens,
                                                             engine.block_size))
