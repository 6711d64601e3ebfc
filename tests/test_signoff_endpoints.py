"""`qtool signoff --candidate-endpoint --baseline-endpoint` against two real `qtool serve` processes on loopback:
a tiny random LLaMA (baseline) and its INT4 quantization (candidate), each behind its own API key.

The report's figures must equal standalone `qtool eval` and `qtool bench serve` against the same endpoints, the
keys (given through the environment) must appear in no output file, what an endpoint cannot give must be listed
as not measurable, and an unreachable endpoint or a wrong model id must be one clear error (exit 2)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qtoolkit.cli import main
from qtoolkit.endpoints.deployment import Deployment, EndpointError, backoff_s, probe
from qtoolkit.engine.config import EngineConfig
from qtoolkit.server.process import free_port, server_process

KEYS = {"candidate": "cand-s3cret-7f3a", "baseline": "base-s3cret-91c2"}
LOAD = ["--concurrency", "1,2", "--num-requests", "2"]
BENCH_TOKENS = ["--mean-output-tokens", "48", "--max-output-tokens", "96"]  # what signoff's bench sends


@contextlib.contextmanager
def env(**values: str | None):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


ROLE_ENV = {"QTOOLKIT_CANDIDATE_API_KEY": KEYS["candidate"], "QTOOLKIT_BASELINE_API_KEY": KEYS["baseline"],
            "QTOOLKIT_API_KEY": None, "OPENAI_API_KEY": None}


@pytest.fixture(scope="module")
def int4_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from qtoolkit.quantize.run import quantize

    out = tmp_path_factory.mktemp("tiny-int4") / "ckpt"
    quantize(tiny_model_dir, "int4-rtn", out)
    return out


@pytest.fixture(scope="module")
def endpoints(tiny_model_dir, int4_dir):
    with server_process(str(tiny_model_dir), EngineConfig(batching="static"), extra_args=["--api-key", KEYS["baseline"]]) as base, \
            server_process(str(int4_dir), extra_args=["--api-key", KEYS["candidate"]]) as cand:
        yield {"candidate": f"{cand}/v1", "baseline": base}


@pytest.fixture(scope="module")
def run(endpoints, int4_dir, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("signoff-endpoints") / "run"
    with env(**ROLE_ENV):
        code = main(["signoff", "--candidate-endpoint", endpoints["candidate"], "--baseline-endpoint",
                     endpoints["baseline"], "--model", str(int4_dir), "--baseline", str(tiny_model_dir),
                     "--limit", "2", "--max-items", "2", *LOAD, "--rounds", "2", "--max-rounds", "4",
                     "--output", str(out)])
    return code, out, json.loads((out / "report.json").read_text())


def test_signoff_decides_names_the_endpoints_and_lists_what_it_cannot_measure(run, endpoints):
    code, out, report = run
    # the default policy's KLD gates cannot be measured through endpoints: never PASS, at best INCONCLUSIVE
    assert report["verdict"] in ("FAIL", "INCONCLUSIVE") and code == {"FAIL": 1, "INCONCLUSIVE": 3}[report["verdict"]]
    assert all(s["status"] == "ok" for s in report["steps"].values())
    deps = report["deployments"]
    assert deps["candidate"]["model_ids"] == [deps["candidate"]["model_id"]] == ["ckpt"]
    assert deps["baseline"]["url"] == endpoints["baseline"] and deps["candidate"]["server"] == "uvicorn"
    assert deps["candidate"]["api_key_env"] == "QTOOLKIT_CANDIDATE_API_KEY"
    for tier in report["deployment_bench"]["tiers"]:
        assert {r: e["endpoint"] for r, e in tier["endpoints"].items()} == {
            "candidate": endpoints["candidate"].removesuffix("/v1"), "baseline": endpoints["baseline"]}
    gates = {g["name"]: g for g in report["gates"]}
    for name in ("code.kld_mean", "summarization.kld_mean"):  # an endpoint gives no full distributions
        assert gates[name]["state"] == "not measurable" and not gates[name]["passed"]
        assert gates[name]["verdict"] == "INCONCLUSIVE"
        assert gates[name]["point"] is None
    measured = ["code.pass_at_1_drop", "summarization.rougeL_drop",
                "memory.max_linear_ratio_vs_bf16", "code.nll_delta", "summarization.nll_delta"]  # NLL: echo + logprobs
    assert all(gates[n]["state"] is None and gates[n]["point"] is not None for n in measured)
    # the default policy's speed gates (TPOT, TTFT ratios of signoff/speed.py) read the two endpoints' paired
    # rounds at every tier (2, then 4 while undecided), and its capacity gate their paired searches at its SLO
    bench = json.loads((out / "bench.json").read_text())
    assert bench["speed_rounds"]["pair"] == ["baseline", "candidate"] and bench["speed_rounds"]["rounds"] in (2, 4)
    rounds = report["deployment_bench"]["tiers"][-1]["total_speedup_rounds"]
    assert rounds["rounds"] == bench["speed_rounds"]["rounds"] and rounds["ci95"] is not None
    for tier in bench["tiers"]:
        assert all(len(tier["rounds_tpot"][role]) == bench["speed_rounds"]["rounds"] for role in ("baseline", "candidate"))
    for c in (1, 2):
        for kind in ("decode_tpot_ratio", "prefill_ttft_ratio"):
            g = gates[f"throughput.{kind}@c{c}"]
            assert g["point"] is not None and g["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE"), g
    capacity = gates["throughput.capacity_ratio"]
    searched = bench["capacity"]["estimates_rps"]
    assert set(searched) == {"baseline", "candidate"} and not capacity["required"]
    if None in searched["baseline"] + searched["candidate"]:  # a round found no capacity: the searches stop there
        assert capacity["verdict"] == "NO EVIDENCE" and len(searched["baseline"]) >= 1
    else:
        assert len(searched["baseline"]) >= 3
        assert capacity["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE") and capacity["point"] is not None
    assert report["ablation"] is None and report["diagnose"] is None  # never filled in from the local engine
    assert {x["key"] for x in report["not_measurable"]} >= {"ablation", "kld", "speculative_engine", "diagnose"}
    md = (out / "report.md").read_text()
    for reason in report["reasons"]:  # each names its gate's own verdict: an INCONCLUSIVE gate has not "failed"
        name = reason.split()[1]
        assert reason.startswith(f"gate {name} {gates[name]['verdict'].lower()}: "), reason
    assert report["reasons"] and ("## Why it is inconclusive" in md) == (report["verdict"] == "INCONCLUSIVE")
    assert "## Ablation: not measurable on this deployment" in md
    assert f"candidate: {endpoints['candidate'].removesuffix('/v1')}" in md and "(not measurable) |" in md
    assert "not measurable on this deployment" in (out / "report.html").read_text()


def test_quality_equals_standalone_eval(run, endpoints, int4_dir, tiny_model_dir, tmp_path):
    _, out, report = run
    with env(**ROLE_ENV):
        assert main(["eval", "--model", str(int4_dir), "--baseline", str(tiny_model_dir), "--endpoint",
                     endpoints["candidate"], "--baseline-endpoint", endpoints["baseline"],
                     "--task", "code,summarization", "--limit", "2", "--output", str(tmp_path / "eval.json")]) == 0
    alone = json.loads((tmp_path / "eval.json").read_text())
    inside = json.loads((out / "eval.json").read_text())
    def figures(summary: dict) -> dict:
        """The summary without its intervals: the sign-off computes each gate's PASS end and FAIL end at its own
        share of the look's error (evals/stats/paired.side_errors), a standalone eval a two-sided 95% interval."""
        if isinstance(summary, dict):
            return {k: figures(v) for k, v in summary.items() if k not in ("ci95", "ci_coverage", "ci_reliable")}
        return summary

    for task in ("code", "summarization"):
        assert figures(report["eval"][task]["summary"]) == figures(alone["tasks"][task]["summary"])
        ids = sorted(alone["tasks"][task]["records"])
        assert ids == sorted(inside["tasks"][task]["records"]) and len(ids) == 2
        for i in ids:  # the same generations, not just the same aggregate (a sandbox error names its temp dir)
            a, b = alone["tasks"][task]["records"][i], inside["tasks"][task]["records"][i]
            for side in ("candidate", "baseline"):
                assert {k: v for k, v in a[side].items() if k != "error"} == \
                    {k: v for k, v in b[side].items() if k != "error"}


