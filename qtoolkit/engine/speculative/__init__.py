"""Speculative decoding: proposers (prompt lookup, draft model, quantized self-draft), lossless verification and
the load-aware policy, tied together by the Speculator (propose -> verify -> roll back). `build_proposer` turns
the user's `--speculative` value into a proposer at start-up and fails there, with one clear message, on anything
it cannot use."""

from __future__ import annotations

from ..speculative_spec import USAGE, SpeculativeConfigError, SpeculativeSpec
from .base import MAX_SPECULATIVE_TOKENS, Proposal, Proposer
from .builder import build_proposer, check_speculative_args
from .metrics import SpeculativeMetrics
from .policy import DEFAULT_MAX_VERIFY_TOKENS, SpeculationPolicy
from .speculator import Speculator
from .verify import verify

__all__ = ["MAX_SPECULATIVE_TOKENS", "DEFAULT_MAX_VERIFY_TOKENS", "USAGE", "Proposal", "Proposer",
           "SpeculationPolicy", "SpeculativeConfigError", "SpeculativeMetrics", "SpeculativeSpec", "Speculator", "build_proposer",
           "check_speculative_args", "verify"]
