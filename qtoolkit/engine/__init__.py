"""The serving engine: continuous batching over a paged KV cache (nano-vllm style, one concept per module)."""

from .engine import Engine, EngineCapacityError
from .params import EngineInputError, RequestOutput, SamplingParams

__all__ = ["Engine", "EngineCapacityError", "EngineInputError", "RequestOutput", "SamplingParams"]
