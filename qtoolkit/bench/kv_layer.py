"""The ablation's "KV cache" layer: one checkpoint served with the unquantized and with a quantized KV cache at one
fixed `--kv-cache-memory` that the unquantized cache cannot fit the tier into (long prompts at high concurrency),
so the layer shows what the quantized cache buys where the cache is the limit: the tokens that fit (read from the
servers' /metrics), the preemptions it avoids and the output tok/s, with the ratio over interleaved rounds.

One server runs at a time: each measurement starts its own `qtool serve`, so the two caches never share the
machine's memory or cores, and each measurement's preemptions are its own server's counter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from ..engine.config import EngineConfig
from ..errors import QToolError
from ..provenance import provenance
from ..server.metrics import samples
from ..server.process import server_process
from .load_client import requests_sha256, run_load, served_models, summarize, warm_up
from .loop import TierLoop, ratio_rounds
from .summary import KVFigures, TierSummary
from .types import BenchRequest, Workload
from .workloads import as_workload

UNQUANTIZED = "auto"
# the unquantized cache holds this share of the tier's sequences at the layer's budget: the limit, by a margin
# the quantized cache (~3.8x the tokens of fp32 at head_dim 64) more than covers
HELD_SHARE = 4
_DTYPE_BYTES = {"auto": 4, "float32": 4, "bfloat16": 2}  # the engine's compute dtype ("auto" is fp32 on CPU)


def checkpoint_kv_dtype(checkpoint: str | Path) -> str | None:
    """The KV cache a checkpoint was made for: its config's compressed-tensors `kv_cache_scheme` (8-bit float:
    fp8, 8-bit int: int8), as the loader reads its calibrated scales; None when it carries no KV scheme."""
    config = Path(checkpoint) / "config.json"
    if not config.is_file():
        return None
    quantization = json.loads(config.read_text()).get("quantization_config")  # Hugging Face's config.json
    scheme = quantization.get("kv_cache_scheme") if quantization else None
    if not scheme:
        return None
    return "fp8" if scheme.get("type", "float") == "float" else "int8"


def resolve_kv_dtype(requested: str, checkpoint: str | Path) -> str:
    """`auto` means the checkpoint's own KV scheme when it carries one (a recipe with `kv_cache_scheme` is made
    to be served with its quantized cache), else the model's dtype; fp8/int8 are taken as asked."""
    if requested != UNQUANTIZED:
        return requested
    return checkpoint_kv_dtype(checkpoint) or UNQUANTIZED


def label(kv_cache_dtype: str) -> str:
    return f"kv_{kv_cache_dtype}"


def unquantized_bytes_per_token(checkpoint: str | Path, dtype: str = "auto") -> int:
    """K and V bytes of one token over all layers in the engine's compute dtype, from the checkpoint's config."""
    c = json.loads((Path(checkpoint) / "config.json").read_text())
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    kv_heads = c.get("num_key_value_heads") or heads
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)


