"""Build the backend for one side of a comparison: `engine`, `hf`, or any OpenAI-compatible endpoint.

The factory lives apart from evals/backends/base.py (the types every backend shares) so that no backend module and
the module it implements import each other.
"""

from __future__ import annotations

from typing import Any

from .base import Backend, BackendError
from .endpoint import OpenAIBackend
from .engine import EngineBackend
from .hf import HFBackend

BACKENDS = ("engine", "hf")


def make_backend(spec: str | None, *, kind: str = "engine", endpoint: str | None = None,
                 tokenizer_from: str | None = None, **options: Any) -> Backend:
    """Build the backend for one side of the comparison (candidate or baseline)."""
    if endpoint:
        return OpenAIBackend(endpoint, model_spec=spec, tokenizer_spec=tokenizer_from, **options)
    if spec is None:
        raise BackendError("no model given: pass --model/--baseline, or --endpoint/--baseline-endpoint URL")
    if kind == "hf":
        return HFBackend(spec, **options)
    if kind == "engine":
        return EngineBackend(spec, **options)
    raise BackendError(f"unknown backend {kind!r}: use one of {', '.join(BACKENDS)}")
