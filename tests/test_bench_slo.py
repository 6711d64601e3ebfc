"""`qtool bench serve`'s latency distributions, open-loop arrivals, goodput and SLO sweep: typed tier summaries,
saturation told apart from a slow server, the bracketing search, and bad values refused before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_server import make_app, running

from qtoolkit.bench.serve import Arrivals, bench_serve
from qtoolkit.bench.slo_sweep import OK, SATURATED, VIOLATED, RateSearch, slo_sweep
from qtoolkit.bench.summary import SLO, Distribution, Saturation, TierSummary
from qtoolkit.bench.types import RequestResult
from qtoolkit.bench.workloads import arrival_offsets
from qtoolkit.cli import main
from qtoolkit.errors import QToolError


def test_gamma_arrivals_keep_the_rate_and_burstiness_sets_the_spread():
    for burstiness in (0.25, 1.0, 4.0):
        t = np.diff(arrival_offsets(20000, 5.0, seed=2, burstiness=burstiness))
        assert np.mean(t) == pytest.approx(0.2, rel=0.05)
        # gamma gaps of shape k: squared coefficient of variation 1/k (1: Poisson)
        assert np.var(t) / np.mean(t) ** 2 == pytest.approx(1 / burstiness, rel=0.1)
    assert arrival_offsets(10, 5.0, seed=1) == arrival_offsets(10, 5.0, seed=1, burstiness=1.0)


def _result(i: int, ttft: float, tpot: float, n: int = 11, sent: float = 0.0) -> RequestResult:
    return RequestResult(i, True, prompt_tokens=5, output_tokens=n, ttft=ttft, latency=ttft + tpot * (n - 1),
                         itl=[tpot] * (n - 1), sent_at=sent)


def test_tier_summary_distributions_and_goodput_as_vllm_defines_them():
    results = [_result(i, ttft=0.1 * (i + 1), tpot=0.01 * (i + 1)) for i in range(10)]
    s = TierSummary.of(results + [RequestResult(99, False, error="HTTP 503")], 5.0,
                       slo=SLO(ttft_ms=500, tpot_ms=80))
    assert (s.completed, s.failed) == (10, 1)
    assert s.ttft.p50 == pytest.approx(0.55) and s.ttft.p90 == pytest.approx(0.91)
    assert s.ttft.p99 == pytest.approx(0.991) and s.tpot.mean == pytest.approx(0.055)
    assert s.goodput == pytest.approx(5 / 5.0)  # requests 0-4 meet both bounds: 5 good over 5 s
    back = TierSummary.from_json(json.loads(json.dumps(s.to_json())))
    assert back == s
    assert Distribution.of([]) == Distribution()


def test_saturation_tells_a_queue_from_a_server_that_keeps_up():
    rate = 4.0
    kept_up = [_result(i, 0.2, 0.01, sent=i / rate) for i in range(24)]
    assert not Saturation.of(kept_up, rate).saturated
    # completions leave at 1/s while requests arrive at 4/s: each waits behind the ones before it
    queued = [_result(i, 0.2 + i * (1.0 - 1 / rate), 0.01, sent=i / rate) for i in range(24)]
    sat = Saturation.of(queued, rate)
    assert sat.saturated and sat.achieved_rate < 0.85 * rate and sat.ttft_growth > 2
    assert sat.ttft_trend_p is not None and sat.ttft_trend_p < 1e-6


def test_mixed_prompt_lengths_that_happen_to_end_long_are_not_a_queue():
    """A sign-off's 16-request probe of code (short prompts) and documents (long): the last third's median TTFT
    is 5x the first third's by the draw of prompts alone, with no wait growing over the run."""
    rate = 1.3
    ttfts = [0.1, 0.5, 0.1, 0.1, 0.5, 0.1, 0.5, 0.1, 0.5, 0.1, 0.5, 0.5, 0.1, 0.5, 0.5, 0.1]
    sat = Saturation.of([_result(i, t, 0.01, sent=i / rate) for i, t in enumerate(ttfts)], rate)
    assert sat.ttft_growth == pytest.approx(5.0) and sat.ttft_trend_p > 0.05 and not sat.saturated
    # the same sizes with a queue building under them: every later arrival waits longer
    queued = [_result(i, t + 0.3 * i, 0.01, sent=i / rate) for i, t in enumerate(ttfts)]
    assert Saturation.of(queued, rate).saturated


def _fake_server(capacity: float):
    """A server whose p99 TTFT grows with load and which saturates past `capacity` requests/s."""
    calls = []

    def probe(rate: float, k: int) -> TierSummary:
        calls.append(rate)
        load = rate / capacity
        if load > 1:
            res = [_result(i, 0.1 + i * (1 / capacity - 1 / rate), 0.02, sent=i / rate) for i in range(24)]
        else:
            res = [_result(i, 0.1 + 0.5 * load ** 3, 0.02 + 0.02 * load, sent=i / rate) for i in range(24)]
        return TierSummary.of(res, 24 / min(rate, capacity), rate=rate)

    return probe, calls


