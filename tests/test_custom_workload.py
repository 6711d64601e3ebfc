"""Your own workload (--data / --workload FILE.jsonl): the file format, the custom:NAME eval task and its metric
rules, resume and seeded --limit sampling, the sandboxed `tests` field, bench traffic and the sign-off gates."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from qtoolkit.evals import runner
from qtoolkit.evals.backends.base import GeneratedText, ScoringUnsupported
from qtoolkit.evals.custom import CustomTask
from qtoolkit.evals.results import EvalResults
from qtoolkit.evals.runner import EvalConfig, evaluate
from qtoolkit.evals.workload_file import iter_lines, sample_items

from qtoolkit.cli import main
from qtoolkit.signoff.policy import load_policy
from qtoolkit.signoff.report import custom_regression_lines
from qtoolkit.signoff.workload import gate_policy

EXAMPLE = Path(__file__).resolve().parents[1] / "evals" / "tasks" / "example-workload.jsonl"
STOP = ["\ndef ", "\nclass "]


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, tiny_model_dir, tokenizer_dir):
    from conftest import build_tiny_llama

    other = build_tiny_llama(tmp_path_factory.mktemp("tiny-other"), tokenizer_dir, seed=1)
    return str(other), str(tiny_model_dir)


def test_good_lines_and_the_shipped_example_parse(tmp_path):
    f = write_jsonl(tmp_path / "w.jsonl", [{"id": 7, "prompt": "x ="}, "",
                                           {"messages": [{"role": "system", "content": "s"},
                                                         {"role": "user", "content": "hi"}], "max_tokens": 3}])
    lines = list(iter_lines(f))
    assert [(ln.number, ln.id, ln.item.kind) for ln in lines] == [(1, "7", "completion"), (3, "line-3", "chat")]
    example = list(iter_lines(EXAMPLE))
    kinds = {ln.item.kind for ln in example}
    assert kinds == {"chat", "completion"} and any(ln.item.tests for ln in example)
    assert any(ln.item.reference for ln in example)


@pytest.mark.parametrize("line, field, words", [
    ("{not json", "line", "not JSON"),
    ("[1, 2]", "line", "expected a JSON object"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "line", "exactly one of"),
    ('{"id": "x"}', "line", "exactly one of"),
    ('{"prompt": "a", "answer": "b"}', "answer", "Extra inputs"),
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens", "greater than 0"),
    ('{"prompt": ""}', "prompt", "at least 1"),
    ('{"messages": [{"role": "robot", "content": "b"}]}', "messages.0.role", "Input should be"),
    ('{"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}', "line",
     "end `messages` with a user turn"),
    ('{"prompt": "a", "tests": 5}', "tests", "valid string"),
    ('{"id": "first", "prompt": "b"}', "id", "repeats line 1"),
])
def test_bad_line_is_one_cli_error_naming_file_line_and_field(tmp_path, capsys, tiny_model_dir, line, field, words):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"id": "first", "prompt": "ok"}, line])
    out = tmp_path / "e.json"
    rc = main(["eval", "--model", str(tiny_model_dir), "--baseline", str(tiny_model_dir), "--task", "custom",
               "--data", str(f), "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err
    assert f"{f}:2: {field}: " in err and words in err, err
    assert not out.exists()  # nothing half-written


def test_custom_without_data_and_data_without_custom_are_refused(capsys, tiny_model_dir):
    base = ["eval", "--model", str(tiny_model_dir), "--baseline", str(tiny_model_dir)]
    assert main([*base, "--task", "custom"]) == 2 and "--data FILE.jsonl" in capsys.readouterr().err
    assert main([*base, "--task", "code", "--data", str(EXAMPLE)]) == 2
    assert "add `custom` to --task" in capsys.readouterr().err


def test_limit_samples_a_10k_file_reproducibly(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"Request number {i}:"} if i % 2 else
            {"id": f"r{i}", "messages": [{"role": "user", "content": f"chat {i}"}]} for i in range(10_000)]
    f = write_jsonl(tmp_path / "big.jsonl", rows)
    ids = [ln.id for ln in sample_items(f, 50, seed=0)]
    assert len(ids) == 50 and ids == [ln.id for ln in sample_items(f, 50, seed=0)]
    assert ids != [ln.id for ln in sample_items(f, 50, seed=1)]
    assert set(ln.id for ln in sample_items(f, 20, seed=0)) <= set(ids)  # a raised --limit keeps what it had
    assert ids == sorted(ids, key=lambda x: int(x[1:]))  # back in file order
    random.Random(3).shuffle(rows)
    shuffled = write_jsonl(tmp_path / "shuffled.jsonl", rows)
    assert set(ln.id for ln in sample_items(shuffled, 50, seed=0)) == set(ids)  # ids decide, not the order
    assert [it["id"] for it in CustomTask(f).items(50)] == ids


def test_metric_presence_rules_chat_and_completion(tiny_pair, tmp_path, capsys):
    cand, base = tiny_pair
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "plain", "prompt": "The sky is"},
        {"id": "ref", "messages": [{"role": "user", "content": "Say hello."}], "reference": "Hello there."},
        {"id": "code", "prompt": "def one():\n", "tests": "assert one() == 1", "stop": STOP},
    ])
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "Once upon"},
                                                 {"messages": [{"role": "user", "content": "Hi"}]}])
    out = tmp_path / "e.json"
    assert main(["eval", "--model", cand, "--baseline", base, "--task", "custom", "--data", str(mixed), "--data",
                 str(bare), "--max-tokens", "4", "--output", str(out)]) == 0
    tasks = json.loads(out.read_text())["tasks"]
    assert set(tasks) == {"custom:mixed", "custom:bare"}
    m, b = tasks["custom:mixed"]["summary"], tasks["custom:bare"]["summary"]
    assert m["rougeL"]["items"] == 1 and m["pass@1"]["items"] == 1 and m["pass@1"]["candidate"] == 0.0
    assert "rougeL" not in b and "pass@1" not in b
    for s, n in ((m, 3), (b, 2)):
        assert s["text_stats"]["kld"]["mean_pm"][0] > 0 and s["text_stats"]["tokens"] > 0
        assert s["nll_answer"]["items"] == n and s["answer_tokens"]["items"] == n
        assert 0 <= s["greedy_agreement"]["rate"] <= 1 and not s["not_computed"]
    kinds = {r["id"]: r["kind"] for r in tasks["custom:mixed"]["records"].values()}
    assert kinds == {"plain": "completion", "ref": "chat", "code": "completion"}
    assert all(r["baseline"]["tokens"] <= 4 for r in tasks["custom:bare"]["records"].values())
    assert "custom:mixed: 3 items" in capsys.readouterr().out


def test_hf_backend_scores_the_same_items(tiny_pair, tmp_path):
    """--backend hf (plain transformers) gives the custom task's figures too: every backend, not only the engine."""
    cand, base = tiny_pair
    f = write_jsonl(tmp_path / "w.jsonl", [
        {"id": "p", "prompt": "The sky is"},
        {"id": "c", "messages": [{"role": "user", "content": "Say hello."}], "reference": "Hello there."},
    ])
    out = tmp_path / "e.json"
    assert main(["eval", "--model", cand, "--baseline", base, "--backend", "hf", "--task", "custom", "--data",
                 str(f), "--max-tokens", "3", "--output", str(out)]) == 0
    task = json.loads(out.read_text())["tasks"]["custom:w"]
    s = task["summary"]
    assert s["items"] == 2 and s["text_stats"]["kld"]["ci95"] and s["rougeL"]["items"] == 1
    assert not s["not_computed"] and all(r["baseline"]["tokens"] <= 3 for r in task["records"].values())