def limiting_budget(checkpoint: str | Path, requests: list[BenchRequest], concurrency: int, dtype: str = "auto",
                    block_size: int = 16) -> int:
    """A --kv-cache-memory (bytes) where the unquantized cache holds only 1/HELD_SHARE of the tier's sequences
    (at least one), each at the longest prompt plus output length (prompts counted with the checkpoint's
    tokenizer) and a spare block: the engine caps a request's length at what the cache holds, so the longest one
    must fit whole."""
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    per_seq = max(len(tok(r.prompt)["input_ids"]) + r.max_tokens for r in requests)
    blocks = -(-per_seq // block_size) + 1
    held = max(1, concurrency // HELD_SHARE)
    return held * blocks * block_size * unquantized_bytes_per_token(checkpoint, dtype)


@dataclass(frozen=True)
class KVScrape:
    """What one /metrics scrape says about the cache: its storage's capacity and the preemptions so far."""

    capacity_tokens: int
    bytes_per_token: int
    preemptions: float

    @classmethod
    def read(cls, url: str) -> KVScrape:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        values = {name: v for (name, _), v in samples(text).items()}
        return cls(int(values["qtool_kv_cache_capacity_tokens"]), int(values["qtool_kv_cache_bytes_per_token"]),
                   values.get("vllm:num_preemptions_total", 0.0))


def _measure_one(checkpoint: str, engine: EngineConfig, reqs: list[BenchRequest], c: int, s: int,
                 seed: int) -> TierSummary:
    """Start one server, warm it up, run the requests, stop it: the tier summary plus the cache's figures."""
    with server_process(checkpoint, engine) as url:
        served = asyncio.run(served_models(url))[0]
        warm_up(url, served, seed=seed)
        before = KVScrape.read(url)
        res, duration = asyncio.run(run_load(url, served, reqs, concurrency=c, seed=s))
        after = KVScrape.read(url)
    return dataclasses.replace(summarize(res, duration), kv=KVFigures(
        engine.kv_cache_dtype, after.capacity_tokens, after.bytes_per_token, after.preemptions - before.preemptions))


def bench_kv_layer(checkpoint: str | Path, kv_cache_dtype: str, engine: EngineConfig | None = None, *,
                   concurrency: int = 32, kv_cache_memory: int | str | None = None, num_requests: int | None = None,
                   mean_output_tokens: int = 32, max_output_tokens: int = 64, workload: str | Workload = "long",
                   seed: int = 0, rounds: int = 3) -> dict[str, Any]:
    """The checkpoint with the unquantized and the `kv_cache_dtype` cache on the same requests, interleaved, then
    rounds - 1 more rounds of fresh requests. `kv_cache_memory` defaults to `limiting_budget` of the tier."""
    if kv_cache_dtype == UNQUANTIZED:
        raise QToolError("the KV cache layer compares a quantized cache with the unquantized one: pass "
                         "--kv-cache-dtype fp8 or int8")
    engine = (engine or EngineConfig()).replace(max_num_seqs=concurrency, max_model_len=None)
    traffic = as_workload(workload)
    labels = [label(UNQUANTIZED), label(kv_cache_dtype)]
    # per measurement (the tier's, then each round's): the counters TierLoop's rounds do not keep
    preemptions: dict[str, list[float]] = {x: [] for x in labels}
    decode: dict[str, list[float]] = {x: [] for x in labels}
    engines: dict[str, EngineConfig] = {}

    def measure(name: str, reqs: list[BenchRequest], c: int, s: int) -> TierSummary:
        out = _measure_one(str(checkpoint), engines[name], reqs, c, s, seed)
        assert out.kv is not None  # _measure_one adds the cache's figures to every summary
        preemptions[name].append(out.kv.preemptions)
        tpot = out.tpot.mean
        decode[name].append(1 / tpot if tpot else 0.0)
        return out

    loop = TierLoop(labels, measure, traffic, seed, mean_output_tokens, max_output_tokens, rounds)
    tiers = loop.plan([concurrency], num_requests)
    budget = kv_cache_memory or limiting_budget(checkpoint, tiers[0].requests, concurrency, engine.dtype,
                                                  engine.block_size)
    for dtype in (UNQUANTIZED, kv_cache_dtype):
        engines[label(dtype)] = engine.replace(kv_cache_dtype=dtype, kv_cache_memory=budget)
    tier = loop.run(tiers)[0]
    return {**provenance(checkpoint=str(checkpoint), workload_sha256=requests_sha256(loop.requests),
                         rounds_workload_sha256=requests_sha256(loop.round_requests)),
            "config": {"kv_cache_dtype": kv_cache_dtype, "kv_cache_memory": str(budget), "concurrency": concurrency,
                       "workload": traffic.describe(), "mean_output_tokens": mean_output_tokens,
                       "max_output_tokens": max_output_tokens, "seed": seed, "rounds": rounds,
                       "systems": labels},
            "tier": tier.to_json(), "preemptions": preemptions, "decode_tok_per_s": decode,
            "decode_ratio_rounds": ratio_rounds(decode, labels[1], labels[0]),
            "layer": KVLayerRow.from_tier(tier.results, tier.rounds or {}, labels).to_json()}


@dataclass(frozen=True)
class KVLayerRow:
    """The report's "KV cache" row: the quantized cache against the unquantized one at the same budget."""

    kv_cache_dtype: str
    capacity_tokens: dict[str, int]  # label -> tokens the budget holds
    capacity_ratio: float | None
    preemptions: dict[str, float]  # label -> preemptions in the tier's own measurement
    output_tok_per_s: dict[str, float]
    throughput_ratio: float | None  # the tier's own measurement
    throughput_ratio_rounds: dict[str, Any] | None = None  # ratio_over_rounds' figures

    @classmethod
    def from_tier(cls, results: dict[str, TierSummary], rounds: dict[str, list[float]],
                  labels: list[str]) -> KVLayerRow:
        """From the layer's tier: each cache's figures (the results _measure_one gave) and output tok/s."""
        base, quant = labels
        kv = {x: f for x in labels if x in results and (f := results[x].kv) is not None}
        cap = {x: f.kv_capacity_tokens for x, f in kv.items()}
        tps = {x: results[x].output_tok_per_s for x in kv}
        return cls(quant.removeprefix("kv_"), cap, cap[quant] / cap[base] if cap.get(base) and quant in cap else None,
                   {x: f.preemptions for x, f in kv.items()}, tps,
                   tps[quant] / tps[base] if tps.get(base) and quant in tps else None,
                   ratio_rounds(rounds, quant, base))

    def to_json(self) -> dict[str, Any]:
        return {"kv_cache_dtype": self.kv_cache_dtype, "capacity_tokens": self.capacity_tokens,
                "capacity_ratio": self.capacity_ratio, "preemptions": self.preemptions,
                "output_tok_per_s": self.output_tok_per_s, "throughput_ratio": self.throughput_ratio,
                "throughput_ratio_rounds": self.throughput_ratio_rounds}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVLayerRow:
        return cls(d["kv_cache_dtype"], dict(d["capacity_tokens"]), d.get("capacity_ratio"), dict(d["preemptions"]),
                   dict(d["output_tok_per_s"]), d.get("throughput_ratio"), d.get("throughput_ratio_rounds"))
