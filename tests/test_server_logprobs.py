"""/v1/completions `echo` and `logprobs` (OpenAI's legacy shape, as vLLM gives it), checked against transformers'
own log-softmax on the same tiny model, and refused where they cannot be honoured."""

from __future__ import annotations

import httpx
import pytest
import torch
from test_server import TIMEOUT, make_app, running
from transformers import AutoModelForCausalLM

IDS = [1, 17, 250, 3, 99, 42, 7, 512, 64]


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    with running(make_app(tiny_model_dir)) as u:
        yield u


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Row i: log p(. | tokens[:i+1]) from transformers in fp32."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32, use_safetensors=True)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"temperature": 0, **body}, timeout=TIMEOUT)


def test_echo_logprobs_equal_transformers(url, reference):
    r = complete(url, prompt=IDS, max_tokens=3, echo=True, logprobs=2)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    plain = complete(url, prompt=IDS, max_tokens=3).json()["choices"][0]["text"]
    n = len(lp["tokens"])
    assert n > len(IDS) and len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token has no context
    assert choice["text"] == "".join(lp["tokens"]) and choice["text"].endswith(plain)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    ref = reference(IDS)
    want = ref[torch.arange(len(IDS) - 1), torch.tensor(IDS[1:])]
    got = torch.tensor(lp["token_logprobs"][1:len(IDS)])
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    for i, top in enumerate(lp["top_logprobs"][1:len(IDS)]):
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(float(ref[i].max()), abs=1e-4)
        assert top[lp["tokens"][i + 1]] == pytest.approx(lp["token_logprobs"][i + 1])  # the chosen token is listed
    # greedy: each generated token is the argmax, so its logprob is the row's best
    gen = lp["token_logprobs"][len(IDS):]
    assert all(v == pytest.approx(max(t.values())) for v, t in zip(gen, lp["top_logprobs"][len(IDS):], strict=True))


def test_logprobs_without_echo_cover_the_completion_only(url):
    body = complete(url, prompt="def add(a, b):", max_tokens=4, logprobs=0).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == body["usage"]["completion_tokens"]
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"])
    assert all(len(t) == 1 for t in lp["top_logprobs"])  # logprobs=0: the chosen token only
    echo = complete(url, prompt="def add(a, b):", max_tokens=4, echo=True).json()["choices"][0]
    assert echo["text"] == "def add(a, b):" + choice["text"] and echo["logprobs"] is None


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": 1, "stream": True}, "logprobs"),
    ({"prompt": "x", "echo": True, "stream": True}, "echo"),
])
def test_unanswerable_logprobs_are_refused(url, body, param):
    r = complete(url, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_logprobs_are_refused_with_the_way_out(url):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "logprobs": True}, timeout=TIMEOUT)
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]