def test_10k_file_with_limit_resumes_without_loading_models(tiny_pair, tmp_path, monkeypatch):
    cand, base = tiny_pair
    f = write_jsonl(tmp_path / "big.jsonl", [{"id": i, "prompt": f"Item {i}:"} for i in range(10_000)])
    cfg = EvalConfig(model=cand, baseline=base, tasks="custom:big", limit=3, output=str(tmp_path / "e.json"),
                     task_options={"custom_data": {"custom:big": str(f)}, "max_tokens": 2})
    first = evaluate(cfg)["tasks"]["custom:big"]
    assert first["items"] == 3 and len(first["records"]) == 3

    def no_models(*a, **k):
        raise AssertionError("a finished evaluation must not load models again")

    monkeypatch.setattr(runner, "make_backend", no_models)
    again = evaluate(cfg)["tasks"]["custom:big"]
    assert again["summary"] == first["summary"] and again["records"] == first["records"]


class FixedAnswers:
    """A backend that answers from a table and cannot score (like an endpoint without echo)."""

    name, full_distributions = "fixed", False

    def __init__(self, tokenizer, answers: dict[str, str]):
        self.tokenizer, self.answers = tokenizer, answers

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = next(a for key, a in self.answers.items() if key in p)
            out.append(GeneratedText(text, self.tokenizer(text, add_special_tokens=False).input_ids, "stop"))
        return out

    def score(self, token_ids):
        raise ScoringUnsupported("fixed answers cannot score")