@pytest.mark.parametrize("role", ["candidate", "baseline"])
def test_bench_tiers_equal_standalone_bench_serve(run, endpoints, role, tmp_path):
    _, out, report = run
    inside = json.loads((out / "bench.json").read_text())
    model_id = report["deployments"][role]["model_id"]
    with env(QTOOLKIT_API_KEY=KEYS[role], OPENAI_API_KEY=None):
        assert main(["bench", "serve", "--endpoint", endpoints[role], "--model", model_id, *LOAD, *BENCH_TOKENS,
                     "--output", str(tmp_path / "bench.json")]) == 0
    alone = json.loads((tmp_path / "bench.json").read_text())
    assert alone["inputs"]["workload_sha256"] == inside["inputs"]["workload_sha256"]
    keys = ("num_requests", "completed", "failed", "prompt_tokens", "output_tokens")
    for a, b in zip(alone["tiers"], inside["tiers"], strict=True):
        assert a["concurrency"] == b["concurrency"]
        assert {k: a["results"]["endpoint"][k] for k in keys} == {k: b["results"][role][k] for k in keys}


def test_an_undecided_gate_draws_more_items_through_the_endpoints(endpoints, int4_dir, tiny_model_dir, tmp_path):
    """As the local sign-off does: a required gate without evidence (random weights solve nothing) draws the
    next look's items, up to --max-items, reusing the first look's."""
    policy = tmp_path / "code-only.yaml"
    policy.write_text("version: 1\nname: code-only\ntasks:\n  code:\n    pass_at_1_drop: {max: 0.15}\n")
    out = tmp_path / "run"
    with env(**ROLE_ENV):
        code = main(["signoff", "--candidate-endpoint", endpoints["candidate"], "--baseline-endpoint",
                     endpoints["baseline"], "--model", str(int4_dir), "--baseline", str(tiny_model_dir),
                     "--policy", str(policy), "--limit", "1", "--max-items", "2", *LOAD, "--rounds", "2",
                     "--output", str(out)])
    report = json.loads((out / "report.json").read_text())
    looks = json.loads((out / "sequential.json").read_text())["looks"]
    assert [x["items"] for x in looks] == [1, 2] and looks[-1]["undecided"] == ["code.pass_at_1_drop"]
    assert report["verdict"] == "INCONCLUSIVE" and code == 3
    assert sorted(json.loads((out / "eval.json").read_text())["tasks"]["code"]["records"]) == \
        ["HumanEval/0", "HumanEval/1"]
    assert any(line.startswith("Sample size: 1 -> 2 items over 2 look(s)") for line in report["reading"])
    with env(**ROLE_ENV):
        assert main(["signoff", "--candidate-endpoint", endpoints["candidate"], "--baseline-endpoint",
                     endpoints["baseline"], "--model", str(int4_dir), "--limit", "4", "--max-items", "2",
                     "--output", str(tmp_path / "never")]) == 2
    assert not (tmp_path / "never").exists()


