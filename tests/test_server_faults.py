"""The engine loop under faults, streaming around stop strings, counters in /metrics, and load at the bound."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import TIMEOUT, make_app, metrics, running, sse_events, wait_until_idle

from qtoolkit.server.metrics import TokenRate
from qtoolkit.server.stops import StreamCursor, held_back


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    app = make_app(tiny_model_dir, max_num_seqs=4, max_waiting=4)
    with running(app) as url:
        yield url, app.state.qtool


def once(obj, name: str):
    """Make obj.name raise once, then behave as before."""
    real = getattr(obj, name)

    def broken(*args, **kwargs):
        setattr(obj, name, real)
        raise RuntimeError(f"injected fault in {name}")

    setattr(obj, name, broken)


FAULTS = {
    "step": lambda st: once(st.engine, "step"),
    "stats": lambda st: once(st.engine, "stats"),
    "metrics": lambda st: once(st.metrics, "record_step"),
    "delivery": lambda st: once(st.driver, "_deliver"),
    "engine add": lambda st: once(st.engine, "add_request"),
    "command handling": lambda st: once(st.driver, "_apply"),
}


@pytest.mark.parametrize("part", list(FAULTS))
def test_a_fault_in_any_part_of_the_loop_fails_that_request_and_the_loop_goes_on(live, part):
    url, state = live
    FAULTS[part](state)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
                   timeout=TIMEOUT)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
                   timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_until_idle(url)  # the failed request's KV blocks were given back


def test_an_engine_that_cannot_go_on_stops_admission_and_health_says_why(tiny_model_dir):
    app = make_app(tiny_model_dir)
    engine = app.state.qtool.engine

    def broken_step():
        raise RuntimeError("device lost")

    engine.step = broken_step
    with running(app) as url:
        for _ in range(3):  # three failed iterations in a row: the engine is broken for good
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
            assert r.status_code in (500, 503)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "device lost" in health.json()["reason"]
        t = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
        assert "retry-after" not in r.headers and time.monotonic() - t < 10  # at once, not after a wait
        assert metrics(url)["qtool_engine_up"] == 0


def test_a_dead_engine_thread_fails_the_waiting_requests(tiny_model_dir):
    app = make_app(tiny_model_dir)
    engine = app.state.qtool.engine

    def dying_step():
        raise SystemExit("engine thread killed")  # not an Exception: it ends the thread

    engine.step = dying_step
    with running(app) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
        assert r.status_code == 503 and "engine thread died" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503


def test_a_hung_step_ends_the_request_at_its_deadline(tiny_model_dir):
    app = make_app(tiny_model_dir, request_timeout_s=1.0)
    engine = app.state.qtool.engine
    release, real_step = threading.Event(), engine.step

    def hung_step():
        release.wait(30)
        return real_step()

    engine.step = hung_step
    with running(app) as url:
        try:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        finally:
            release.set()
            engine.step = real_step


def test_stream_holds_back_a_possible_stop_string():
    # "1" then "\n", "def", " ": a stream that sent text as decoded would have sent "1\ndef"
    cursor, text, sent = StreamCursor(["\ndef "]), "", []
    for piece in ["1", "\n", "def"]:
        text += piece
        sent.append(cursor.advance(text, finished=False))
    sent.append(cursor.advance("1", finished=True))  # the engine found "\ndef " and cut the text before it
    assert "".join(sent) == "1"
    assert held_back("x\nde", ["\ndef ", "zz"]) == 3 and held_back("abc", ["\ndef "]) == 0


def test_stream_equals_final_text_with_stop_strings(live):
    url, _ = live
    body = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()
    text = r["choices"][0]["text"]
    assert len(text) > 12
    # stops taken from the model's own output, spanning several tokens, plus the code eval's "\ndef "
    cut = len(text) // 2
    stops = [text[cut:cut + 8], "\ndef ", "\nclass "]
    body |= {"stop": stops}
    final = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    assert final["finish_reason"] == "stop" and final["text"] == text[:text.find(stops[0])]
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=TIMEOUT) as resp:
        events = sse_events(resp)
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed == final["text"]


def test_totals_are_counters_with_vllm_names(live):
    url, _ = live
    before = metrics(url)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "one two three", "max_tokens": 5, "ignore_eos": True},
                   timeout=TIMEOUT).json()
    after = metrics(url)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == r["usage"]["prompt_tokens"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    types = {f.name: f.type for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
                 "qtool_requests_rejected"):
        assert types[name] == "counter", name
    assert types["vllm:num_requests_running"] == "gauge" and types["vllm:kv_cache_usage_perc"] == "gauge"


def test_token_rate_keeps_a_bounded_window(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    rate = TokenRate(window_s=10)
    for _ in range(10_000):  # a long run with no scrape in between
        rate.add(3)
        clock[0] += 0.01
    assert len(rate._buckets) <= 11
    assert rate.rate() == pytest.approx(30 * 100 / 10 * 0.9, rel=0.15)


async def _load(url: str, n: int) -> list[tuple[int, int | None]]:
    body = {"prompt": "load", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one(client: httpx.AsyncClient) -> tuple[int, int | None]:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return resp.status_code, None
            usage = None
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line and '"choices":[]' in line:
                    usage = int(line.split('"completion_tokens":')[1].split(",")[0])
            return 200, usage

    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(n))))


def test_load_past_the_admission_bound(live):
    url, state = live
    peak, real_admit = [0], state.driver.admit

    def watched_admit(n):
        real_admit(n)
        peak[0] = max(peak[0], state.driver.in_flight)

    state.driver.admit = watched_admit
    try:
        results = asyncio.run(asyncio.wait_for(_load(url, 40), 180))
    finally:
        state.driver.admit = real_admit
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses
    assert peak[0] == state.driver.max_in_flight  # the bound was reached, never passed
    assert all(tokens == 40 for s, tokens in results if s == 200)
    wait_until_idle(url)


def test_prompts_are_tokenized_off_the_event_loop(live):
    url, state = live
    threads: list[str] = []
    real = state.tokenizer.encode

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    state.tokenizer.encode = recording
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["hi", "there"], "max_tokens": 1}, timeout=TIMEOUT)
        c = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 1}, timeout=TIMEOUT)
    finally:
        state.tokenizer.encode = real
    assert r.status_code == 200 and c.status_code == 200, (r.text, c.text)
    # every encode ran on the server's tokenize worker, none on the thread that runs the event loop
    assert len(threads) >= 3 and all(name.startswith("qtool-tokenize") for name in threads), threads
