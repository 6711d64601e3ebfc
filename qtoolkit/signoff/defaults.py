"""The sign-off's defaults, written once: the configuration types (config.py) and `qtool signoff`'s flags both
read them.

A module of constants (and the two budgets that follow another flag), torch-free, so the CLI can build its parser
without importing the sign-off.
"""

from __future__ import annotations

MODEL = "default"
POLICY = "default"
LIMIT = 8  # items per eval task at the first look
# ACLSum ROUGE-L's per-item deltas spread ~0.09 (measurements/2026-12-01/rougeL-fp8-8items.json): the CI
# half-width is ~0.06 at 8 items and ~0.02 at 64, narrow enough to decide against the default policy's 0.05 bound
# unless the drop is near it
MAX_ITEMS = 64
CONCURRENCY = (1, 8)  # bench tiers
ROUNDS = 3  # of every ablation system at every tier: the speed gates' first look
DEPLOYMENT_ROUNDS = 5  # of both endpoints: a deployment has no ablation to spend rounds on
MAX_ROUNDS = 9  # the speed gates' budget while undecided
KV_CACHE_DTYPE = "auto"
SPECULATIVE = None  # no speculative layer: each proposer adds three ablation systems (about twice the bench step)
MEAN_OUTPUT_TOKENS = 48
DIAGNOSE_BATCHES = (1, 8)  # the baseline model's bottleneck diagnosis


def max_items(limit: int) -> int:
    """--max-items left out: the budget, or --limit if larger (then one look)."""
    return max(MAX_ITEMS, limit)


def max_rounds(rounds: int) -> int:
    """--max-rounds left out: the budget, or --rounds if larger (then one look)."""
    return max(MAX_ROUNDS, rounds)
