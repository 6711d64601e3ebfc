"""Engine-side speculation figures scraped from /metrics and differenced over a tier, and the modelled ceiling."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from qtoolkit.bench.spec_ceiling import (
    SpeculationCeiling,
    TierSpeculation,
    parse_speculative,
    speculation_ceiling,
    tier_delta,
)
from qtoolkit.engine.stats import EngineStats, SpeculativeStats
from qtoolkit.server.metrics import ServerMetrics


def _stats(drafted: int, accepted: int, proposed_at: list[int], accepted_at: list[int], propose: float,
           verify: float) -> EngineStats:
    return EngineStats(speculative=SpeculativeStats(
        draft_tokens=drafted, accepted_tokens=accepted, proposed_at=proposed_at, accepted_at=accepted_at,
        proposer_seconds=propose, verify_seconds=verify, steps_with_speculation=drafted,
        steps_without_speculation=1, verify_steps=drafted, draft_cost_ratio=0.3, verify_cost_per_token=0.1))


def test_metrics_text_reads_back_as_the_engine_stats():
    m = ServerMetrics()
    stats = _stats(10, 6, [6, 4], [4, 2], 1.0, 4.0)
    m.record_stats(stats)
    assert parse_speculative(m.render().decode()) == stats.speculative


def test_scrapes_difference_into_one_tier():
    m = ServerMetrics()
    assert parse_speculative(m.render().decode()) is None  # a server without speculation
    m.record_stats(_stats(10, 6, [6, 4], [4, 2], 1.0, 4.0))
    before = parse_speculative(m.render().decode())
    m.record_stats(_stats(30, 20, [16, 14], [12, 8], 2.0, 10.0))
    typed = tier_delta(before, parse_speculative(m.render().decode()))
    assert TierSpeculation.from_json(typed.to_json()) == typed  # a bench JSON's block reads back as it was
    tier = typed.to_json()
    assert tier["draft_tokens"] == 20 and tier["accepted_tokens"] == 14
    assert tier["acceptance_by_position"] == [0.8, 0.6]  # (12-4)/(16-6), (8-2)/(14-4)
    assert tier["proposer_seconds"] == 1.0 and tier["verify_seconds"] == 6.0
    assert tier["proposer_share"] == pytest.approx(1 / 7, abs=1e-4)
    assert tier["draft_cost_ratio"] == 0.3 and tier["verify_cost_per_token"] == 0.1


def test_ceiling_follows_the_cost_model():
    free = TierSpeculation(acceptance_by_position=[0.5], draft_cost_ratio=0.0, verify_cost_per_token=0.0)
    c = speculation_ceiling(free, num_speculative_tokens=4, prefill_share=0.5)
    assert c.full_acceptance.best_k == 4
    assert c.full_acceptance.decode_speedup == pytest.approx(5.0, abs=0.01)  # k + 1 tokens for one step
    assert c.full_acceptance.request_speedup == pytest.approx(1 / (0.5 + 0.5 / 5.0), abs=0.01)
    assert c.measured_acceptance.decode_speedup == pytest.approx(1.9375, abs=1e-3)  # (1 - .5^5) / .5
    assert SpeculationCeiling.from_json(json.loads(json.dumps(c.to_json()))) == c  # a bench JSON's block reads back
    # a draft costing 0.3 of a verification caps even perfect acceptance well below k + 1
    costly = replace(free, draft_cost_ratio=0.3, verify_cost_per_token=0.1, acceptance_by_position=[0.9])
    c = speculation_ceiling(costly, num_speculative_tokens=4, prefill_share=0.2)
    assert c.full_acceptance.decode_speedup < 2.2
    assert c.measured_acceptance.request_speedup < c.full_acceptance.request_speedup
    useless = replace(costly, acceptance_by_position=[0.0])
    assert speculation_ceiling(useless, num_speculative_tokens=4, prefill_share=0.2) \
        .measured_acceptance.request_speedup == 1.0  # the policy would decode plainly
