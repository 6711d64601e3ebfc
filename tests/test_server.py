"""The OpenAI-compatible server on a real loopback socket, over the real engine with the tiny model."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from qtoolkit.engine.config import EngineConfig
from qtoolkit.server.metrics import samples

TIMEOUT = httpx.Timeout(60.0)


@contextlib.contextmanager
def running(app):
    """Serve `app` with uvicorn on 127.0.0.1 in a thread; yield its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def make_app(model_dir, **kw):
    from qtoolkit.engine import Engine, EngineConfig
    from qtoolkit.server import create_app

    engine = Engine(str(model_dir), EngineConfig(kv_cache_memory=kw.pop("kv_cache_memory", "16MiB"),
                                              max_num_seqs=kw.pop("max_num_seqs", 32)))
    return create_app(engine, **kw)


@pytest.fixture(scope="module")
def base_url(tiny_model_dir):
    with running(make_app(tiny_model_dir, max_num_seqs=32, max_waiting=512)) as url:
        yield url


def metrics(url: str) -> dict[str, float]:
    return {name: value for (name, labels), value in samples(httpx.get(f"{url}/metrics").text).items() if not labels}


def wait_until_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing is in flight and no KV block is used; return the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m["qtool_requests_in_flight"] == 0 and m["vllm:num_requests_running"] == 0
        if idle and m["qtool_kv_blocks_used"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {m}")
        time.sleep(0.1)


def sse_events(resp: httpx.Response) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_models_and_metrics(base_url):
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{base_url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-llama0"
    assert models["data"][0]["max_model_len"] > 0
    m = metrics(base_url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "qtool_kv_blocks_used",
                 "qtool_kv_blocks_free",
                 "qtool_generation_tokens_per_second", "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count"):
        assert name in m, name
    assert m["qtool_kv_blocks_free"] > 0


def test_completion_streamed_equals_unstreamed(base_url):
    body = {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{base_url}/v1/completions", json=body, timeout=TIMEOUT).json()
    assert plain["object"] == "text_completion"
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=TIMEOUT,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 12 and events[-2]["choices"] == []
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_batch_prompts_and_n_choices(base_url):
    body = {"prompt": ["one two", "three four five"], "n": 2, "max_tokens": 3, "ignore_eos": True, "temperature": 0.9,
            "seed": 7}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=TIMEOUT).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["usage"]["completion_tokens"] == 12
    again = httpx.post(f"{base_url}/v1/completions", json=body, timeout=TIMEOUT).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in r["choices"]]  # seeded: reproducible


def test_chat_completion_and_stream(base_url):
    body = {"model": "tiny-llama0", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    assert r["usage"]["completion_tokens"] == 5 and r["usage"]["prompt_tokens"] > 10  # the template was applied
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body | {"stream": True},
                      timeout=TIMEOUT) as resp:
        events = sse_events(resp)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert text == r["choices"][0]["message"]["content"]


BAD_REQUESTS = [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ({"prompt": [5] * 5000, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS)
def test_bad_input_is_refused_with_openai_error(base_url, body, status, param):
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_context_limit_error_names_the_limits(base_url):
    limit = httpx.get(f"{base_url}/v1/models").json()["data"][0]["max_model_len"]
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": [5] * (limit - 2), "max_tokens": 10})
    assert r.status_code == 400
    assert f"{limit - 2} tokens" in r.json()["error"]["message"] and str(limit) in r.json()["error"]["message"]


def test_malformed_json_and_chat_errors(base_url):
    r = httpx.post(f"{base_url}/v1/completions", content=b'{"prompt": "x", max_tokens',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(f"{base_url}/v1/nowhere").status_code == 404


def test_bad_requests_do_not_disturb_a_running_stream(base_url):
    body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        for bad, status, _ in BAD_REQUESTS:
            assert httpx.post(f"{base_url}/v1/completions", json=bad, timeout=TIMEOUT).status_code == status
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert first and rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["usage"]["completion_tokens"] == 64


def test_disconnects_abort_and_free_kv_blocks(base_url):
    body = {"prompt": "Tell me a long story", "max_tokens": 1500, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body | {"stream": True}, timeout=TIMEOUT) as resp:
        lines = resp.iter_lines()  # keep a reference: a dropped iterator closes the stream
        next(line for line in lines if line.startswith("data: "))
        assert metrics(base_url)["qtool_kv_blocks_used"] > 0
    with pytest.raises(httpx.ReadTimeout):  # an unstreamed request whose client gives up
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(30.0, read=0.5))
    wait_until_idle(base_url)
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_api_key(tiny_model_dir):
    with running(make_app(tiny_model_dir, api_key="s3cret")) as url:
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"},
                        timeout=TIMEOUT)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key


def test_backpressure_503_with_retry_after(tiny_model_dir):
    with running(make_app(tiny_model_dir, max_num_seqs=1, max_waiting=1)) as url:
        long = {"prompt": "a", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with contextlib.ExitStack() as stack:
            for _ in range(2):  # one running, one waiting: the bound
                resp = stack.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=TIMEOUT))
                assert resp.status_code == 200
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=TIMEOUT)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "overloaded"
        wait_until_idle(url)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=TIMEOUT)
        assert r.status_code == 200


def test_engine_failure_fails_in_flight_requests_and_server_recovers(tiny_model_dir):
    app = make_app(tiny_model_dir)
    engine = app.state.qtool.engine
    real_step, calls = engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated kernel fault")
        return real_step()

    engine.step = flaky_step
    with running(app) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=TIMEOUT)
        assert r.status_code == 500 and "simulated kernel fault" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                       timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        wait_until_idle(url)


def test_engine_for_serving_loads_off_the_main_thread(tiny_model_dir, monkeypatch):
    """serve() loads the engine on a helper thread (the main thread's OpenMP pool would slow the engine thread)
    and hands back the engine, or re-raises the loader's error on the caller's thread."""
    import qtoolkit.server as server
    from qtoolkit.errors import QToolError

    seen = []
    real = server.build_engine

    def spy(model, config=None):
        seen.append(threading.current_thread() is threading.main_thread())
        return real(model, config)

    monkeypatch.setattr(server, "build_engine", spy)
    engine = server.build_engine_off_main_thread(str(tiny_model_dir), EngineConfig(kv_cache_memory="4MiB"))
    assert seen == [False] and engine.model_name
    with pytest.raises(QToolError):
        server.build_engine_off_main_thread(str(tiny_model_dir / "missing"))
