"""Hostile input through HTTP: the key and the body size are checked before the body is read, and every field
that costs engine time is bounded with a 400 naming it."""

from __future__ import annotations

import socket

import httpx
import pytest
from test_server import TIMEOUT, make_app, running

from qtoolkit.server.metrics import samples

KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def keyed_url(tiny_model_dir):
    with running(make_app(tiny_model_dir, api_key="s3cret", max_num_seqs=4, max_waiting=4,
                          max_body_bytes=1 << 20, metrics_need_key=True)) as url:
        yield url


def raw_post(url: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """POST the headers and only `body` (maybe far less than Content-Length says); return status and reply."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode() + body)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    return int(reply.split(b" ", 2)[1]), reply


def test_no_key_is_refused_before_the_body_arrives(keyed_url):
    # 64 MiB announced, 10 bytes sent: the answer can only come from the headers
    status, reply = raw_post(keyed_url, {"Content-Type": "application/json", "Content-Length": str(64 << 20)},
                             b'{"prompt":')
    assert status == 401 and b"invalid_api_key" in reply


def test_oversized_body_is_refused_before_it_is_read(keyed_url):
    status, reply = raw_post(keyed_url, {"Content-Type": "application/json", "Content-Length": str(64 << 20),
                                         **KEY}, b'{"prompt":')
    assert status == 413 and b"max-body-bytes" in reply


def test_chunked_body_past_the_limit_gets_413(keyed_url):
    def chunks():  # no Content-Length: the limit is enforced while the body streams in
        for _ in range(4):
            yield b"x" * (1 << 20)

    try:
        r = httpx.post(f"{keyed_url}/v1/completions", content=chunks(), headers=KEY, timeout=TIMEOUT)
    except httpx.HTTPError:
        return  # the server closed the socket while the client still wrote: it stopped reading
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_64_mib_unauthenticated_body_gets_401(keyed_url):
    big = b'{"prompt": "' + b"x" * (64 << 20) + b'"}'
    r = httpx.post(f"{keyed_url}/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=TIMEOUT)
    assert r.status_code == 401


def test_malformed_json_without_key_is_401_with_key_400(keyed_url):
    bad = b'{"prompt": "x", max_tokens'
    r = httpx.post(f"{keyed_url}/v1/completions", content=bad, headers={"content-type": "application/json"})
    assert r.status_code == 401
    r = httpx.post(f"{keyed_url}/v1/completions", content=bad, headers={"content-type": "application/json", **KEY})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_metrics_can_require_the_key(keyed_url):
    assert httpx.get(f"{keyed_url}/metrics").status_code == 401
    assert httpx.get(f"{keyed_url}/metrics", headers=KEY).status_code == 200
    assert httpx.get(f"{keyed_url}/health").status_code == 200


BOUNDED = [
    ({"stop": [f"s{i}" for i in range(100_000)]}, "stop"),
    ({"stop": [f"s{i}" for i in range(33)]}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"top_k": 2**70}, "top_k"),
    ({"prompt": ["a"] * 257}, "prompt"),
    ({"n": 17}, "n"),
]


@pytest.mark.parametrize(("extra", "param"), BOUNDED)
def test_unbounded_fields_get_400_naming_the_field(keyed_url, extra, param):
    r = httpx.post(f"{keyed_url}/v1/completions", json={"prompt": "x", "max_tokens": 2} | extra, headers=KEY,
                   timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_chat_message_count_is_bounded(keyed_url):
    r = httpx.post(f"{keyed_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}] * 1025},
                   headers=KEY, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_fields_at_their_bounds_are_served(keyed_url):
    body = {"prompt": "x", "max_tokens": 2, "ignore_eos": True, "stop": [f"stop{i}" for i in range(32)],
            "seed": 2**63 - 1, "n": 2, "temperature": 1.0}
    r = httpx.post(f"{keyed_url}/v1/completions", json=body, headers=KEY, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 2 and r.json()["usage"]["completion_tokens"] == 4


def test_impossible_fan_out_is_a_non_retryable_400(keyed_url):
    # the server admits 4 + 4 sequences at once: 3 prompts x n=3 can never run, whatever the load
    r = httpx.post(f"{keyed_url}/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3}, headers=KEY,
                   timeout=TIMEOUT)
    assert r.status_code == 400 and "retry-after" not in r.headers
    assert r.json()["error"]["code"] == "too_many_sequences" and r.json()["error"]["param"] == "n"
    r = httpx.post(f"{keyed_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                             "n": 9}, headers=KEY, timeout=TIMEOUT)
    assert r.status_code == 400
    r = httpx.post(f"{keyed_url}/v1/completions", json={"prompt": ["a", "b"], "n": 4, "max_tokens": 1},
                   headers=KEY, timeout=TIMEOUT)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8  # exactly the bound still runs


def test_server_answers_normally_after_the_abuse(keyed_url):
    r = httpx.post(f"{keyed_url}/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True},
                   headers=KEY, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    scraped = samples(httpx.get(f"{keyed_url}/metrics", headers=KEY).text)
    assert scraped[("qtool_requests_rejected_total", (("status", "401"),))] > 0
    assert scraped[("qtool_requests_rejected_total", (("status", "413"),))] > 0
