"""Load generator and workloads: seeded prompts and lengths, client-side timing, the `qtool bench serve` report."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from test_server import make_app, running

from qtoolkit.bench.load_client import RequestResult, run_load, summarize
from qtoolkit.bench.serve import bench_serve, format_table
from qtoolkit.bench.summary import TierSummary
from qtoolkit.bench.workloads import arrival_offsets, build_workload
from qtoolkit.errors import DataError


def test_workloads_are_seeded_real_prompts_with_bounded_lengths():
    a = build_workload("mixed", 200, seed=3, mean_output_tokens=64, max_output_tokens=128)
    assert a == build_workload("mixed", 200, seed=3, mean_output_tokens=64, max_output_tokens=128)
    assert a != build_workload("mixed", 200, seed=4, mean_output_tokens=64, max_output_tokens=128)
    kinds = {r.kind for r in a}
    assert kinds == {"code", "summarization"}
    assert all(4 <= r.max_tokens <= 128 for r in a)
    assert 45 < np.mean([r.max_tokens for r in a]) < 75  # lognormal mean 64, a little lost to the clip
    code = [r for r in a if r.kind == "code"]
    summ = [r for r in a if r.kind == "summarization"]
    assert all("def " in r.prompt for r in code)
    assert all(r.prompt.startswith("Read this abstract") and "main outcome" in r.prompt for r in summ)
    assert np.mean([r.max_tokens for r in code]) > np.mean([r.max_tokens for r in summ])
    assert len({r.prompt for r in code}) == len(code)  # 164 HumanEval prompts: no repeats in ~100 draws
    with pytest.raises(DataError):
        build_workload("poetry", 4)


def test_poisson_arrivals():
    assert arrival_offsets(5, None) == [0.0] * 5
    t = arrival_offsets(4000, 8.0, seed=1)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:], strict=False))
    assert abs(np.mean(np.diff(t)) - 1 / 8.0) < 0.01
    assert t == arrival_offsets(4000, 8.0, seed=1)


def test_summarize_counts_only_completed_requests():
    ok = [RequestResult(i, True, prompt_tokens=10, output_tokens=5, ttft=0.1 * (i + 1), latency=0.1 * (i + 1) + 0.4,
                        itl=[0.1] * 4) for i in range(4)]
    bad = [RequestResult(9, False, error="HTTP 503: busy")]
    s = summarize(ok + bad, duration=2.0)
    assert (s.completed, s.failed, s.output_tokens) == (4, 1, 20)
    assert s.output_tok_per_s == pytest.approx(10.0) and s.requests_per_s == pytest.approx(2.0)
    assert s.ttft.p50 == pytest.approx(0.25) and s.tpot.p50 == pytest.approx(0.1)
    assert s.itl.p99 == pytest.approx(0.1) and s.errors == ["HTTP 503: busy"]
    assert TierSummary.from_json(json.loads(json.dumps(s.to_json()))) == s  # bench JSON reads back as measured


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    with running(make_app(tiny_model_dir, max_num_seqs=16, max_waiting=64)) as url:
        yield url


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_run_load_streams_and_times_every_request(server_url, api):
    reqs = build_workload("mixed", 6, seed=1, mean_output_tokens=6, max_output_tokens=12)
    results, duration = asyncio.run(run_load(server_url, "tiny-llama0", reqs, concurrency=3, rate=20.0, api=api))
    assert duration > 0 and [r.index for r in results] == [r.index for r in reqs]
    for res, req in zip(results, reqs, strict=True):
        assert res.ok, res.error
        assert res.output_tokens == req.max_tokens  # EOS ignored: lengths are as drawn
        assert res.prompt_tokens > 0 and 0 < res.ttft <= res.latency
        assert len(res.itl) <= req.max_tokens - 1


def test_run_load_reports_http_errors(server_url):
    reqs = build_workload("code", 2, seed=0, mean_output_tokens=4, max_output_tokens=8)
    results, _ = asyncio.run(run_load(server_url, "no-such-model", reqs, concurrency=2))
    assert not any(r.ok for r in results) and all(r.error.startswith("HTTP 404") for r in results)


def test_bench_serve_against_an_endpoint(server_url):
    partial = []
    report = bench_serve(endpoint=f"{server_url}/v1", concurrency=[1, 3], num_requests=3, workload="code",
                         mean_output_tokens=4, max_output_tokens=8,
                         on_tier=lambda r: partial.append((len(r["tiers"]), r["complete"])))
    assert partial == [(1, False), (2, False)] and report["complete"]  # one call per measured system
    assert report["schema_version"] >= 1 and report["inputs"]["workload_sha256"]
    assert report["config"]["model"] == "tiny-llama0"  # `default` resolved through /v1/models
    assert [t["concurrency"] for t in report["tiers"]] == [1, 3]
    for tier in report["tiers"]:
        r = tier["results"]["endpoint"]
        assert r["completed"] == 3 and r["failed"] == 0 and r["output_tok_per_s"] > 0
    assert "endpoint" in format_table(report)


@pytest.mark.slow
def test_cli_static_vs_continuous_vs_hf(tiny_model_dir, tmp_path, capsys):
    """The full command: two server subprocesses and HF generate, measured in one run."""
    from qtoolkit.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--model", str(tiny_model_dir), "--concurrency", "1,2", "--batching",
               "static,continuous", "--num-requests", "3", "--compare", "hf", "--mean-output-tokens", "4",
               "--max-output-tokens", "8", "--kv-cache-memory", "16MiB", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    for tier in report["tiers"]:
        assert set(tier["results"]) == {"static", "continuous", "hf"}
        assert tier["ratios"]["continuous_over_static"] > 0 and tier["ratios"]["engine_over_hf"] > 0
        assert tier["results"]["hf"]["output_tokens"] == tier["results"]["static"]["output_tokens"]
    assert "continuous_over_static" in capsys.readouterr().out
