"""An endpoint that drops connections: requests safe to repeat (greedy, seeded, reads) are retried with bounded
backoff and give the same answers; what cannot be answered is one ERROR (exit 2) naming the endpoint and the
request, never a FAIL and never a hang. The faults come from tests/fault_proxy.py on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fault_proxy import FaultProxy
from qtoolkit.evals.backends.endpoint import describe_request, repeatable

from qtoolkit.bench.deployment import _measure
from qtoolkit.bench.workloads import build_workload
from qtoolkit.cli import main
from qtoolkit.endpoints.deployment import Deployment, EndpointError, EndpointInfo, request
from qtoolkit.server.process import free_port, server_process


class _Upstream(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.received.append(body)
        out = json.dumps({"choices": [{"text": "x" * 200, "finish_reason": "length"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def upstream():
    _Upstream.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


GREEDY = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0.0}
SAMPLED = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0.8}


def post(proxy: FaultProxy, body: dict, retries: int = 4) -> httpx.Response:
    with httpx.Client(timeout=10) as client:
        return request(client, "POST", f"{proxy.url}/v1/completions", json=body, retries=retries,
                       what="the candidate endpoint", fix="start the server or fix the endpoint URL",
                       repeatable=repeatable(body), describe=describe_request(body))


def test_a_greedy_request_survives_resets_and_cuts(upstream):
    proxy = FaultProxy(upstream, lambda i: ["reset", "cut", "pass"][min(i, 2)])
    r = post(proxy, GREEDY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x" * 200
    assert proxy.actions == ["reset", "cut", "pass"] and len(_Upstream.received) == 2
    assert repeatable(SAMPLED | {"seed": 3}) and repeatable(None) and not repeatable({"prompt": "p"})


def test_a_sampled_request_the_server_may_have_answered_is_not_sent_again(upstream):
    proxy = FaultProxy(upstream, lambda i: "cut")
    with pytest.raises(EndpointError) as e:
        post(proxy, SAMPLED)
    assert len(_Upstream.received) == 1 and proxy.actions == ["cut"]
    msg = str(e.value)
    assert f"the candidate endpoint {proxy.url}/v1/completions did not answer after 1 try" in msg
    assert "prompt 'def add(a, b):'" in msg and "temperature 0.8" in msg and "not sent again" in msg


def test_a_sampled_request_refused_before_it_reached_the_server_is_retried():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused, so the request never went out
    t = time.monotonic()
    with pytest.raises(EndpointError, match=r"did not answer after 3 tries \(ConnectError"), \
            httpx.Client(timeout=10) as client:
        request(client, "POST", f"{url}/v1/completions", json=SAMPLED, retries=3, what="the candidate endpoint",
                fix="start the server", repeatable=repeatable(SAMPLED), describe=describe_request(SAMPLED))
    assert time.monotonic() - t < 5  # 0.5 s + 1 s of backoff


def test_an_endpoint_that_keeps_dropping_is_an_error_after_bounded_tries(upstream):
    proxy = FaultProxy(upstream, lambda i: "reset")
    t = time.monotonic()
    with pytest.raises(EndpointError) as e:
        post(proxy, GREEDY | {"seed": 7}, retries=3)
    assert time.monotonic() - t < 5 and proxy.count == 3 and not _Upstream.received
    assert "after 3 tries" in str(e.value) and "seed 7" in str(e.value) and str(e.value).count("\n") == 0


def test_benchmark_requests_an_endpoint_drops_are_an_error_not_a_throughput(upstream):
    """The endpoint sign-off's bench: a tier with failed requests would rate the failures; it is an ERROR."""
    proxy = FaultProxy(upstream, lambda i: "reset")
    info = EndpointInfo("candidate", proxy.url, "m", ["m"])
    reqs = build_workload("mixed", 2, seed=0, mean_output_tokens=8, max_output_tokens=16)
    with pytest.raises(EndpointError, match=f"the candidate endpoint {proxy.url} failed 2 of 2 benchmark requests"):
        _measure(Deployment("candidate", proxy.url), info, reqs, 2, 0, True)


@pytest.mark.slow  # a `qtool serve` subprocess and three evals through it
def test_eval_through_an_endpoint_that_drops_requests(tiny_model_dir, tmp_path, capsys):
    """`qtool eval --base-url`: resets and cut answers on a third of the requests give the same figures as a clean
    endpoint; an endpoint that drops everything after the probe is one ERROR line naming it and the request."""
    def evaluate(url: str, out: str) -> int:
        return main(["eval", "--model", str(tiny_model_dir), "--baseline", str(tiny_model_dir), "--base-url", url,
                     "--task", "perplexity", "--limit", "2", "--output", str(tmp_path / out)])

    def summary(out: str) -> dict:
        return json.loads((tmp_path / out).read_text())["tasks"]["perplexity"]["summary"]

    with server_process(str(tiny_model_dir)) as url:
        port = int(url.rsplit(":", 1)[1])
        assert evaluate(url, "direct.json") == 0
        flaky = FaultProxy(port, lambda i: ["pass", "reset", "cut"][i % 3])
        assert evaluate(flaky.url, "flaky.json") == 0
        assert {"reset", "cut"} <= set(flaky.actions) and summary("flaky.json") == summary("direct.json")
        capsys.readouterr()
        dead = FaultProxy(port, lambda i: "pass" if i == 0 else "reset")  # the probe passes, then nothing does
        t = time.monotonic()
        code = evaluate(dead.url, "dead.json")
        took = time.monotonic() - t
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("qtool: error")]
    assert code == 2 and len(errors) == 1 and took < 120, (code, errors, took)
    assert f"the candidate endpoint {dead.url}/v1/completions did not answer after 4 tries" in errors[0]
    assert "the request: POST a prompt of" in errors[0]
