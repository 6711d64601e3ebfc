"""Sign-off policy and gates: judged on the worst CI bound; unknown tasks/metrics are refused."""

from __future__ import annotations

import pytest
from qtoolkit.evals.results import EvalResults
from qtoolkit.evals.stats.paired import paired_delta
from qtoolkit.evals.summary import TaskSummary

from qtoolkit.signoff.policy import METRICS, PolicyError, load_policy, read_metric
from qtoolkit.signoff.run import evaluate_gates


def test_default_policy_loads_and_names_known_metrics():
    p = load_policy("default")
    assert set(p.tasks) == {"code", "summarization", "custom"}
    for task, gates in p.tasks.items():
        assert set(gates) <= set(METRICS[task])


@pytest.mark.parametrize("body, words", [
    ("tasks:\n  poetry:\n    kld_mean: {max: 0.1}\n", "unknown task 'poetry'"),
    ("tasks:\n  code:\n    vibes: {max: 0.1}\n", "unknown metric 'vibes'"),
    ("tasks:\n  code:\n    kld_mean: {}\n", "needs `max` or `min`"),
    ("tasks:\n  code:\n    kld_mean: {max: 0.1}\nextra: 1\n", "extra"),
])
def test_bad_policies_are_refused(tmp_path, body, words):
    f = tmp_path / "p.yaml"
    f.write_text("version: 1\nname: p\n" + body)
    with pytest.raises(PolicyError, match=words):
        load_policy(f)


def test_gates_judge_the_worst_ci_bound():
    # one flipped item out of 8: the point drop is 0.125 but the CI reaches further
    summary = {"pass@1": paired_delta([1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], seed=0)}
    point, judged = read_metric(TaskSummary.from_json(summary), METRICS["code"]["pass_at_1_drop"])
    assert point == pytest.approx(0.125) and judged >= point
    nll = {"nll_canonical_solution": paired_delta([1.2, 1.0, 1.1], [1.0, 1.0, 1.0], seed=0)}
    point, judged = read_metric(TaskSummary.from_json(nll), METRICS["code"]["nll_delta"])
    assert judged >= point > 0


def test_verdict_inputs_missing_fail_the_gate(tmp_path):
    policy = load_policy("default")
    gates = evaluate_gates(policy, None, None, None)
    assert gates and not any(g.passed for g in gates)
    assert {g.detail for g in gates if g.name.startswith("code.")} == {"no code evaluation results"}


def test_identical_models_never_fail_quality_gates():
    same = [0.5, 0.2, 0.9, 0.4]
    summary = {"pass@1": paired_delta(same, same, seed=0),
               "nll_canonical_solution": paired_delta(same, same, seed=0),
               "text_stats": {"kld": {"mean_pm": [0.0, 0.0], "ci95": [0.0, 0.0]}}}
    evals = EvalResults.from_json({"tasks": {"code": {"summary": summary}}})
    policy = load_policy("default").model_copy(update={"tasks": {"code": load_policy().tasks["code"]}})
    gates = {g.name: g for g in evaluate_gates(policy, evals, None, None)}
    # four all-equal deltas are too few for a reliable interval (evals/stats/paired.py): undecided, never FAIL
    assert not any(gates[f"code.{m}"].verdict == "FAIL" for m in ("kld_mean", "nll_delta", "pass_at_1_drop"))
    assert gates["code.kld_mean"].passed
    # no bench results: never a silent PASS
    assert not gates["throughput.decode_tpot_ratio"].passed and not gates["throughput.prefill_ttft_ratio"].passed


def _bench_tier(base: float, full: float, rounds: dict[str, list[float]] | None) -> dict:
    res = {"completed": 16, "failed": 0, "duration_s": 2.0, "requests_per_s": 8.0}
    results = {"baseline_static": {**res, "output_tok_per_s": base},
               "baseline_continuous": {**res, "output_tok_per_s": base * 1.1},
               "candidate_static": {**res, "output_tok_per_s": base},
               "candidate_continuous": {**res, "output_tok_per_s": full}}
    tier = {"concurrency": 8, "num_requests": 16, "results": results}
    return {"tiers": [tier | ({"rounds": rounds} if rounds else {})],
            "config": {"systems": list(results)}}


