"""The engine-mode switch over HTTP: absent without a control token, refused with a wrong one (before the body is
read), refused while requests run, and a switch really changes how the server batches and whether it speculates."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from test_server import TIMEOUT, metrics, running, wait_until_idle

from qtoolkit.engine import Engine, EngineConfig
from qtoolkit.errors import QToolError
from qtoolkit.server import create_app
from qtoolkit.server.control import control_token_from_env
from qtoolkit.server.process import CONTROL_HEADER, CONTROL_TOKEN_ENV, MODE_PATH

TOKEN = "t0k3n-" + "x" * 26
AUTH = {CONTROL_HEADER: TOKEN}


@pytest.fixture(scope="module")
def controlled_url(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB", max_num_seqs=8, speculative="ngram"))
    with running(create_app(engine, control_token=TOKEN)) as url:
        yield url


@pytest.fixture(scope="module")
def plain_url(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB", max_num_seqs=8))
    with running(create_app(engine, api_key="k")) as url:
        yield url


def one_line_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert "\n" not in r.text.strip()
    return r.json()["error"]


def test_no_token_no_switch(plain_url):
    for method in ("GET", "POST"):
        r = httpx.request(method, plain_url + MODE_PATH, json={"batching": "static"}, timeout=TIMEOUT,
                          headers={"Authorization": "Bearer k", CONTROL_HEADER: ""})
        one_line_error(r, 404)
    assert metrics(plain_url)["qtool_engine_static_batching"] == 0  # /metrics needs no key here


@pytest.mark.parametrize("headers", [{}, {CONTROL_HEADER: "wrong"}, {CONTROL_HEADER: TOKEN[:-1]},
                                     {"Authorization": f"Bearer {TOKEN}"}])
def test_wrong_or_missing_token_is_refused(controlled_url, headers):
    err = one_line_error(httpx.post(controlled_url + MODE_PATH, json={"batching": "static"}, headers=headers,
                                    timeout=TIMEOUT), 401)
    assert err["code"] == "invalid_control_token"
    assert httpx.get(controlled_url + MODE_PATH, headers=AUTH).json()["batching"] == "continuous"


def test_bad_switch_bodies_get_400(controlled_url):
    for body in (b"{", b"[]", json.dumps({"batching": "dynamic"}).encode(),
                 json.dumps({"speculative": "yes please"}).encode(), json.dumps({"surprise": 1}).encode()):
        one_line_error(httpx.post(controlled_url + MODE_PATH, content=body, headers=AUTH, timeout=TIMEOUT), 400)


def stream_order(url: str, long_tokens: int = 300) -> list[str]:
    """A long request, then (once it streams) a one-token one: the order in which they finish."""
    order: list[str] = []
    started = threading.Event()

    def long() -> None:
        body = {"prompt": "count", "max_tokens": long_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            for _ in r.iter_lines():
                started.set()
        order.append("long")

    t = threading.Thread(target=long)
    t.start()
    assert started.wait(60)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "temperature": 0},
                   timeout=TIMEOUT)
    assert r.status_code == 200
    order.append("short")
    t.join(60)
    return order


def test_switch_changes_batching_and_is_refused_while_busy(controlled_url):
    url = controlled_url
    assert stream_order(url) == ["short", "long"]  # continuous: the short one joins and ends first
    r = httpx.post(url + MODE_PATH, json={"batching": "static"}, headers=AUTH, timeout=TIMEOUT)
    assert r.json() == {"batching": "static", "speculating": True, "proposer": "ngram"}
    assert wait_until_idle(url)["qtool_engine_static_batching"] == 1
    assert stream_order(url) == ["long", "short"]  # static: the short one waits for the long one's batch

    busy: dict = {}

    def switch_while_busy() -> None:
        busy["r"] = httpx.post(url + MODE_PATH, json={"batching": "continuous"}, headers=AUTH, timeout=TIMEOUT)

    body = {"prompt": "count", "max_tokens": 300, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as stream:
        lines = stream.iter_lines()
        next(lines)
        switch_while_busy()
        for _ in lines:
            pass
    assert one_line_error(busy["r"], 409)["code"] == "engine_busy"
    wait_until_idle(url)
    assert httpx.post(url + MODE_PATH, json={"batching": "continuous"}, headers=AUTH).json()["batching"] == \
        "continuous"
    assert metrics(url)["qtool_engine_static_batching"] == 0


def test_switch_turns_the_loaded_proposer_off_and_on(controlled_url):
    url = controlled_url
    body = {"prompt": "a b c a b c a b c a b c", "max_tokens": 8, "temperature": 0}

    def usage() -> dict:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()["usage"]

    assert "speculative" in usage()
    assert httpx.post(url + MODE_PATH, json={"speculative": False}, headers=AUTH).json()["speculating"] is False
    assert "speculative" not in usage()  # answers as a plain server
    assert "qtool_spec_draft_tokens_total" not in metrics(url)
    assert httpx.post(url + MODE_PATH, json={"speculative": True}, headers=AUTH).json()["speculating"] is True
    assert "speculative" in usage()


def test_control_token_comes_from_the_environment_once(monkeypatch):
    monkeypatch.setenv(CONTROL_TOKEN_ENV, "short")
    with pytest.raises(QToolError, match="at least 16"):
        control_token_from_env()
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    assert control_token_from_env() == TOKEN
    assert control_token_from_env() is None  # taken out: a child process does not inherit it
