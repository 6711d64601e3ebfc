"""qtoolkit's serving engine as an eval backend: the product path (`--backend engine`, the default)."""

from __future__ import annotations

from typing import Any

from qtoolkit.engine import Engine, EngineConfig, SamplingParams
from qtoolkit.model.sources import resolve_model

from .base import GeneratedText, GenParams, Scored, scored_from_logprobs


class EngineBackend:
    name = "engine"
    full_distributions = True

    def __init__(self, spec: str, kv_cache_memory: str = "1GiB", kv_cache_dtype: str = "auto", **_: Any):
        self.source = resolve_model(spec)
        self.kv_cache_dtype = kv_cache_dtype
        self.engine = Engine(str(self.source.path), EngineConfig(kv_cache_memory=kv_cache_memory,
                                                                 kv_cache_dtype=kv_cache_dtype))
        self.tokenizer = self.engine.tokenizer

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, **self.source.describe(), "kv_cache_dtype": self.kv_cache_dtype}

    def generate(self, prompts: list[str], params: GenParams) -> list[GeneratedText]:
        sp = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                            stop=list(params.stop), seed=params.seed)
        outs = self.engine.generate(prompts, sp)
        return [GeneratedText(o.text, list(o.token_ids), o.finish_reason or "length") for o in outs]

    def score(self, token_ids: list[list[int]]) -> list[Scored]:
        rows = self.engine.score(token_ids)
        return [scored_from_logprobs(lp, ids) for lp, ids in zip(rows, token_ids, strict=True)]
