"""The sign-off's typed hand-offs: Gate (task, metric), EvalResults read from a runner's eval.json, NotComputed,
and the one decide() behind the local and the endpoint sign-off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qtoolkit.evals.results import EvalResults
from qtoolkit.evals.runner import EvalConfig, evaluate, summary_lines
from qtoolkit.evals.summary import NotComputed, TaskSummary

from qtoolkit.errors import DataError
from qtoolkit.provenance import provenance
from qtoolkit.signoff import verdicts
from qtoolkit.signoff.judge import Gate
from qtoolkit.signoff.policy import load_policy
from qtoolkit.signoff.report import write_reports
from qtoolkit.signoff.steps import StepOutcome
from qtoolkit.signoff.verdict import DeploymentSection, Evidence, NotMeasurable, decide


def test_gate_round_trips_through_report_json_and_keeps_a_dotted_task():
    g = Gate("custom:my.data", "rougeL_drop", False, "0.3 > max 0.1", 0.2, 0.3, verdicts.FAIL, True, "r",
             "bootstrap", 0.94)
    node = g.to_json()
    assert node["name"] == "custom:my.data.rougeL_drop" and list(node)[0] == "name"
    assert "task" not in node and "metric" not in node
    back = Gate.from_json(json.loads(json.dumps(node)))
    assert back == g and (back.task, back.metric) == ("custom:my.data", "rougeL_drop")
    # a report that has `passed` only: the verdict follows it; keys the type does not know are left out
    old = Gate.from_json({"name": "code.kld_mean", "passed": True, "detail": "ok", "point": 0.01, "judged": 0.02,
                          "plotted": True})
    assert (old.task, old.metric, old.verdict) == ("code", "kld_mean", verdicts.PASS)


@pytest.mark.parametrize("line, figures, reason", [
    ("nll_answer, text_stats: the endpoint gives no prompt logprobs", "nll_answer, text_stats",
     "the endpoint gives no prompt logprobs"),
    ("why: a: b", "why", "a: b"),
    ("kld (needs full next-token distributions from both models)",
     "kld (needs full next-token distributions from both models)", ""),
])
def test_not_computed_reads_figures_and_reason_and_writes_the_line_back(line, figures, reason):
    nc = NotComputed.from_json(line)
    assert (nc.figures, nc.reason) == (figures, reason)
    assert nc.to_json() == line == str(nc)
    summary = TaskSummary.from_json({"not_computed": [line], "text_stats": {"tokens": 3, "not_computed": [line]}})
    assert summary.not_computed == [nc] and summary.text_stats.not_computed == [nc]
    assert summary.to_json()["not_computed"] == [line]  # the file keeps its lines


def test_eval_results_load_a_runner_written_eval_json(tiny_model_dir, tmp_path):
    data = tmp_path / "w.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in [
        {"id": "a", "prompt": "The sky is", "reference": "blue"},
        {"id": "b", "messages": [{"role": "user", "content": "Say hi."}], "reference": "Hi."}]) + "\n")
    out = tmp_path / "eval.json"
    written = evaluate(EvalConfig(model=str(tiny_model_dir), baseline=str(tiny_model_dir), tasks="custom:w",
                                  output=str(out), task_options={"custom_data": {"custom:w": str(data)},
                                                                 "max_tokens": 3}))
    raw = json.loads(out.read_text())
    evals = EvalResults.load(out)
    assert list(evals.tasks) == ["custom:w"] and evals.models == raw["models"]
    result = evals.tasks["custom:w"]
    assert result.items == 2 and set(result.records) == {"a", "b"}
    assert result.summary.to_json() == raw["tasks"]["custom:w"]["summary"]  # typed, and the same JSON back
    assert evals.summary("custom:w").figure("nll_answer").items == 2 and evals.summary("code") is None
    assert len(result.token_klds()[""]) == raw["tasks"]["custom:w"]["summary"]["text_stats"]["tokens"]
    assert summary_lines(written)[0] == "custom:w: 2 items"


def test_eval_results_load_names_a_missing_corrupt_or_foreign_file(tmp_path):
    path = tmp_path / "eval.json"
    with pytest.raises(DataError, match="eval.json not found"):
        EvalResults.load(path)
    for text, words in (("{not json", "is not a qtool eval result"), ("[1, 2]", "needs `tasks` by name"),
                        ('{"tasks": {"code": 3}}', "needs `tasks` by name")):
        path.write_text(text)
        with pytest.raises(DataError, match=words) as e:
            EvalResults.load(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    path.write_text('{"tasks": {"code": {"key": {}, "records": {}}}}')  # a task not finished: no summary yet
    assert EvalResults.load(path).summary("code") is None


def _report(steps: dict, gates: list[Gate], **kw):
    """`steps` as steps.json holds them."""
    outcomes = {n: StepOutcome.from_json(s) for n, s in steps.items()}
    return decide(Evidence(outcomes, gates), provenance=provenance(model="m"), config={"model": "m", "recipe": "r"},
                  policy=load_policy("default"), **kw)


def test_one_decide_for_both_sign_offs():
    ok = {"status": "ok"}
    passed = Gate("code", "kld_mean", True, "0.01 within max 0.1", verdict=verdicts.PASS)
    undecided = Gate("code", "nll_delta", False, "[0, 0.2] straddles max 0.1", verdict=verdicts.INCONCLUSIVE)
    failed = Gate("memory", "max_checkpoint_bytes", False, "2e9 > max 1e9", verdict=verdicts.FAIL)
    assert _report({"eval": ok}, [passed]).verdict == verdicts.PASS
    r = _report({"eval": ok}, [passed, undecided])
    assert r.verdict == verdicts.INCONCLUSIVE
    assert r.reasons == ["gate code.nll_delta inconclusive: [0, 0.2] straddles max 0.1"]
    r = _report({"eval": {"status": "error", "error": "boom"}, "bench": ok}, [failed])
    assert r.verdict == verdicts.ERROR and r.reasons[0] == "step eval failed: boom"
    assert _report({"eval": ok}, []).verdict == verdicts.INCONCLUSIVE  # nothing judged: never a PASS
    assert _report({"eval": ok}, [], without_gates=verdicts.FAIL).verdict == verdicts.FAIL


def test_signoff_report_json_keeps_report_json_layout():
    steps = {"eval": {"status": "ok", "key": "abc", "seconds": 1.0}}
    local = _report(steps, [Gate("code", "kld_mean", True, "ok", verdict=verdicts.PASS)]).to_json()
    assert list(local) == ["schema_version", "created", "inputs", "versions", "machine", "verdict", "reasons", "reading", "config", "policy", "gates", "steps",
                           "quantize", "eval", "eval_models", "ablation", "diagnose"]
    assert local["steps"] == {"eval": {"status": "ok", "seconds": 1.0}}  # the reuse key stays in steps.json
    assert local["gates"][0]["name"] == "code.kld_mean"
    dep = DeploymentSection({"candidate": {"url": "http://c"}}, None, [NotMeasurable("kld", "KLD", "top-k only")])
    deployed = _report(steps, [], deployment=dep).to_json()
    assert list(deployed)[12:15] == ["deployments", "deployment_bench", "not_measurable"]
    assert deployed["not_measurable"] == [{"key": "kld", "what": "KLD", "reason": "top-k only"}]


def test_report_writer_takes_the_signoff_report(tmp_path: Path):
    gate = Gate("code", "kld_mean", False, "0.3 > max 0.1", 0.2, 0.3, verdicts.FAIL)
    written = write_reports(tmp_path, _report({"eval": {"status": "ok"}}, [gate]))
    assert json.loads((tmp_path / "report.json").read_text()) == written
    assert written["verdict"] == verdicts.FAIL and written["plots"] == ["quality"]
    assert "| code.kld_mean | FAIL |" in (tmp_path / "report.md").read_text()
