"""The speed gates: candidate vs baseline under the same serving configuration at every tier, decode (TPOT) and
prefill (TTFT) ratios judged on intervals over paired rounds at the level of the look the rounds stopped at; a
missing or non-finite interval end never passes; the false PASS rate at the bound stays within 5%."""

from __future__ import annotations

import math

import pytest

from qtoolkit.bench.ablation import AblationBench, AblationRow, speed_pair
from qtoolkit.bench.loop import TierRecord
from qtoolkit.bench.summary import TierSummary
from qtoolkit.signoff.judge import evaluate_gates
from qtoolkit.signoff.policy import Policy, load_policy
from qtoolkit.signoff.speed import round_looks, speed_design, undecided
from qtoolkit.signoff.speed_simulation import simulate

PAIR = ["baseline_continuous_spec", "candidate_continuous_spec"]


def _bench(tpot: dict[int, tuple[list, list]], ttft: dict[int, tuple[list, list]] | None = None,
           looks=(3, 5, 7, 9), rounds: int | None = None) -> AblationBench:
    tiers = []
    for c, (base, cand) in tpot.items():
        tb, tc = (ttft or {}).get(c, ([0.1] * len(base), [0.1] * len(cand)))
        tiers.append({"concurrency": c, "num_requests": 4, "results": {},
                      "rounds": {PAIR[0]: [10.0] * len(base), PAIR[1]: [10.0] * len(cand)},
                      "rounds_tpot": {PAIR[0]: base, PAIR[1]: cand}, "rounds_ttft": {PAIR[0]: tb, PAIR[1]: tc}})
    n = rounds or len(next(iter(tpot.values()))[0])
    return AblationBench.from_json({"tiers": tiers, "config": {"rounds": looks[0]},
                                    "speed_rounds": {"pair": PAIR, "looks": list(looks), "rounds": n}})


def _gates(bench: AblationBench, policy: Policy | None = None) -> dict:
    return {g.name: g for g in evaluate_gates(policy or load_policy("default"), None, None, None, bench)
            if g.task == "throughput"}


def test_the_pair_is_the_same_serving_configuration_with_and_without_the_recipe():
    assert speed_pair(["baseline_static", "baseline_continuous", "candidate_continuous"]) == \
        ("baseline_continuous", "candidate_continuous")
    assert speed_pair(["baseline_continuous_spec", "candidate_continuous_spec"]) == tuple(PAIR)


def test_a_clearly_faster_decoder_passes_every_tier_and_names_the_level():
    fast = ([0.030, 0.031, 0.029], [0.010, 0.0105, 0.0098])  # 3x faster per stream
    g = _gates(_bench({1: fast, 8: fast}, looks=(3, 5, 7, 9), rounds=3))
    assert set(g) == {f"throughput.{m}@c{c}" for m in ("decode_tpot_ratio", "prefill_ttft_ratio") for c in (1, 8)} \
        | {"throughput.capacity_ratio"}
    assert g["throughput.capacity_ratio"].verdict == "NO EVIDENCE"  # this bench ran no capacity searches
    d = g["throughput.decode_tpot_ratio@c1"]
    assert d.verdict == "PASS" and d.point == pytest.approx(3.0, rel=0.05)
    level = speed_design((3, 5, 7, 9)).levels[0]
    assert f"{level:.2%} interval over 3 paired rounds" in d.detail and "concurrency 1" in d.detail
    assert d.judged < d.point and "log ratios" in d.ci_method
    assert g["throughput.prefill_ttft_ratio@c8"].verdict == "PASS"  # equal TTFT: lower bound 1 >= 0.9


def test_a_slower_decoder_fails_and_a_slower_prefill_fails_non_inferiority():
    slow = ([0.030, 0.030, 0.031, 0.029, 0.030], [0.036, 0.035, 0.037, 0.036, 0.035])  # 0.83x
    late = ([0.10, 0.11, 0.10, 0.10, 0.105], [0.14, 0.15, 0.14, 0.145, 0.14])  # first token 0.72x
    g = _gates(_bench({1: slow}, {1: late}))
    assert g["throughput.decode_tpot_ratio@c1"].verdict == "FAIL"
    assert g["throughput.prefill_ttft_ratio@c1"].verdict == "FAIL"
    assert "< min 0.9" in g["throughput.prefill_ttft_ratio@c1"].detail


def test_straddling_is_inconclusive_and_asks_for_more_rounds():
    noisy = ([0.030, 0.030, 0.030], [0.026, 0.034, 0.030])
    bench = _bench({1: noisy})
    assert _gates(bench)["throughput.decode_tpot_ratio@c1"].verdict == "INCONCLUSIVE"
    assert undecided(bench, load_policy("default"))
    # at the last look nothing is left to add: the verdict stands as it is


