"""What a benchmark measures side by side: each system is a value (which checkpoint, batching, proposer), not a
name to parse. Its `label` is the key its figures have in the result JSON, so readers of bench files rely on it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..engine.config import EngineConfig

ENGINE, ENDPOINT, HF = "engine", "endpoint", "hf"


@dataclass(frozen=True)
class System:
    batching: str = "continuous"
    speculative: str | None = None  # the proposer, None without speculation
    quant: str | None = None  # the ablation's "baseline" or "candidate" checkpoint; None: the one --model
    kind: str = ENGINE  # engine (a server we start), endpoint (someone's server) or hf (transformers generate)

    @property
    def label(self) -> str:
        if self.kind != ENGINE:
            return self.kind
        if self.quant is not None:  # the ablation's names: baseline_static, candidate_continuous_spec, ...
            return f"{self.quant}_{self.batching}" + ("_spec" if self.speculative else "")
        return self.batching + (f"+{self.speculative}" if self.speculative else "")

    @property
    def plain(self) -> System:
        """The same system without speculation: what a speculative system's speedup is measured against."""
        return dataclasses.replace(self, speculative=None)

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The server's engine options: `base` (the command's engine flags) with this system's batching and
        proposer."""
        return base.replace(batching=self.batching, speculative=self.speculative)


def serve_systems(batching: list[str], speculative: list[str]) -> list[System]:
    """`qtool bench serve`'s systems: each batching mode alone, then with each proposer."""
    return [System(mode, proposer) for mode in batching for proposer in [None, *speculative]]