def test_tests_field_runs_in_the_sandbox_pass_and_fail(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    f = write_jsonl(tmp_path / "t.jsonl", [
        {"id": "add", "prompt": "def add(a, b):\n", "tests": "assert add(2, 3) == 5", "stop": STOP},
        {"id": "rev", "messages": [{"role": "user", "content": "Write reverse(s)."}],
         "tests": "assert reverse('ab') == 'ba'\nassert 'reverse' in completion"},
    ])
    good = {"def add": "    return a + b\n", "reverse(s)": "Sure:\n```python\ndef reverse(s):\n    return s[::-1]\n```"}
    bad = {"def add": "    return a - b\n", "reverse(s)": "```python\nimport socket\nsocket.socket()\n```"}
    task = CustomTask(f)
    records = task.run_batch(task.items(10), FixedAnswers(tok, bad), FixedAnswers(tok, good))
    by_id = {r["id"]: r for r in records}
    assert all(r["baseline"]["passed"] for r in records) and not any(r["candidate"]["passed"] for r in records)
    assert "AssertionError" in by_id["add"]["candidate"]["error"]
    assert "sandbox" in by_id["rev"]["candidate"]["error"]  # the network is refused inside the sandbox
    s = task.summarize(records, seed=0)
    assert s["pass@1"]["candidate"] == 0.0 and s["pass@1"]["baseline"] == 1.0
    assert s["not_computed"] and "kld" not in s["text_stats"]
    assert {x["id"] for x in s["worst_items"]} == {"add", "rev"} and s["worst_items"][0]["pass_lost"]
    md = "\n".join(custom_regression_lines(EvalResults.from_json({"tasks": {"custom:t": {"summary": s}}})))
    assert "## Worst regressions: custom:t" in md and "fail/pass" in md and "Write reverse(s)." in md


def test_endpoint_candidate_scores_nll_and_lists_kld_as_not_computed(tiny_model_dir, tmp_path):
    """qtool serve gives echo + logprobs (NLL of the answers) but no full distributions (KLD)."""
    from test_server import make_app, running

    f = write_jsonl(tmp_path / "w.jsonl", [{"messages": [{"role": "user", "content": "Hi"}], "reference": "Hello"}])
    with running(make_app(tiny_model_dir)) as url:
        res = evaluate(EvalConfig(model=str(tiny_model_dir), baseline=str(tiny_model_dir), endpoint=url,
                                  tasks="custom:w", output=str(tmp_path / "e.json"),
                                  task_options={"custom_data": {"custom:w": str(f)}, "max_tokens": 3}))
    s = res["tasks"]["custom:w"]["summary"]
    assert s["rougeL"]["items"] == 1 and s["answer_tokens"]["items"] == 1
    assert not s["not_computed"] and s["nll_answer"]["delta"] is not None
    assert "kld" not in s["text_stats"] and any(x.startswith("kld") for x in s["text_stats"]["not_computed"])


def test_bench_serve_replays_the_file_with_measured_lengths(tiny_model_dir, tmp_path):
    from test_server import make_app, running

    from qtoolkit.bench.serve import bench_serve
    from qtoolkit.bench.workload_files import parse_workload

    f = write_jsonl(tmp_path / "w.jsonl", [
        {"id": "fixed", "prompt": "def f():\n", "max_tokens": 3},
        {"id": "chat", "messages": [{"role": "user", "content": "Name a fruit."}]},
        {"id": "text", "prompt": "Once upon a time"},
    ])
    with running(make_app(tiny_model_dir)) as url:
        report = bench_serve(endpoint=url, concurrency=[1, 2], num_requests=3, workload=parse_workload(str(f)),
                             max_output_tokens=5)
    lengths = report["config"]["workload"]["answer_lengths"]
    assert lengths == {"measured_items": 2, "sources": {"endpoint": 2}}
    for tier in report["tiers"]:
        r = tier["results"]["endpoint"]
        assert r["completed"] == 3 and r["failed"] == 0
        assert 3 + 2 <= r["output_tokens"] <= 3 + 2 * 5  # the line's own max_tokens + two measured answers


def test_bench_serve_refuses_an_unknown_workload(capsys, tmp_path):
    assert main(["bench", "serve", "--workload", "poems", "--output", str(tmp_path / "b.json")]) == 2
    assert "workload file FILE.jsonl" in capsys.readouterr().err


def test_signoff_gates_follow_the_file():
    policy = load_policy("default")
    assert "custom" not in gate_policy(policy, None, []).tasks  # no --data: no custom gates
    summary = {"items_with_reference": 0, "items_with_tests": 2}
    gp = gate_policy(policy, EvalResults.from_json({"tasks": {"custom:example-workload": {"summary": summary}}}),
                     [str(EXAMPLE)])
    assert set(gp.tasks["custom:example-workload"]) == {"kld_mean", "nll_delta", "pass_at_1_drop"}
    assert set(gate_policy(policy, None, [str(EXAMPLE)]).tasks["custom:example-workload"]) == set(
        policy.tasks["custom"])  # no results yet: every bound stays, and fails as "no results"


@pytest.mark.slow
def test_signoff_with_data_on_the_default_model(tmp_path):
    """The whole sign-off on the real model with the shipped example file judged by the custom gates."""
    policy = tmp_path / "p.yaml"
    custom = load_policy("default").tasks["custom"]
    policy.write_text("version: 1\nname: custom-only\ntasks:\n  custom:\n" + "".join(
        f"    {m}: {{max: {b.max}}}\n" for m, b in custom.items()) + "throughput:\n  min_speedup: 0.01\n")
    out = tmp_path / "run"
    rc = main(["signoff", "--model", "default", "--recipe", "int4-rtn", "--policy", str(policy), "--data",
               str(EXAMPLE), "--limit", "4", "--concurrency", "1,2", "--num-requests", "2", "--rounds", "2",
               "--speculative", "none", "--max-items", "4", "--output", str(out)])
    report = json.loads((out / "report.json").read_text())
    # one look of 4 items: the custom gates may be undecided (INCONCLUSIVE, exit 3) but every step runs
    assert rc in (0, 1, 3) and all(s["status"] == "ok" for s in report["steps"].values()), report["steps"]
    names = {g["name"] for g in report["gates"]}
    assert {"custom:example-workload.kld_mean", "custom:example-workload.rougeL_drop",
            "custom:example-workload.pass_at_1_drop"} <= names
    assert report["eval"]["custom:example-workload"]["items"] == 4
    assert "## Worst regressions: custom:example-workload" in (out / "report.md").read_text()
    bench = json.loads((out / "bench.json").read_text())
    assert bench["config"]["workload"]["files"][0]["path"] == str(EXAMPLE)


def test_chat_answers_give_their_first_python_fence_to_the_tests():
    from qtoolkit.evals.custom import answer_code, checking_program
    from qtoolkit.evals.workload_file import WorkloadItem

    chat = WorkloadItem(messages=[{"role": "user", "content": "x"}], tests="assert f() == 1")
    assert answer_code(chat, "Sure:\n```python\nx = 1\n```\nthen\n```python\ny = 2\n```") == "x = 1\n"
    assert answer_code(chat, "```py\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off at max_tokens
    assert answer_code(chat, "def f(): return 1") == "def f(): return 1"
    completion = WorkloadItem(prompt="def f():\n", tests="assert f() == 1")
    # parts run in one namespace: the answer cannot swallow the tests (an unclosed string is its own part's error)
    assert checking_program(completion, "    return 1\n") == ["completion = '    return 1\\n'\n",
                                                          "def f():\n    return 1\n\n", "assert f() == 1\n"]


def test_signoff_bench_replays_the_baseline_answer_lengths_of_the_eval_step(tmp_path):
    from qtoolkit.signoff.workload import bench_workload

    f = write_jsonl(tmp_path / "w.jsonl", [{"id": "a", "prompt": "A"}, {"id": "b", "prompt": "B", "max_tokens": 9},
                                           {"id": "c", "messages": [{"role": "user", "content": "C"}]}])
    records = {i: {"id": i, "baseline": {"tokens": t}} for i, t in (("a", 5), ("c", 0))}
    (tmp_path / "eval.json").write_text(json.dumps({"tasks": {"custom:w": {"records": records}}}))
    workload = bench_workload([str(f)], tmp_path / "eval.json")
    reqs = workload.requests(6, seed=0, max_output_tokens=32)  # no server attached: every length is known
    assert {r.item: r.max_tokens for r in reqs} == {"w/a": 5, "w/b": 9, "w/c": 1}
    assert {r.kind for r in reqs} == {"completion", "chat"} and all(r.messages for r in reqs if r.kind == "chat")
    assert workload.describe()["answer_lengths"]["sources"] == {"baseline greedy answers of the eval step": 2}
    assert bench_workload([], tmp_path / "eval.json") == "mixed"
