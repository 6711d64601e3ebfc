"""A sign-off over several recipes: the family-wise shares, the recommendation and its exit codes, the baseline's
completions generated once, and bad input refused before any work (the end-to-end sweep is in test_signoff.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from qtoolkit.evals.backends.base import GeneratedText, GenParams
from qtoolkit.evals.backends.cached import CachedGenerations

from qtoolkit.cli import main
from qtoolkit.signoff.error_spending import plan
from qtoolkit.signoff.family import fallback, look_levels
from qtoolkit.signoff.judge import Gate
from qtoolkit.signoff.policy import load_policy
from qtoolkit.signoff.ranking import Bought, Row, limit_fraction, ranked, recommendation, worst_gate
from qtoolkit.signoff.sequential import stages


def test_fallback_hands_a_passing_share_on_and_restarts_after_a_failure():
    a = 0.05
    assert fallback(["fp8", "int4", "int3"], lambda n, s: True) == pytest.approx(
        {"fp8": a / 3, "int4": 2 * a / 3, "int3": a})
    shares = fallback(["fp8", "int4", "int3"], lambda n, s: n != "int4")
    assert shares == pytest.approx({"fp8": a / 3, "int4": 2 * a / 3, "int3": a / 3})
    assert fallback(["fp8", "int4"], lambda n, s: False) == pytest.approx({"fp8": a / 2, "int4": a / 2})


def test_family_look_levels_are_the_signoffs_design_scaled_to_the_share():
    full = look_levels(8, 64, 0.05)
    design = plan(stages(8, 64))
    assert list(full.values()) == pytest.approx(list(design.levels))
    third = look_levels(8, 64, 0.05 / 3)
    assert all(third[n] > full[n] for n in full)  # stricter at every look
    assert sum(1 - v for v in third.values()) == pytest.approx(design.alpha / 3)
    assert look_levels(8, 8, 0.05 / 2) == pytest.approx({8: 1 - 0.025})  # one look: the share itself


def _row(name: str, verdict: str, family: str, ratio: float, worst: float | None = 0.5, reasons=(),
         bought: Bought | None = None) -> Row:
    return Row(name, verdict, family, 0.05 / 3, ratio, bought, "code.kld_mean", worst, worst, list(reasons), None)


def test_recommendation_is_the_cheapest_family_pass_and_exit_codes_follow_the_rule():
    rows = [_row("fp8", "PASS", "PASS", 0.50), _row("int4", "PASS", "PASS", 0.27),
            _row("int3", "FAIL", "FAIL", 0.20, 3.0, ["gate code.kld_mean fail: ..."])]
    name, line, code = recommendation(rows)
    assert (name, code) == ("int4", 0) and line.startswith("ship `int4`: quality passes every gate")
    assert [r.name for r in ranked(rows)] == ["int4", "fp8", "int3"]
    # passes alone but not at its family share: nothing recommended, undecided (3)
    name, line, code = recommendation([_row("fp8", "PASS", "INCONCLUSIVE", 0.5), _row("int3", "FAIL", "FAIL", 0.2)])
    assert (name, code) == (None, 3) and "passes on its own" in line
    # every candidate fails: 1, and the line names the closest and why
    name, line, code = recommendation([_row("a", "FAIL", "FAIL", 0.5, 1.2, ["gate x fail: far"]),
                                       _row("b", "FAIL", "FAIL", 0.2, 4.0, ["gate y fail: farther"])])
    assert (name, code) == (None, 1) and "the closest is `a` because gate x fail: far" in line
    assert recommendation([_row("a", "INCONCLUSIVE", "INCONCLUSIVE", 0.5), _row("b", "FAIL", "FAIL", 0.2)])[2] == 3
    assert recommendation([_row("a", "ERROR", "ERROR", 0.5, None), _row("b", "FAIL", "FAIL", 0.2)])[2] == 2


def test_the_ranking_puts_what_a_deployment_buys_before_weight_bytes():
    slo = "p99 TTFT <= 2000 ms"
    rows = [_row("int4", "PASS", "PASS", 0.27, bought=Bought("capacity", 1.2, (0.95, 1.5), slo=slo)),
            _row("fp8", "PASS", "PASS", 0.50, bought=Bought("capacity", 1.7, (1.4, 2.1), slo=slo)),
            _row("int8", "PASS", "PASS", 0.52, bought=Bought("capacity", 1.7, (1.4, 2.1), slo=slo))]
    assert [r.name for r in ranked(rows)] == ["fp8", "int8", "int4"]  # the lower bound, then the bytes
    name, line, _ = recommendation(rows)
    assert name == "fp8" and "1.7x [1.4, 2.1] the requests/s at p99 TTFT <= 2000 ms" in line
    assert rows[1].to_json()["throughput"] == {"what": "capacity", "ratio": 1.7, "ci": [1.4, 2.1],
                                              "concurrency": 0, "slo": slo}


def test_worst_gate_skips_a_gate_without_evidence():
    policy = load_policy("default")
    gates = [Gate("code", "pass_at_1_drop", False, "", 0.0, 0.5, verdict="NO EVIDENCE", required=False),
             Gate("code", "kld_mean", True, "", 0.01, 0.05, verdict="PASS")]
    assert worst_gate(gates, policy) == ("code.kld_mean", pytest.approx(0.5))


def test_limit_fraction_reads_each_gate_against_its_own_limit():
    policy = load_policy("default")
    assert limit_fraction(Gate("code", "kld_mean", True, "", 0.01, 0.05), policy) == pytest.approx(0.5)
    # the speed gates: decode against min_decode_speedup 1.0, prefill against 1 - prefill_margin 0.9
    assert limit_fraction(Gate("throughput", "decode_tpot_ratio@c8", True, "", 1.3, 1.25), policy) == \
        pytest.approx(0.8)
    assert limit_fraction(Gate("throughput", "prefill_ttft_ratio@c1", True, "", 1.0, 0.9), policy) == \
        pytest.approx(1.0)
    assert limit_fraction(Gate("memory", "max_linear_ratio_vs_bf16", True, "", 0.5, 0.5), policy) == pytest.approx(
        0.5 / 0.55)
    assert limit_fraction(Gate("code", "kld_mean", False, "no evidence"), policy) is None


class _Counting:
    name, tokenizer, full_distributions = "fake", None, True

    def __init__(self):
        self.prompts: list[str] = []

    def describe(self):
        return {"backend": "fake"}

    def generate(self, prompts, params):
        self.prompts += prompts
        return [GeneratedText(p.upper(), [len(p)], "stop") for p in prompts]

    def score(self, token_ids):
        return []


def test_baseline_completions_are_generated_once_and_survive_a_torn_line(tmp_path):
    path = tmp_path / "baseline" / "generations.jsonl"
    first = _Counting()
    cached = CachedGenerations(first, path, {"sha256": "abc"})
    params = GenParams(max_tokens=8)
    assert [g.text for g in cached.generate(["a", "b"], params)] == ["A", "B"]
    assert first.prompts == ["a", "b"]
    with path.open("a") as f:
        f.write('{"key": "torn')  # a crash mid-line
    second = _Counting()
    again = CachedGenerations(second, path, {"sha256": "abc"})
    out = again.generate(["b", "c", "a"], params)
    assert [g.text for g in out] == ["B", "C", "A"] and second.prompts == ["c"]  # only the new prompt ran
    assert (again.hits, again.misses) == (2, 1)
    # another baseline, or other generation parameters, never read these completions
    other = _Counting()
    CachedGenerations(other, path, {"sha256": "def"}).generate(["a"], params)
    CachedGenerations(other, path, {"sha256": "abc"}).generate(["a"], GenParams(max_tokens=9))
    assert other.prompts == ["a", "a"]


@pytest.mark.parametrize("recipes, message", [
    ("fp8-dynamic,no-such-recipe", "no-such-recipe"),
    ("fp8-dynamic,fp8-dynamic", "twice"),
])
def test_bad_recipe_list_is_refused_before_any_work(tmp_path, capsys, recipes, message):
    out = tmp_path / "sweep"
    assert main(["signoff", "--model", "default", "--recipe", recipes, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_rejudge_of_a_sweep_is_refused(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["signoff", "--recipe", "fp8-dynamic,int4-rtn", "--rejudge", "--output", str(out)]) == 2
    assert "rerun the same command" in capsys.readouterr().err
    assert not Path(out).exists()

