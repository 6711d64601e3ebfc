"""Speculative decoding through the OpenAI server and the CLI: per-request figures in the usage block,
engine-wide ones in /metrics, start-up errors as exit code 2."""

from __future__ import annotations

import json

import httpx
from test_server import TIMEOUT, running, sse_events

from qtoolkit.cli import main
from qtoolkit.engine import Engine
from qtoolkit.server import create_app
from qtoolkit.server.metrics import parse_speculative, samples


def test_usage_block_and_metrics_report_speculation(tiny_model_dir):
    # the target drafting for itself: every proposal is accepted, so the expected figures are exact
    engine = Engine(str(tiny_model_dir), kv_cache_memory="16MiB", speculative=f"draft:{tiny_model_dir}",
                    num_speculative_tokens=3)
    engine.spec_policy.adaptive = False  # a draft as costly as the target would be switched off by the cost model
    with running(create_app(engine)) as url:
        body = {"prompt": "def add(a, b):", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
        usage = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()["usage"]
        assert usage["completion_tokens"] == 9
        spec = usage["speculative"]
        assert spec["acceptance_rate"] == 1.0 and spec["draft_tokens"] > 0
        assert spec["mean_accepted_length"] > 2
        with httpx.stream("POST", f"{url}/v1/completions", timeout=TIMEOUT,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            events = sse_events(resp)
        assert events[-2]["usage"]["speculative"]["accepted_tokens"] > 0
        scraped = samples(httpx.get(f"{url}/metrics").text)
        assert scraped[("qtool_spec_acceptance_rate", ())] == 1.0
        assert scraped[("qtool_spec_acceptance_by_position", (("position", "1"),))] == 1.0
        assert scraped[("qtool_spec_draft_tokens_total", ())] >= 2 * spec["draft_tokens"]
        # the draft length the policy chose per batch size (here k = 3 whenever there was room for it)
        length = scraped[("qtool_spec_chosen_draft_length", (("batch_size", "1"),))]
        assert 0 < length <= 3
        parsed = parse_speculative(httpx.get(f"{url}/metrics").text)
        assert parsed.chosen_length_by_batch == {1: length} and parsed.steps_by_batch[1] > 0


def test_generate_cli_speculates_and_rejects_bad_flags(tiny_model_dir, capsys):
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello hello hello", "--max-tokens", "6",
            "--kv-cache-memory", "16MiB"]
    assert main(args + ["--speculative", "ngram", "--num-speculative-tokens", "3"]) == 0
    assert "[speculative ngram:" in capsys.readouterr().err
    assert main(args + ["--speculative", "ngram", "--num-speculative-tokens", "0"]) == 2
    assert "--num-speculative-tokens" in capsys.readouterr().err
    assert main(args + ["--speculative", "draft:/nonexistent/draft"]) == 2
    assert "/nonexistent/draft" in capsys.readouterr().err


def test_bench_serve_measures_the_speculative_curve(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--model", str(tiny_model_dir), "--concurrency", "1,2", "--num-requests", "2",
               "--workload", "code", "--mean-output-tokens", "6", "--max-output-tokens", "8",
               "--kv-cache-memory", "16MiB", "--speculative", "ngram", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["config"]["speculative"] == ["ngram"]
    assert [p["concurrency"] for p in report["speculative_curve"]["continuous+ngram"]] == [1, 2]
    for tier in report["tiers"]:
        assert tier["ratios"]["continuous+ngram_over_continuous"] > 0
        assert "speculative" in tier["results"]["continuous+ngram"]
        assert "speculative" not in tier["results"]["continuous"]
        engine = tier["results"]["continuous+ngram"]["speculative_engine"]  # scraped from /metrics over the tier
        assert engine["proposer_seconds"] >= 0 and engine["verify_seconds"] >= 0
        assert engine["accepted_tokens"] <= engine["draft_tokens"]
        # the chosen draft length per batch size the tier ran at (keys are batch sizes, values 0..k)
        lengths = engine["chosen_draft_length_by_batch"]
        assert lengths and all(int(n) >= 1 and 0 <= v <= 4 for n, v in lengths.items())
    ceiling = report["tiers"][0]["results"]["continuous+ngram"]["speculative_ceiling"]  # at concurrency 1 only
    assert 0 < ceiling["prefill_share"] < 1 and ceiling["full_acceptance"]["request_speedup"] >= 1.0
    assert "speculative_ceiling" not in report["tiers"][1]["results"]["continuous+ngram"]
    assert "ceiling" in report["speculative_curve"]["continuous+ngram"][0]
    assert main(["bench", "serve", "--model", str(tiny_model_dir), "--speculative", "ngram",
                 "--num-speculative-tokens", "40", "--output", str(tmp_path / "x.json")]) == 2