def test_ratio_over_rounds_is_a_t_interval_on_log_ratios():
    from qtoolkit.evals.stats.paired import ratio_over_rounds

    r = ratio_over_rounds([12.0, 13.0, 12.5], [10.0, 10.0, 10.0])
    assert r["ratio"] == pytest.approx((1.2 * 1.3 * 1.25) ** (1 / 3))
    assert r["ci95"][0] < 1.2 and r["ci95"][1] > 1.3 and r["rounds"] == 3  # t(2) = 4.3: wider than the spread
    assert ratio_over_rounds([12.0], [10.0])["ci95"] is None
    with pytest.raises(ValueError):
        ratio_over_rounds([1.0, 2.0], [1.0])


def _full_stack_policy():
    """The older full-stack gate (still a deployment sign-off's): the default policy gates speed like with like."""
    policy = load_policy("default")
    return policy.model_copy(update={"throughput": policy.throughput.model_copy(update={"min_speedup": 1.0})})


@pytest.mark.parametrize("rounds, passed", [
    (None, False),  # one round: a 1.2x point bounds no noise, so INCONCLUSIVE, never a PASS
    ({"baseline_static": [10.0, 10.0, 10.0], "candidate_continuous": [12.0, 12.4, 11.8]}, True),
    # the same first round, then rounds that spread from 0.9x to 1.5x: the lower bound is below 1.0
    ({"baseline_static": [10.0, 10.0, 10.0], "candidate_continuous": [12.0, 9.0, 15.0]}, False),
])
def test_throughput_gate_judges_the_lower_bound_over_rounds(rounds, passed):
    from qtoolkit.bench.ablation import AblationBench

    ab = AblationBench.from_json(_bench_tier(10.0, 12.0, rounds)).table
    policy = _full_stack_policy()
    gate = {g.name: g for g in evaluate_gates(policy, None, ab, None)}["throughput.min_speedup"]
    assert gate.passed is passed
    if rounds:
        assert gate.judged < gate.point and "lower 95% bound over 3 rounds" in gate.detail
    else:
        assert gate.judged == gate.point == pytest.approx(1.2)
        assert gate.verdict == "INCONCLUSIVE" and "--rounds 3 or more" in gate.detail


def test_throughput_gate_names_its_interval_and_an_unreliable_one_decides_nothing():
    from qtoolkit.bench.ablation import AblationBench

    ab = AblationBench.from_json(_bench_tier(10.0, 12.0, {"baseline_static": [10.0, 10.0, 10.0],
                                                         "candidate_continuous": [12.0, 12.4, 11.8]})).table
    policy = _full_stack_policy()
    gate = {g.name: g for g in evaluate_gates(policy, None, ab, None)}["throughput.min_speedup"]
    assert gate.verdict == "PASS" and "log ratios" in gate.ci_method and gate.ci_coverage >= 0.93
    ab.tiers[-1].total_speedup_rounds["ci_reliable"] = False  # a round count the harness does not vouch for
    gate = {g.name: g for g in evaluate_gates(policy, None, ab, None)}["throughput.min_speedup"]
    assert gate.verdict == "INCONCLUSIVE" and not gate.passed and "too few rounds" in gate.detail


def test_extra_rounds_get_prompts_no_earlier_request_had():
    from qtoolkit.bench.loop import fresh_requests
    from qtoolkit.bench.workloads import build_workload

    used = build_workload("mixed", 20, seed=0, mean_output_tokens=8, max_output_tokens=16)
    fresh = fresh_requests("mixed", 16, used, seed=101, mean_output_tokens=8, max_output_tokens=16)
    assert len(fresh) == 16 and not {r.prompt for r in fresh} & {r.prompt for r in used}
    assert len({r.prompt for r in fresh}) == 16
