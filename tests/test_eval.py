"""`qtool eval` end to end on tiny random models: bad input, results JSON, resume after a crash, endpoints."""

from __future__ import annotations

import json

import pytest
from qtoolkit.evals import runner
from qtoolkit.evals.backends.base import BackendError
from qtoolkit.evals.completions import read_completions
from qtoolkit.evals.runner import EvalConfig, evaluate

from qtoolkit.cli import main
from qtoolkit.errors import DataError, OutputExistsError


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, tiny_model_dir, tokenizer_dir):
    """Candidate = a second random tiny LLaMA with the same tokenizer, so KLD is clearly non-zero."""
    from conftest import build_tiny_llama

    other = build_tiny_llama(tmp_path_factory.mktemp("tiny-other"), tokenizer_dir, seed=1)
    return str(other), str(tiny_model_dir)


def _cli_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one line
    return err


def test_bad_input_is_one_line(capsys, tmp_path):
    out = str(tmp_path / "r.json")
    assert "unknown task 'nope'" in _cli_error(capsys, ["eval", "--model", "m", "--baseline", "b", "--task", "nope",
                                                         "--output", out])
    assert "--limit" in _cli_error(capsys, ["eval", "--model", "m", "--baseline", "b", "--limit", "0", "--output", out])
    assert "--limit" in _cli_error(capsys, ["eval", "--completions", "x.jsonl", "--limit", "-3", "--output", out])


def test_completions_file_errors_name_line_numbers(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"task_id": "HumanEval/0", "completion": "    return True\\n"}\n'
                    "not json\n"
                    '{"task_id": "HumanEval/99999", "completion": "x"}\n'
                    "\n"
                    '{"task_id": "HumanEval/1"}\n')
    with pytest.raises(DataError) as e:
        read_completions(path)
    msg = str(e.value)
    assert "line 2: not JSON" in msg and "line 3: unknown task_id" in msg and "line 5" in msg
    assert "line 1" not in msg and "\n" not in msg


def test_unanswering_endpoint_fails_clearly_after_bounded_retry(tiny_model_dir):
    from qtoolkit.evals.backends.endpoint import OpenAIBackend

    with pytest.raises(BackendError, match="did not answer after 2 tries"):
        OpenAIBackend("http://127.0.0.1:9", model_spec=str(tiny_model_dir), retries=2, timeout_s=2)


def test_perplexity_results_and_resume(tiny_pair, tmp_path, monkeypatch):
    cand, base = tiny_pair
    out = tmp_path / "eval.json"
    cfg = EvalConfig(model=cand, baseline=base, tasks="perplexity", limit=2, output=str(out), seed=3)
    res = evaluate(cfg)
    entry = res["tasks"]["perplexity"]
    assert entry["items"] == 4 and len(entry["records"]) == 4
    for text_set in ("code", "summarization"):
        s = entry["summary"][text_set]
        assert s["items"] == 2 and s["kld"]["mean_pm"][0] > 0.01
        lo, hi = s["kld"]["ci95"]
        assert lo <= s["kld"]["mean_pm"][0] <= hi
        assert s["kld"]["median"] <= s["kld"]["p99"] <= s["kld"]["max"]
        assert 0 <= s["same_top1"]["mean_pm"][0] <= 1
    saved = json.loads(out.read_text())
    assert saved["inputs"]["models"]["candidate"]["sha256"] and saved["inputs"]["seed"] == 3
    assert "torch" in saved["versions"] and saved["models"]["baseline"]["backend"] == "engine"

    # A rerun finds every item finished: no model is loaded and the summary is identical.
    def no_models(*a, **k):
        raise AssertionError("a finished evaluation must not load models")

    monkeypatch.setattr(runner, "make_backend", no_models)
    again = evaluate(cfg)
    assert again["tasks"]["perplexity"]["summary"] == entry["summary"]

    # The same output with other settings is refused instead of mixed.
    with pytest.raises(OutputExistsError):
        evaluate(EvalConfig(model=base, baseline=cand, tasks="perplexity", limit=2, output=str(out)))