def test_keys_from_the_environment_appear_in_no_output_file(run, tmp_path):
    _, out, _ = run
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"report.json", "report.md", "report.html", "eval.json", "bench.json", "steps.json"} <= {p.name for p in files}
    for p in files:
        text = p.read_bytes()
        assert not any(k.encode() in text for k in KEYS.values()), p


def test_unreachable_endpoint_is_one_clear_error(endpoints, int4_dir, tmp_path, capsys):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    out = tmp_path / "never"
    with env(**ROLE_ENV):
        code = main(["signoff", "--candidate-endpoint", endpoints["candidate"], "--baseline-endpoint", dead,
                     "--model", str(int4_dir), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and not out.exists()
    assert "baseline endpoint" in err[0] and dead.removesuffix("/v1") in err[0] and "--baseline-endpoint" in err[0]


def test_wrong_model_id_and_missing_key_are_clear_errors(endpoints, int4_dir, tmp_path, capsys):
    base = ["signoff", "--candidate-endpoint", endpoints["candidate"], "--baseline-endpoint", endpoints["baseline"],
            "--model", str(int4_dir), "--output", str(tmp_path / "x")]
    with env(**ROLE_ENV):
        assert main([*base, "--baseline-model-id", "llama-70b"]) == 2
    err = capsys.readouterr().err
    assert "serves ['tiny-llama0'], not 'llama-70b'" in err and "--baseline-model-id" in err
    with env(**{**ROLE_ENV, "QTOOLKIT_CANDIDATE_API_KEY": None}):
        assert main(base) == 2
    err = capsys.readouterr().err
    assert "candidate endpoint" in err and "refused the API key" in err and "QTOOLKIT_CANDIDATE_API_KEY" in err
    assert KEYS["baseline"] not in err and not (tmp_path / "x").exists()
    assert main(["signoff", "--model", str(int4_dir), "--output", str(tmp_path / "y")]) == 2  # neither recipe nor endpoints


class _Busy(BaseHTTPRequestHandler):
    """A /v1/models that answers 429 (then 503) with Retry-After before it answers."""

    answers: list[int] = []

    def do_GET(self) -> None:
        status = self.answers.pop(0) if self.answers else 200
        body = json.dumps({"data": [{"id": "m"}]} if status == 200 else {"error": "busy"}).encode()
        self.send_response(status)
        if status != 200:
            self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_429_and_503_are_retried_honouring_retry_after():
    assert backoff_s(0, "2") == 2.0 and backoff_s(0, "3600") == 30.0  # capped
    assert backoff_s(3, None) == 4.0 and backoff_s(10, "soon") == 8.0  # exponential, capped
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        _Busy.answers = [429, 503]
        assert probe(Deployment("candidate", url)).model_id == "m" and _Busy.answers == []
        _Busy.answers = [429] * 10
        with pytest.raises(EndpointError, match="did not answer after 4 tries"):
            probe(Deployment("candidate", url))
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_several_candidate_endpoints_get_one_recommendation(endpoints, int4_dir, tiny_model_dir, tmp_path, capsys):
    """Two named candidates (here the same server twice) against one baseline endpoint: each gets its own
    deployment sign-off, the second reads every baseline completion the first generated, one line decides."""
    out = tmp_path / "sweep"
    cand = endpoints["candidate"]
    with env(**ROLE_ENV):
        code = main(["signoff", "--candidate-endpoint", f"a={cand}", "--candidate-endpoint", f"b={cand}",
                     "--baseline-endpoint", endpoints["baseline"], "--model", str(tiny_model_dir),
                     "--limit", "2", "--max-items", "2", *LOAD, "--rounds", "2", "--output", str(out)])
    sweep = json.loads((out / "report.json").read_text())
    assert code == sweep["exit_code"] and [c["name"] for c in sweep["candidates"]] == ["a", "b"]
    assert code == 3 and sweep["recommended"] is None  # KLD cannot be measured through endpoints: never a PASS
    assert capsys.readouterr().out.startswith(sweep["line"])
    for name in ("a", "b"):
        assert json.loads((out / "candidates" / name / "report.json").read_text())["deployments"]["candidate"]
    cache = json.loads((out / "candidates" / "b" / "eval.json").read_text())["models"]["baseline"]
    assert cache["generations_cache"]["misses"] == 0 and cache["generations_cache"]["hits"] > 0
    for blob in (out / "report.json", out / "report.md", out / "candidates" / "b" / "report.json"):
        assert KEYS["candidate"] not in blob.read_text() and KEYS["baseline"] not in blob.read_text()


@pytest.mark.parametrize("args, message", [
    (["--candidate-endpoint", "http://127.0.0.1:9/v1", "--candidate-endpoint", "b=http://127.0.0.1:9/v1"],
     "name each one"),
    (["--candidate-endpoint", "a=http://127.0.0.1:9/v1", "--candidate-endpoint", "a=http://127.0.0.1:9/v1"],
     "share a name"),
])
def test_several_candidate_endpoints_must_be_named_apart(tmp_path, capsys, args, message):
    out = tmp_path / "sweep"
    assert main(["signoff", *args, "--baseline-endpoint", "http://127.0.0.1:9/v1", "--output", str(out)]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_an_edited_data_file_is_evaluated_again(endpoints, int4_dir, tiny_model_dir, tmp_path, capsys):
    """The eval step's key holds each --data file's sha256: a workload file edited in place between two runs into
    the same folder is evaluated again, never reported 'up to date'."""
    data = tmp_path / "work.jsonl"
    lines = (Path(__file__).parents[1] / "evals" / "tasks" / "example-workload.jsonl").read_text().splitlines()
    data.write_text("\n".join(lines[:2]) + "\n")
    policy = tmp_path / "custom-only.yaml"
    policy.write_text("version: 1\nname: custom-only\ntasks:\n  custom:\n    nll_delta: {max: 0.10}\n")
    args = ["signoff", "--candidate-endpoint", endpoints["candidate"], "--baseline-endpoint", endpoints["baseline"],
            "--model", str(int4_dir), "--baseline", str(tiny_model_dir), "--policy", str(policy), "--data", str(data),
            "--limit", "2", "--max-items", "2", *LOAD, "--rounds", "2", "--output", str(tmp_path / "run")]
    evals = tmp_path / "run" / "eval.json"
    with env(**ROLE_ENV):
        assert main(args) in (0, 1, 3)
        first = evals.stat().st_mtime_ns
        assert main(args) in (0, 1, 3)
        assert evals.stat().st_mtime_ns == first  # same file, same code: the eval step is reused, not rewritten
        data.write_text("\n".join(lines[2:4]) + "\n")  # edited in place: other items under the same name
        assert main(args) in (0, 1, 3)
    assert evals.stat().st_mtime_ns != first
    records = json.loads((tmp_path / "run" / "eval.json").read_text())["tasks"]["custom:work"]["records"]
    ids = {json.loads(x)["id"] for x in lines[2:4]}
    assert set(records) == ids
