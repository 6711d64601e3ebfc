"""`qtool bench serve` speaks vLLM's benchmark language: its flag names and, per tier, its JSON field names/units."""

from __future__ import annotations

import json

import pytest
from test_server import make_app, running

from qtoolkit.bench.load_client import RequestResult, summarize
from qtoolkit.cli import main
from qtoolkit.endpoints.args import resolve_server
from qtoolkit.errors import QToolError

VLLM_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput",
             *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el"))}


def test_summary_has_vllm_names_in_milliseconds():
    ok = [RequestResult(i, True, prompt_tokens=10, output_tokens=5, ttft=0.1 * (i + 1), latency=0.1 * (i + 1) + 0.4,
                        itl=[0.1] * 4) for i in range(4)]
    s = summarize([*ok, RequestResult(9, False, error="HTTP 503")], duration=2.0).to_json()  # as bench JSON holds it
    assert VLLM_KEYS <= set(s)
    assert s["mean_ttft_ms"] == pytest.approx(250.0) and s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["std_ttft_ms"] == pytest.approx(111.8034, rel=1e-4)  # population std of 100..400 ms
    assert s["mean_tpot_ms"] == pytest.approx(100.0) and s["p99_itl_ms"] == pytest.approx(100.0)
    assert s["mean_e2el_ms"] == pytest.approx(650.0)
    assert s["output_throughput"] == pytest.approx(10.0) and s["request_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(30.0) and (s["completed"], s["failed"]) == (4, 1)
    assert s["ttft_s"]["p50"] == pytest.approx(0.25)  # today's figures stay beside them


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    with running(make_app(tiny_model_dir, max_num_seqs=16, max_waiting=64)) as url:
        yield url


@pytest.mark.parametrize("flags", [
    ["--base-url", "{url}", "--endpoint", "/v1/chat/completions", "--max-concurrency", "1,2", "--num-prompts", "2",
     "--request-rate", "50"],
    ["--endpoint", "{url}/v1", "--api", "chat", "--concurrency", "1,2", "--num-requests", "2", "--rate", "50"],
])
def test_bench_json_has_vllm_keys_with_either_flag_names(flags, server_url, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", *[f.format(url=server_url) for f in flags], "--workload", "code",
            "--mean-output-tokens", "4", "--max-output-tokens", "6", "--output", str(out), "-q"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["config"]["api"] == "chat"
    assert [t["max_concurrency"] for t in report["tiers"]] == [1, 2]
    for tier in report["tiers"]:
        assert tier["num_prompts"] == 2 and tier["request_rate"] == 50.0
        r = tier["results"]["endpoint"]
        assert VLLM_KEYS <= set(r) and r["completed"] == 2
        assert r["output_throughput"] > 0 and r["mean_ttft_ms"] > 0
        assert r["mean_ttft_ms"] == pytest.approx(1000 * r["ttft_s"]["mean"])


@pytest.mark.parametrize("base, endpoint, want", [
    (None, "http://h:8000/v1", ("http://h:8000", "/v1/completions")),
    (None, "http://h:8000/v1/chat/completions", ("http://h:8000", "/v1/chat/completions")),
    ("http://h:8000/v1/", "/v1/completions", ("http://h:8000", "/v1/completions")),
    ("http://h:8000", None, ("http://h:8000", "/v1/completions")),
    (None, None, (None, "/v1/completions")),
])
def test_base_url_and_endpoint_read_as_vllm_does(base, endpoint, want):
    assert resolve_server(base, endpoint, ("/v1/completions", "/v1/chat/completions")) == want


@pytest.mark.parametrize("base, endpoint, words", [
    (None, "/v1/completions", "--base-url"),
    ("http://h:1", "http://h:2/v1", "is a URL and --base-url"),
    ("h:8000", None, r"not an http\(s\) URL"),
    ("http://h:1", "/v1/embeddings", "not a route"),
])
def test_bad_server_flags_are_one_line_errors(base, endpoint, words):
    with pytest.raises(QToolError, match=words) as e:
        resolve_server(base, endpoint, ("/v1/completions", "/v1/chat/completions"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags, words", [
    (["--endpoint", "/v1/completions"], "name the server with --base-url"),
    (["--base-url", "http://127.0.0.1:9", "--endpoint", "/v1/chat/completions"], "not a route this command uses"),
])
def test_eval_reads_the_same_server_flags(flags, words, capsys):
    assert main(["eval", "--model", "default", "--baseline", "default", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err
