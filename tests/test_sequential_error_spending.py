"""Error spending over the sign-off's looks: the levels sum to 5%, each look's eval computes its intervals at its
own level, and the report states the overall error instead of K x 5%."""

from __future__ import annotations

import json

import numpy as np
import pytest
from qtoolkit.evals.stats.paired import Level, paired_delta
from qtoolkit.evals.summary import figure_from_json

from qtoolkit.commands.signoff import DEFAULT_MAX_ITEMS
from qtoolkit.signoff.error_spending import ALPHA, SPEND, SequentialRecord, plan, pocock_spent
from qtoolkit.signoff.judge import Gate
from qtoolkit.signoff.report import look_level, markdown
from qtoolkit.signoff.sequential import describe, design_of, draw_until_decisive, stages
from qtoolkit.signoff.verdict import SignoffReport
from qtoolkit.signoff.verdicts import INCONCLUSIVE, PASS, error_statement, judge_quality, reading


@pytest.mark.parametrize("looks", [[8, 16, 32, 64], [8, 16, 32, 40], [2, 4], [8, 64], [1, 2, 4, 8, 16, 32, 64]])
@pytest.mark.parametrize("alpha", [None, 0.05])
def test_spent_error_sums_to_the_design_total_and_grows_with_the_looks(looks, alpha):
    d = plan(looks, alpha)
    total = SPEND if alpha is None else alpha
    assert d.alpha == total and sum(d.look_alphas) == pytest.approx(total, abs=1e-12)
    assert d.spent[-1] == total and all(b > a for a, b in zip(d.spent, d.spent[1:], strict=False))
    assert all(a > 0 for a in d.look_alphas)
    assert all(1 - ALPHA < c < 1 for c in d.levels)  # every look is stricter than a single 95% look
    assert [d.level_at(n) for n in looks] == list(d.levels)
    assert d.level_at(looks[-1] + 1) == d.levels[-1]


def test_main_job_levels_and_single_look():
    d = design_of(8, DEFAULT_MAX_ITEMS)
    assert d.items == (8, 16, 32, 64) and SPEND <= ALPHA
    assert d.spent[0] == pytest.approx(pocock_spent(8 / 64))
    # each look's error share of 5%; each gate splits it between its PASS and FAIL ends (paired.side_errors)
    assert [round(c, 4) for c in d.levels] == [0.9903, 0.9919, 0.9869, 0.9810]
    assert [round(c, 4) for c in plan([8, 16, 32, 64], 0.03).levels] == [0.9942, 0.9951, 0.9921, 0.9886]
    assert design_of(8, 8).levels == (0.95,) and design_of(8, None).levels == (0.95,)
    assert pocock_spent(0) == 0 and pocock_spent(1) == pytest.approx(SPEND) and pocock_spent(2) == pocock_spent(1)
    with pytest.raises(ValueError, match="increasing"):
        plan([8, 8])
    with pytest.raises(ValueError, match="alpha"):
        plan([8, 16], alpha=1.5)


def test_each_look_computes_its_intervals_at_its_own_level():
    """A gate judged at look k reads an interval made at look k's level: the same items at 95% would PASS at the
    first look, the look's 99.42% interval straddles the bound, and the draw goes on."""
    rng = np.random.default_rng(3)
    base = rng.normal(2.0, 0.3, 64)
    cand = base + 0.03 + rng.normal(0, 0.02, 64)  # NLL-like per-item values, delta ~0.03
    seen: list[tuple[int, float, dict]] = []
    design = design_of(8, 64)

    def run(items: int, overwrite: bool, tasks: list[str] | None, level: Level) -> None:
        assert level.looks == len(design.items)  # the gates' two ends spend the look's error side by side
        summary = paired_delta(cand[:items], base[:items], np.full(items, 50.0), seed=0, shape="nll", level=level)
        seen.append((items, level.confidence, summary))

    def judge() -> tuple[list[Gate], list[Gate]]:
        fig = figure_from_json(seen[-1][2])
        j = judge_quality(fig, 1.0, False, max_=0.045, min_=None)
        return ([] if j.verdict == PASS else [Gate("code", "nll_delta", False, "undecided")]), []

    looks = draw_until_decisive(run, judge, 8, 64, resume=False)
    assert [(n, c) for n, c, _ in seen] == list(zip(design.items[:len(seen)], design.levels[:len(seen)], strict=True))
    assert [x.confidence for x in looks] == [c for _, c, _ in seen]
    first = seen[0][2]
    at95 = paired_delta(cand[:8], base[:8], np.full(8, 50.0), seed=0, shape="nll")  # outside a draw: 95%
    assert first["ci95"][1] > at95["ci95"][1]  # the look's interval is wider than the 95% one
    assert judge_quality(figure_from_json(at95), 1.0, False, max_=0.045, min_=None).verdict == PASS
    assert judge_quality(figure_from_json(first), 1.0, False, max_=0.045, min_=None).verdict == INCONCLUSIVE
    assert len(looks) >= 2


def test_report_states_the_overall_error_not_k_times_5_percent():
    looks = draw_until_decisive(lambda *a: None, lambda: ([Gate("code", "kld_mean", False, "undecided")], []), 8, 64, resume=False)
    seq = describe(looks, 64)
    assert seq.error_rate_bound == 0.05 and len(seq.looks) == 4
    assert SequentialRecord.from_json(json.loads(json.dumps(seq.to_json()))) == seq  # sequential.json reads back
    text = error_statement(seq)
    assert "at most 5% over its 4 looks" in text and "Pocock" in text and "8 items 0.97%" in text
    assert "PASS end" in text and "truth exactly on the policy's bound" in text
    assert "K x 5%" not in text
    notes = reading([], None, seq)
    assert any("4 look(s)" in n and "at most 5% over its 4 looks" in n for n in notes)
    assert error_statement(describe(looks[:1], 8)).startswith("One look (8 items 5.00% error)")
    legacy = {"looks": seq.to_json()["looks"][:3], "max_items": 64, "error_rate_bound": 0.15}  # of before designs
    assert "K x 5% = 15%" in error_statement(SequentialRecord.from_json(legacy))
    assert look_level(8, 64, 16) == pytest.approx(100 * design_of(8, 64).levels[1])
    assert look_level(8, None, 8) == 95.0
    assert stages(8, 64) == list(design_of(8, 64).items)


def test_report_markdown_names_each_tasks_level_and_the_overall_error():
    looks = draw_until_decisive(lambda *a: None, lambda: ([Gate("summarization", "rougeL_drop", False, "undecided")], []), 8, 64, resume=False)
    seq = describe(looks, 64)
    fig = paired_delta([0.5, 0.4, 0.6, 0.3] * 4, [0.5, 0.5, 0.6, 0.4] * 4, seed=0, shape="bounded")
    report = {"config": {"model": "m", "recipe": "r", "limit": 8, "max_items": 64}, "verdict": "INCONCLUSIVE",
              "policy": {"name": "default", "tasks": {}}, "created": "now", "reasons": [], "gates": [], "steps": {},
              "reading": reading([], None, seq), "eval": {"summarization": {"items": 16, "summary": {"rougeL": fig}}},
              "inputs": {}, "versions": {}, "machine": {}}
    md = markdown(SignoffReport.from_json(report))
    assert "| CI (look error 0.81%) |" in md and "95% CI" not in md
    assert "wrong with probability at most 5% over its 4 looks" in md and "K x 5%" not in md