def test_slo_sweep_brackets_the_capacity_and_reports_saturated_rates():
    probe, calls = _fake_server(capacity=3.0)
    # p99 TTFT <= 400 ms holds while 0.1 + 0.5 load^3 <= 0.4, i.e. below 0.843 x capacity = 2.53/s
    sweep = slo_sweep(probe, SLO(ttft_ms=400, tpot_ms=100), start_rate=1.0, precision=1.1)
    assert 2.53 / 1.1 <= sweep.capacity <= 2.53 and sweep.failed_at / sweep.capacity <= 1.1
    statuses = {round(p.rate, 6): p.status for p in sweep.points}
    assert statuses[1.0] == statuses[2.0] == OK and statuses[4.0] == SATURATED
    assert sweep.saturated_rates == [4.0] and VIOLATED in statuses.values()
    js = sweep.to_json()
    assert js["capacity_rps"] == sweep.capacity and js["points"][2]["status"] == SATURATED
    # a start above the capacity halves down to it
    probe, _ = _fake_server(capacity=3.0)
    assert slo_sweep(probe, SLO(ttft_ms=400), start_rate=40.0).capacity is not None


@pytest.mark.parametrize("text", ["ttft_ms=abc", "ttft=-5", "latency_ms=3", "", "tpot_ms=nan", "ttft_ms"])
def test_bad_slo_is_refused(text):
    with pytest.raises(QToolError, match="--slo"):
        SLO.parse(text)


def test_slo_accepts_our_names_and_vllms():
    assert SLO.parse("ttft_ms=2000,tpot_ms=50") == SLO.parse("ttft:2000 tpot:50") == SLO(2000.0, 50.0)


@pytest.mark.parametrize("flags, words", [
    (["--slo", "ttft_ms=fast"], "--slo"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "2", "--burstiness", "0"], "--burstiness"),
    (["--burstiness", "0.5"], "--request-rate R"),
    (["--slo", "ttft_ms=100", "--slo-requests", "2"], "--slo-requests"),
    (["--slo", "ttft_ms=100", "--slo-start-rate", "inf"], "--slo-start-rate"),
])
def test_bad_bench_serve_values_are_one_line_exit_2_and_no_file(flags, words, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--output", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
    assert not out.exists()


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir):
    # one sequence at a time: a rate past what it serves builds a queue
    with running(make_app(tiny_model_dir, max_num_seqs=1, max_waiting=256)) as url:
        yield url


def test_bench_serve_finds_a_capacity_and_reports_a_rate_past_it_as_saturated(slow_server):
    report = bench_serve(endpoint=f"{slow_server}/v1", concurrency=[1], num_requests=4, workload="code",
                         mean_output_tokens=8, max_output_tokens=12,
                         arrivals=Arrivals(slo=SLO(ttft_ms=60000, tpot_ms=60000), slo_requests=12))
    sweep = report["slo_sweep"]["endpoint"]
    tier = report["tiers"][0]["results"]["endpoint"]
    assert tier["ttft_s"]["p90"] is not None and tier["request_goodput"] == pytest.approx(tier["requests_per_s"])
    # bounds no latency breaks: the only way to fail is to be past what the server carries
    assert sweep["capacity_rps"] > 0 and sweep["saturated_rps"]
    assert min(sweep["saturated_rps"]) > sweep["capacity_rps"]
    assert all(p["status"] in (OK, SATURATED) for p in sweep["points"])


def test_a_server_that_misses_the_slo_unloaded_is_not_probed_at_ever_lower_rates():
    """3 s to the first token at any load against a 2 s bound: once a failing probe had under half a request in
    flight on average (rate x mean latency), a lower rate cannot meet it, and each halving doubles a probe's time."""
    search = RateSearch(SLO(ttft_ms=2000), start_rate=1.0, min_rate=1e-3)
    while (rate := search.next_rate()) is not None:
        search.record(rate, TierSummary.of([_result(i, 3.0, 0.01, sent=i / rate) for i in range(16)], 16 / rate,
                                           rate=rate))
    rates = [p.rate for p in search.points]
    assert rates == [1.0, 0.5, 0.25] and search.missed_unloaded  # 0.25 x 3.1 s: under one in flight
    result = search.result()
    assert result.capacity is None and result.estimate is None


def test_a_server_whose_median_request_misses_the_slo_stops_under_one_request_in_flight():
    """12 s a request, 0.3 s a token against TPOT <= 100 ms: at 0.06 requests/s under one request is in flight
    (0.72), the median request already misses the bound, and a lower rate cannot help."""
    search = RateSearch(SLO(tpot_ms=100), start_rate=0.25, min_rate=1e-3)
    while (rate := search.next_rate()) is not None:
        search.record(rate, TierSummary.of([_result(i, 0.3, 0.3, n=41, sent=i / rate) for i in range(16)],
                                           16 / rate, rate=rate))
    assert [p.rate for p in search.points] == [0.25, 0.125, 0.0625] and search.missed_unloaded
