"""Three verdicts per gate, four exit codes: PASS 0, FAIL 1, error 2, INCONCLUSIVE 3, through `qtool signoff
--rejudge` on fabricated step outputs (so each path runs in seconds, without models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qtoolkit.evals.results import EvalResults
from qtoolkit.evals.stats.paired import paired_delta
from qtoolkit.evals.summary import figure_from_json

from qtoolkit.cli import main
from qtoolkit.signoff.judge import Gate
from qtoolkit.signoff.policy import load_policy
from qtoolkit.signoff.run import evaluate_gates
from qtoolkit.signoff.verdicts import FAIL, INCONCLUSIVE, NO_EVIDENCE, PASS, judge_quality, overall

POLICY = ("version: 1\nname: t\ntasks:\n  code:\n    kld_mean: {max: 0.10}\n"
          "    pass_at_1_drop: {max: 0.15, min_baseline_share: 0.25}\n")


def _kld(lo: float, hi: float, **extra) -> dict:
    return {"mean_pm": [(lo + hi) / 2, (hi - lo) / 4], "ci95": [lo, hi], **extra}


def _summary(kld: dict, cand: list[int], base: list[int]) -> dict:
    return {"pass@1": paired_delta(cand, base, seed=0), "text_stats": {"kld": kld},
            "isolation": {"mode": "bubblewrap", "layers": ["pid namespace", "mount namespace"], "missing": []}}


@pytest.mark.parametrize("kld, verdict", [
    (_kld(0.01, 0.02), PASS), (_kld(0.3, 0.4), FAIL), (_kld(0.05, 0.15), INCONCLUSIVE),
    (_kld(0.01, 0.02, ci_reliable=False, ci_method="bootstrap"), INCONCLUSIVE),
])
def test_kld_gate_verdicts(kld, verdict):
    j = judge_quality(figure_from_json(kld), 1.0, False, max_=0.1, min_=None)
    assert j.verdict == verdict and "CI half-width" in j.resolution
    if kld.get("ci_reliable") is False:
        assert "too few items" in j.detail and j.ci_method == "bootstrap"


def test_pass_rate_without_evidence_is_never_a_pass():
    zero = figure_from_json(paired_delta([0] * 8, [0] * 8, seed=0))
    j = judge_quality(zero, -1.0, False, max_=0.15, min_=None)  # no share in the policy: required, undecided
    assert j.verdict == NO_EVIDENCE and j.required and "none of the 8 items" in j.detail
    j = judge_quality(zero, -1.0, False, max_=0.15, min_=None, min_share=0.25)
    assert j.verdict == NO_EVIDENCE and not j.required and "25%" in j.detail
    assert overall([(PASS, True), (NO_EVIDENCE, True)]) == INCONCLUSIVE
    assert overall([(PASS, True), (NO_EVIDENCE, False)]) == PASS
    assert overall([(FAIL, True), (INCONCLUSIVE, True)]) == FAIL
    assert overall([]) == INCONCLUSIVE


def test_default_policy_rests_code_on_kld_and_nll_when_the_baseline_solves_nothing():
    summary = _summary(_kld(0.01, 0.02), [0] * 8, [0] * 8)
    summary["nll_canonical_solution"] = paired_delta([1.0, 1.1, 0.9], [1.0, 1.0, 0.9], seed=0)
    policy = load_policy("default")
    policy = policy.model_copy(update={"tasks": {"code": policy.tasks["code"]}})
    gates = {g.name: g for g in evaluate_gates(policy, EvalResults.from_json({"tasks": {"code": {"summary": summary}}}),
                                                     None, None)}
    assert gates["code.pass_at_1_drop"].verdict == NO_EVIDENCE and not gates["code.pass_at_1_drop"].passed
    assert gates["code.kld_mean"].verdict == PASS


def _fabricate(folder: Path, summary: dict) -> None:
    folder.mkdir()
    (folder / "steps.json").write_text(json.dumps({n: {"status": "ok", "seconds": 1.0}
                                                   for n in ("quantize", "eval", "bench", "diagnose")}))
    (folder / "eval.json").write_text(json.dumps({"tasks": {"code": {"items": 8, "summary": summary}}}))


def _signoff(folder: Path, policy: Path, capsys) -> tuple[int, str, str]:
    """`qtool signoff` as its console script runs it (qtoolkit.cli.main), in process to spare torch's import."""
    code = main(["signoff", "--model", "default", "--recipe", "fp8-dynamic", "--policy", str(policy), "--rejudge",
                 "--output", str(folder)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("kld, code, word", [
    (_kld(0.01, 0.02), 0, "PASS"), (_kld(0.3, 0.4), 1, "FAIL"), (_kld(0.05, 0.15), 3, "INCONCLUSIVE"),
])
def test_verdict_paths_through_the_cli(tmp_path, capsys, kld, code, word):
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    out = tmp_path / "run"
    kld = {**kld, "ci_method": "bootstrap-t (studentized, by item)", "ci_coverage": 0.939, "ci_reliable": True}
    _fabricate(out, _summary(kld, [0] * 8, [0] * 8))
    rc, stdout, stderr = _signoff(out, policy, capsys)
    assert rc == code, stderr[-2000:]
    assert f"verdict: {word}" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == word
    md = (out / "report.md").read_text()
    assert "no evidence (not required)" in md and "code quality on this model rests on code.kld_mean" in md
    assert "could detect" in md and "CI half-width" in md
    assert "(bootstrap-t (studentized, by item), simulated coverage 93.9%)" in md  # the method and its coverage
    assert {g["name"]: g["ci_coverage"] for g in report["gates"]}["code.kld_mean"] == 0.939
    assert "Model-written code ran under bubblewrap: pid namespace, mount namespace" in md


def test_crash_is_an_error_not_a_fail(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    out = tmp_path / "run"
    _fabricate(out, _summary(_kld(0.01, 0.02), [0] * 8, [0] * 8))
    (out / "steps.json").write_text("{not json")
    rc, _, stderr = _signoff(out, policy, capsys)
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "steps.json is not valid JSON" in lines[0], stderr
    out = tmp_path / "run2"
    _fabricate(out, _summary(_kld(0.01, 0.02), [0] * 8, [0] * 8))
    (out / "eval.json").write_text("[1, 2]")  # valid JSON of the wrong shape: named, not a traceback
    rc, _, stderr = _signoff(out, policy, capsys)
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "eval.json is not a qtool eval result" in lines[0], stderr
    rc, _, stderr = _signoff(tmp_path / "nothing", policy, capsys)
    assert rc == 2 and "holds no sign-off steps" in stderr


def test_inconclusive_gate_draws_more_items_up_to_the_budget():
    from qtoolkit.signoff.sequential import describe, draw_until_decisive, stages

    assert stages(8, None) == [8] and stages(8, 8) == [8] and stages(8, 40) == [8, 16, 32, 40]
    calls: list[tuple[int, bool]] = []
    drawn = {"n": 0}

    def run(items: int, overwrite: bool, tasks: list[str] | None, level: object) -> None:
        calls.append((items, overwrite, tasks))
        drawn["n"] = items

    def judge() -> tuple[list[Gate], list[Gate]]:  # the interval narrows with the items: decisive from 32 on
        return ([] if drawn["n"] >= 32 else [Gate("summarization", "rougeL_drop", False, "straddles")]), []

    looks = draw_until_decisive(run, judge, 8, 64, resume=False)
    # later looks resume (finished items are reused) and draw only for the task whose gate is undecided
    assert calls == [(8, True, None), (16, False, ["summarization"]), (32, False, ["summarization"])]
    info = describe(looks, 64).to_json()  # as sequential.json holds it
    assert [x["items"] for x in info["looks"]] == [8, 16, 32] and info["error_rate_bound"] == pytest.approx(0.05)
    assert info["design"]["planned_items"] == [8, 16, 32, 64]
    assert info["looks"][0]["undecided"] == ["summarization.rougeL_drop"]  # sequential.json names gates task.metric
    calls.clear()
    assert len(draw_until_decisive(run, lambda: ([], [Gate("code", "kld_mean", False, "beyond")]), 8, 64, resume=True)) == 1
    assert calls == [(8, False, None)]  # a failed gate decides at once
