"""Paired means paired: candidate and baseline get the same generation settings through every backend, and an
OpenAI endpoint gets every code stop string (and the text ends at the first of them whatever the server does)."""

from __future__ import annotations

import json

import httpx
import pytest
from qtoolkit.evals.backends.base import GeneratedText, GenParams
from qtoolkit.evals.code import STOP, CodeTask
from qtoolkit.evals.data import humaneval_problems

RAW = "    return True\n# a comment the fifth stop string cuts\nprint(1)\n"


def _endpoint(monkeypatch, max_stops: int | None) -> list[dict]:
    """A fake OpenAI server (httpx transport) that ignores stop strings, optionally refusing more than N."""
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        bodies.append(body)
        if max_stops is not None and len(body.get("stop", [])) > max_stops:
            return httpx.Response(400, json={"error": "at most 4 stop sequences"})
        return httpx.Response(200, json={"choices": [{"text": RAW, "finish_reason": "length"}]})

    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    return bodies


@pytest.mark.parametrize("max_stops", [None, 4])
def test_openai_backend_sends_every_stop_and_cuts_client_side(monkeypatch, tiny_model_dir, max_stops):
    from qtoolkit.evals.backends.endpoint import OpenAIBackend

    bodies = _endpoint(monkeypatch, max_stops)
    b = OpenAIBackend("http://fake:1", model_spec=str(tiny_model_dir), retries=1)
    (g,) = b.generate(["def f():\n"], GenParams(64, 0.0, STOP, 0))
    assert bodies[0]["stop"] == STOP and len(STOP) == 6
    assert g.text == "    return True" and g.finish_reason == "stop"
    if max_stops:  # refused with 6: retried with the first 4, the other 2 applied here, same text
        assert bodies[-1]["stop"] == STOP[:4]


class Recording:
    """A backend that records the settings it is asked to generate with."""

    def __init__(self):
        self.params: list[GenParams] = []

    def generate(self, prompts: list[str], params: GenParams) -> list[GeneratedText]:
        self.params.append(params)
        return [GeneratedText("    return False\n", [1], "stop") for _ in prompts]


def test_code_task_gives_both_sides_identical_settings():
    task = CodeTask(max_tokens=32, samples=3, temperature=0.7, seed=5)
    cand, base = Recording(), Recording()
    problems = [dict(humaneval_problems()[0], id="0")]
    task._side(cand, problems)
    task._side(base, problems)
    assert cand.params == base.params and len(cand.params) == 4  # greedy + 3 samples, seeds included
    assert all(p.stop == STOP for p in cand.params)


def test_every_backend_ends_a_generation_at_the_same_stop(tiny_model_dir):
    """Engine, hf and an OpenAI endpoint (qtool serve) cut one greedy completion at the same place. The stop that
    matters is sixth in the list (where the endpoint's first-4 truncation used to drop it); the second list's
    stop begins with the prompt's last character, which only the completion may match (transformers' own
    stop_strings matched it across the prompt boundary and stopped the hf side early)."""
    from qtoolkit.evals.backends.endpoint import OpenAIBackend
    from qtoolkit.evals.backends.factory import make_backend
    from test_server import make_app, running

    prompt = humaneval_problems()[0]["prompt"]
    engine, hf = make_backend(str(tiny_model_dir), kind="engine"), make_backend(str(tiny_model_dir), kind="hf")
    (free,) = engine.generate([prompt], GenParams(24, 0.0, [], 0))
    assert len(free.text) > 12, free.text  # a random model's text, long enough to stop inside
    cases = [[*STOP[:5], free.text[8:11]], [*STOP[:5], prompt[-1] + free.text[:2]]]
    with running(make_app(tiny_model_dir)) as url:
        endpoint = OpenAIBackend(url, model_spec=str(tiny_model_dir), retries=1)
        for stops in cases:
            cut = free.text.find(stops[-1])
            expected = (free.text, "length") if cut < 0 else (free.text[:cut], "stop")
            got = {b.name: b.generate([prompt], GenParams(24, 0.0, stops, 0))[0] for b in (engine, hf, endpoint)}
            assert {n: (g.text, g.finish_reason) for n, g in got.items()} == dict.fromkeys(got, expected), stops
