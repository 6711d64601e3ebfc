"""python -m qtoolkit.peers.client_agreement: bad input is one line and exit 2 before any server starts; the
verdict reads every peer client's medians against qtool bench serve's; with the vLLM tier, vLLM's own bench client
runs against `qtool serve` and its figures land in the JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from qtoolkit.peers.client_agreement import Reading, TierAgreement, main


@pytest.mark.parametrize(("args", "named"), [
    (["--concurrency", "0"], "must be >= 1"),
    (["--concurrency", "one"], "comma-separated integers"),
    (["--clients", "vllm,qtool"], "qtool first"),
    (["--clients", "qtool"], "qtool first"),
    (["--clients", "qtool,guidellm", "--guidellm", "/nonexistent/guidellm"], "no GuideLLM at /nonexistent"),
    (["--output-tokens", "1"], "--output-tokens >= 2"),
])
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys, args, named):
    out = tmp_path / "a.json"
    assert main(["--output", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def tier(ours: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> TierAgreement:
    return TierAgreement(1, ("qtool", "vllm"), {"qtool": [Reading(*r) for r in ours],
                                                 "vllm": [Reading(*r) for r in theirs]})


def test_agreement_is_judged_on_the_median_of_paired_round_ratios_within_ten_percent():
    # round ratios: TTFT 1.05, 0.36, 4.55 and TPOT 1.05, 0.86, 1.10: a round's outlier on one side does not count
    t = tier([(100, 20), (300, 22), (110, 21)], [(105, 21), (108, 19), (500, 23.1)])
    assert t.agrees() and math.isclose(t.ratio("ttft_ms")["vllm"], 1.05)
    assert math.isclose(t.ratio("tpot_ms")["vllm"], 1.05)
    t = tier([(100, 20)], [(100, 22.5)])  # TPOT 12.5% slower
    assert not t.agrees() and math.isclose(t.ratio("tpot_ms")["vllm"], 1.125)


def test_rejudge_reads_the_rounds_back_and_refuses_what_is_not_a_result(tmp_path, capsys):
    out = tmp_path / "a.json"
    t = tier([(100, 20), (120, 20)], [(100, 30), (120, 30)])
    out.write_text(json.dumps({"command": "x", "tiers": [asdict(t)]}))
    assert main(["--output", str(out), "--rejudge"]) == 1  # TPOT 1.5x: no agreement
    data = json.loads(out.read_text())
    assert data["agree"] is False and math.isclose(data["tiers"][0]["tpot_ratio"]["vllm"], 1.5)
    assert data["command"] == "x"
    bad = tmp_path / "b.json"
    bad.write_text("{}")
    assert main(["--output", str(bad), "--rejudge"]) == 2
    assert "not a client_agreement result" in capsys.readouterr().err


@pytest.mark.vllm
def test_vllm_bench_serve_reads_qtool_serve(tmp_path):
    out = tmp_path / "agreement.json"
    code = main(["--output", str(out), "--clients", "qtool,vllm", "--concurrency", "1", "--num-prompts", "2",
                 "--output-tokens", "8", "--rounds", "1"])
    assert code in (0, 1)  # agreement itself is a measurement (measurements/), not asserted on a loaded machine
    result = json.loads(out.read_text())
    (t,) = result["tiers"]
    assert set(t["rounds"]) == {"qtool", "vllm"} and result["agree"] == (code == 0)
    for r in (t["ttft_ratio"]["vllm"], t["tpot_ratio"]["vllm"]):
        assert math.isfinite(r) and r > 0


def test_guidellm_is_asked_for_greedy_decoding_as_the_other_two_clients_are(tmp_path):
    """GuideLLM sends no temperature by default, so the server sampled at 1.0 for it alone: its c=4 inter-token
    latency read 1.19x qtool's for that reason (measurements/2026-12-05/issue40e/). The scenario it runs must ask for
    what qtool bench serve asks for."""
    from qtoolkit.bench.load_client import request_body
    from qtoolkit.bench.types import BenchRequest
    from qtoolkit.peers.client_agreement import Load, guidellm_reading

    fake = tmp_path / "guidellm"  # records its scenario and writes the one result field read back
    fake.write_text("#!/bin/sh\ncp \"$3\" \"$(dirname \"$3\")/seen.json\"\n"
                    "echo '{\"benchmarks\": [{\"metrics\": {\"time_to_first_token_ms\": {\"successful\": "
                    "{\"median\": 5.0}}, \"inter_token_latency_ms\": {\"successful\": {\"median\": 2.0}}}}]}' "
                    "> \"${5#kind=json,path=}\"\n")
    fake.chmod(0o755)
    load = Load("http://127.0.0.1:1", "m", "tok", tmp_path / "p.jsonl", tmp_path / "v.jsonl", tmp_path / "g.jsonl", 2, 0)
    assert guidellm_reading(fake, load, 4, tmp_path / "out.json") == Reading(5.0, 2.0)
    spec = json.loads((tmp_path / "seen.json").read_text())["spec"]
    ours = request_body("m", BenchRequest(0, "completion", "p", 8), api="completions", ignore_eos=True)
    assert spec["backend"]["extras"]["body"]["temperature"] == ours["temperature"] == 0
    assert spec["profile"] == {"kind": "concurrent", "streams": 4}


def test_each_client_reads_the_same_prompts_and_lengths_in_its_own_format(tmp_path):
    from qtoolkit.peers.client_agreement import output_lengths, write_prompts

    spread = output_lengths(16, 64, True, seed=0)
    assert spread == output_lengths(16, 64, True, seed=0) and len(set(spread)) > 4
    assert all(32 <= k <= 96 for k in spread) and output_lengths(3, 64, False, 0) == [64, 64, 64]
    files = write_prompts(tmp_path, 16, spread)
    rows = [[json.loads(line) for line in f.read_text().splitlines()] for f in files]
    for column, file_rows in zip(("max_tokens", "output_tokens", "output_tokens_count"), rows, strict=True):
        assert [r[column] for r in file_rows] == spread
        assert [r["prompt"] for r in file_rows] == [r["prompt"] for r in rows[0]]