@pytest.mark.parametrize("bad", [None, math.nan, 0.0, math.inf])
def test_a_missing_or_non_finite_figure_never_passes(bad):
    tpot = ([0.03, 0.03, 0.03], [0.01, bad, 0.01])
    g = _gates(_bench({1: tpot}))["throughput.decode_tpot_ratio@c1"]
    assert g.verdict != "PASS" and not g.passed


def test_one_round_or_no_bench_decides_nothing():
    g = _gates(_bench({1: ([0.03], [0.01])}, looks=(1,)))["throughput.decode_tpot_ratio@c1"]
    assert g.verdict == "INCONCLUSIVE" and "--rounds 3" in g.detail
    g = _gates({})
    assert g and all(x.verdict == "NO EVIDENCE" and not x.passed for x in g.values())


def test_a_tier_the_policy_names_but_the_bench_lacks_is_no_evidence():
    policy = load_policy("default")
    policy = policy.model_copy(update={"throughput": policy.throughput.model_copy(update={"tiers": [1, 32]})})
    fast = ([0.030, 0.031, 0.029], [0.010, 0.0105, 0.0098])
    g = _gates(_bench({1: fast}), policy)
    assert g["throughput.decode_tpot_ratio@c1"].verdict == "PASS"
    assert g["throughput.decode_tpot_ratio@c32"].verdict == "NO EVIDENCE"


def test_round_looks_and_their_levels_spend_five_percent():
    assert round_looks(3, 9) == (3, 5, 7, 9) and round_looks(3, 3) == (3,) and round_looks(3, 8) == (3, 5, 7, 8)
    d = speed_design((3, 5, 7, 9))
    assert sum(1 - c for c in d.levels) == pytest.approx(0.05)
    assert speed_design((3,)).levels == (pytest.approx(0.95),)


def test_ablation_rows_give_every_layer_an_interval_over_rounds():
    tier = TierRecord(8, 16, {s: TierSummary.from_json({"completed": 16, "failed": 0, "duration_s": 1.0,
                                                       "output_tok_per_s": v, "requests_per_s": 16.0}) for s, v in
                              (("baseline_static", 10.0), ("baseline_continuous", 12.0),
                               ("baseline_continuous_spec", 11.0), ("candidate_static", 9.0),
                               ("candidate_continuous_spec", 13.0), ("baseline_static_spec", 10.5))},
                      rounds={"baseline_static": [10, 10.2, 9.8], "baseline_continuous": [12, 12.1, 11.9],
                              "baseline_continuous_spec": [11, 10.8, 10.9], "candidate_static": [9, 9.1, 8.9],
                              "candidate_continuous_spec": [13, 13.2, 12.8, 13.1, 13.0],
                              "baseline_static_spec": [10.5, 10.4, 10.6]})
    row = AblationRow.from_tier(tier)
    assert set(row.marginal_rounds) == {"+ continuous batching", "+ speculative decoding",
                                        "+ quantization (full stack)"}
    assert set(row.alone_rounds) == {"continuous batching", "speculative decoding", "quantization"}
    assert row.marginal_rounds["+ speculative decoding"]["rounds"] == 3
    assert row.speculation_pays == "no"  # 11 / 12 in every round: speculation costs here
    assert AblationRow.from_json(row.to_json()) == row


@pytest.mark.parametrize("spread", [0.02, 0.1, 0.3])
def test_false_pass_at_the_bound_is_within_five_percent(spread):
    # the full grid (20,000 runs per cell) is speed_simulation's own run; here a quick check of the default schedule
    cell = simulate(spread, 3, 9, runs=4000, seed=7)
    assert cell.false_pass_any_look <= 0.05 and cell.false_pass_stopping <= cell.false_pass_any_look
    assert cell.looks == [3, 5, 7, 9]


def test_a_sweeps_share_reaches_the_speed_gates_and_the_ablations_rounds():
    """A sweep re-judges a candidate's bench at its family-wise share (signoff/family.py): the level is passed
    to the bench read, and both the speed gates and the ablation's intervals over rounds are made at it."""
    fast = ([0.030, 0.031, 0.029], [0.010, 0.0105, 0.0098])
    nominal, share = _bench({1: fast}, rounds=3), _bench({1: fast}, rounds=3)
    share = AblationBench(share.tiers, share.systems, share.rounds, share.speed_rounds, 1 - 0.05 / 3)
    at = {name: _gates(b)["throughput.decode_tpot_ratio@c1"] for name, b in (("all", nominal), ("share", share))}
    assert f"{speed_design((3, 5, 7, 9), 0.05 / 3).levels[0]:.2%} interval" in at["share"].detail
    assert at["share"].judged < at["all"].judged  # a stricter level, a lower end further from the point
    rounds = {PAIR[0]: [10.0, 11.0, 10.5], PAIR[1]: [20.0, 21.5, 20.2]}
    from qtoolkit.bench.ablation import paired_rounds
    wide, narrow = paired_rounds(rounds, PAIR[1], PAIR[0], 0.99), paired_rounds(rounds, PAIR[1], PAIR[0])
    assert wide["ci95"][0] < narrow["ci95"][0]
