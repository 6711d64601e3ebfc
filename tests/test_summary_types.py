"""Typed eval summaries (evals/summary.py): every summary on disk reads into figures and writes back key for key,
and gates read the figures a policy names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qtoolkit.evals.stats.paired import paired_delta, ratio_over_rounds, token_stats
from qtoolkit.evals.summary import (
    PairedDelta,
    Rate,
    RoundsRatio,
    TaskSummary,
    TextStats,
    TokenStat,
    figure_from_json,
)

from qtoolkit.signoff.policy import METRICS, metric_figure, read_metric

MEASUREMENTS = Path(__file__).resolve().parent.parent / "measurements"


def _shipped_summaries() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(MEASUREMENTS.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        tasks = data.get("eval") or data.get("tasks") if isinstance(data, dict) else None
        for task, entry in (tasks or {}).items() if isinstance(tasks, dict) else ():
            if isinstance(entry, dict) and isinstance(entry.get("summary"), dict):
                out.append((f"{path.name}:{task}", entry["summary"]))
    return out


SHIPPED = _shipped_summaries()


def test_measurements_hold_summaries_to_check():
    assert len(SHIPPED) >= 10


@pytest.mark.parametrize("name, summary", SHIPPED, ids=[n for n, _ in SHIPPED])
def test_every_shipped_summary_round_trips_key_for_key(name, summary):
    typed = TaskSummary.from_json(summary)
    assert json.dumps(typed.to_json()) == json.dumps(summary)  # same keys, same order, same values
    # every paired delta, token statistic and rate became a figure (only isolation-like records stay JSON)
    for key, value in typed.entries.items():
        if isinstance(value, dict):
            assert not ({"delta", "mean_pm", "rate"} & set(value)), (name, key)
    for stats in typed.text_sets().values():
        assert all(not isinstance(v, dict) or "mean_pm" not in v for v in stats.entries.values())


def test_a_summary_built_now_reads_into_typed_figures():
    records = [{"tokens": 3, "nll_candidate": [1.0, 1.2, 0.9], "nll_baseline": [1.0, 1.0, 1.0],
                "kld": [0.01, 0.02, 0.03], "same_top1": [1, 1, 0]},
               {"tokens": 2, "nll_candidate": [2.0, 2.1], "nll_baseline": [2.0, 2.0], "kld": [0.0, 0.05],
                "same_top1": [1, 0]}]
    raw = {"pass@1": paired_delta([1, 0, 1], [1, 1, 1], seed=0), "greedy_agreement": {"rate": 0.5, "items": 2},
           "text_stats": token_stats(records, seed=0), "isolation": {"mode": "bubblewrap"}}
    s = TaskSummary.from_json(raw)
    p = s.figure("pass@1")
    assert isinstance(p, PairedDelta) and p.items == 3 and p.delta == pytest.approx(-1 / 3) and p.ci.complete
    assert isinstance(s.figure("greedy_agreement"), Rate) and s.get("isolation") == {"mode": "bubblewrap"}
    assert isinstance(s.text_stats, TextStats) and s.text_stats.tokens == 5
    kld = s.text_stats.figure("kld")
    assert isinstance(kld, TokenStat) and kld.extra["p99"] > 0 and kld.ci.method
    assert s.to_json() == raw and list(s.to_json()) == list(raw)
    # what the policy's metrics read: a drop is the negated delta, judged at the CI end worst for the candidate
    point, judged = read_metric(s, METRICS["code"]["pass_at_1_drop"])
    assert point == pytest.approx(1 / 3) and judged == pytest.approx(-p.ci.bounds[0])
    assert metric_figure(s, METRICS["code"]["kld_p99"]) == kld.extra["p99"]
    assert read_metric(s, METRICS["code"]["kld_mean"])[1] == kld.ci.bounds[1]


def test_nodes_of_other_shapes_stay_json_and_are_never_figures():
    assert figure_from_json({"delta": 0.1, "note": "x"}) is None
    assert figure_from_json([1, 2]) is None
    s = TaskSummary.from_json({"pass@1": {"candidate": 1, "baseline": 1, "delta": 0, "surprise": True}})
    assert s.figure("pass@1") is None and s.to_json()["pass@1"]["surprise"] is True
    assert read_metric(s, METRICS["code"]["pass_at_1_drop"]) == (None, None)
    assert TaskSummary.from_json(None).to_json() == {}


def test_rounds_ratio_reads_the_rounds_figure():
    r = RoundsRatio.from_json(ratio_over_rounds([2.0, 2.2, 1.9], [1.0, 1.0, 1.0]))
    assert r.rounds == 3 and len(r.per_round) == 3 and r.ci.complete and r.ci.bounds[0] < r.ratio < r.ci.bounds[1]
    assert RoundsRatio.from_json(None) is None