def test_crash_mid_run_keeps_finished_items(tiny_pair, tmp_path, monkeypatch):
    from qtoolkit.evals.summarization import SummarizationTask

    cand, base = tiny_pair
    out = tmp_path / "eval.json"
    cfg = EvalConfig(model=cand, baseline=base, tasks="summarization", limit=2, output=str(out),
                     task_options={"max_tokens": 6})
    monkeypatch.setattr(SummarizationTask, "batch_size", 1)
    real = SummarizationTask.run_batch
    calls = []

    def crash_on_second(self, items, c, b):
        calls.append(items[0]["id"])
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(self, items, c, b)

    monkeypatch.setattr(SummarizationTask, "run_batch", crash_on_second)
    with pytest.raises(RuntimeError):
        evaluate(cfg)
    assert len(json.loads(out.read_text())["tasks"]["summarization"]["records"]) == 1
    monkeypatch.setattr(SummarizationTask, "run_batch", real)
    res = evaluate(cfg)
    entry = res["tasks"]["summarization"]
    assert entry["items"] == 2
    s = entry["summary"]
    for k in ("rouge1", "rouge2", "rougeL", "nll_reference"):
        assert s[k]["items"] == 2 and s[k]["ci95"] is not None
    assert s["text_stats"]["kld"]["mean_pm"][0] > 0


def test_code_task_through_cli(tiny_pair, tmp_path, capsys):
    cand, base = tiny_pair
    out = tmp_path / "code.json"
    rc = main(["eval", "--model", cand, "--baseline", base, "--task", "code", "--limit", "2", "--max-tokens", "8",
               "--output", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())["tasks"]["code"]["summary"]
    assert s["pass@1"]["items"] == 2 and s["pass@1"]["candidate"] == 0.0  # random weights cannot pass
    assert s["nll_canonical_solution"]["delta"] is not None and s["text_stats"]["kld"]["mean_pm"][0] > 0
    assert 0 <= s["greedy_agreement"]["rate"] <= 1
    assert "pass@1" in capsys.readouterr().out


def test_endpoint_candidate_scores_nll_but_not_kld(tiny_model_dir, tmp_path):
    """Through qtool serve (echo + logprobs, no full distributions), generation metrics and NLL are measured and
    KLD is listed as not computed, never guessed."""
    from test_server import make_app, running

    with running(make_app(tiny_model_dir)) as url:
        res = evaluate(EvalConfig(model=str(tiny_model_dir), baseline=str(tiny_model_dir), endpoint=url,
                                  tasks="code", limit=1, output=str(tmp_path / "e.json"),
                                  task_options={"max_tokens": 8}))
    s = res["tasks"]["code"]["summary"]
    assert s["pass@1"]["items"] == 1
    assert s["nll_canonical_solution"]["delta"] is not None  # same weights on both sides: a delta near 0
    assert abs(s["nll_canonical_solution"]["delta"]) < 1e-3
    stats = s["text_stats"]
    assert "kld" not in stats and any(x.startswith("kld") for x in stats["not_computed"])
    assert res["models"]["candidate"]["backend"] == "openai"


def test_engine_and_hf_backends_agree_on_scores(tiny_model_dir):
    """The hf backend stays as a cross-check of the engine: same teacher-forced distributions."""
    import torch
    from qtoolkit.evals.backends.factory import make_backend

    engine, hf = make_backend(str(tiny_model_dir), kind="engine"), make_backend(str(tiny_model_dir), kind="hf")
    ids = engine.tokenizer("def add(a, b):\n    return a + b\n").input_ids
    (a,), (b,) = engine.score([ids]), hf.score([ids])
    assert a.logprobs.shape == b.logprobs.shape == (len(ids) - 1, len(engine.tokenizer))
    assert torch.allclose(a.logprobs, b.logprobs, atol=2e-3)
    assert torch.equal(a.top1, b.top1)
