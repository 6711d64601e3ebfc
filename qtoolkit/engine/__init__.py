"""The serving engine: continuous batching over a paged KV cache (nano-vllm style, one concept per module).

The engine's names load on first use (PEP 562), so `qtoolkit.engine.config` can be imported without torch
(start-up time: `qtool --help` builds every command's engine flags from it)."""

from __future__ import annotations

import importlib
from typing import Any

from .config import EngineConfig
from .params import EngineInputError, RequestOutput, SamplingParams

__all__ = ["Engine", "EngineCapacityError", "EngineConfig", "EngineInputError", "EngineStats", "RequestOutput",
           "SamplingParams"]
_LAZY = {"Engine": ".engine", "EngineCapacityError": ".engine", "EngineStats": ".stats"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
