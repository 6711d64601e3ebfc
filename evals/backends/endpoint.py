"""Any OpenAI-compatible endpoint (qtool serve, vLLM) as an eval backend.

Generation uses /v1/completions with prompts built locally (chat template included), so the endpoint sees
the same text as the in-process backends. Scoring uses /v1/completions with `echo` and `logprobs=1`, which
gives the log-probability of every prompt token and the top-1 alternative; full distributions are not
exposed, so KL divergence cannot be computed through an endpoint and tasks say so.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any

import httpx
import torch

from qtoolkit.endpoints.deployment import endpoint, probe, request
from qtoolkit.errors import BackendError
from qtoolkit.model.sources import resolve_model

from .base import GeneratedText, GenParams, Scored, ScoringUnsupported, load_tokenizer, truncate_at_stop


class RequestRefused(BackendError):
    """The endpoint answered with a 4xx: retrying will not help."""

    def __init__(self, message: str, response: Any = None):
        super().__init__(message)
        self.status = getattr(response, "status_code", None)
        try:  # the server's own one-line reason, for reports
            self.reason = str(response.json()["error"]["message"])[:160]
        except (AttributeError, KeyError, TypeError, ValueError):
            self.reason = getattr(response, "text", "")[:160]


def repeatable(payload: dict | None) -> bool:
    """Sent twice, the server answers the same: a read, a greedy request, or a seeded one (OpenAI's default
    temperature is 1)."""
    return payload is None or payload.get("temperature", 1.0) == 0 or payload.get("seed") is not None


def describe_request(payload: dict | None) -> str | None:
    """Which request failed, in a few words: its prompt's start and size, and how it samples."""
    if payload is None:
        return None
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        what = f"prompt {prompt[:40]!r}{'...' if len(prompt) > 40 else ''} ({len(prompt)} chars)"
    elif isinstance(prompt, list):
        what = f"a prompt of {len(prompt)} token ids"
    else:
        what = "a request"
    knobs = ", ".join(f"{k} {payload[k]}" for k in ("max_tokens", "temperature", "seed", "echo") if k in payload)
    return f"{what}{f' [{knobs}]' if knobs else ''}"


class OpenAIBackend:
    name = "openai"
    full_distributions = False

    def __init__(self, url: str, *, model_spec: str | None = None, tokenizer_spec: str | None = None,
                 retries: int = 4, timeout_s: float = 300.0, concurrency: int = 8, role: str = "candidate",
                 model_id: str | None = None, **_: Any):
        # the key comes from the role's environment variable (see qtoolkit.endpoints.deployment), never from arguments
        self.deployment = replace(endpoint(role, url, model_id=model_id, timeout_s=timeout_s), retries=retries)
        self.url = self.deployment.url + "/v1"
        self.retries, self.concurrency = retries, concurrency
        self.client = httpx.Client(timeout=timeout_s, headers=self.deployment.headers())
        self.info = probe(self.deployment)  # one clear error if unreachable, keyless or serving another model
        self.model_id = self.info.model_id
        tok_spec = tokenizer_spec or model_spec
        if tok_spec is None:
            raise BackendError(f"{url} needs a local tokenizer: pass --model (or --baseline) naming the same model")
        self.source = resolve_model(tok_spec)
        self.tokenizer = load_tokenizer(self.source.path)
        self._score_supported: bool | None = None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "endpoint": self.url, "model_id": self.model_id,
                "tokenizer": self.source.describe(), "deployment": asdict(self.info)}

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        r = request(self.client, method, self.url + path, json=payload, retries=self.retries,
                    what=f"the {self.deployment.role} endpoint", fix="start the server or fix the endpoint URL",
                    repeatable=repeatable(payload), describe=describe_request(payload))
        if r.status_code >= 400:
            raise RequestRefused(f"{self.url}{path} refused the request ({r.status_code}: "
                                 f"{r.text[:200]}): check the endpoint serves the model", r)
        return r.json()

    def _complete(self, payload: dict) -> dict:
        return self._request("POST", "/completions", {"model": self.model_id, **payload})

    def generate(self, prompts: list[str], params: GenParams) -> list[GeneratedText]:
        def one(prompt: str) -> GeneratedText:
            body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature}
            if params.stop:
                body["stop"] = list(params.stop)  # every stop string, as the in-process backends get them
            if params.seed is not None:
                body["seed"] = params.seed
            try:
                choice = self._complete(body)["choices"][0]
            except RequestRefused:
                if len(params.stop) <= 4:
                    raise
                body["stop"] = params.stop[:4]  # OpenAI's own API takes at most 4; the rest apply below
                choice = self._complete(body)["choices"][0]
            # stops also apply here, so the text ends where the other backends' text ends whatever the server did
            text, cut = truncate_at_stop(choice.get("text", ""), params.stop)
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            return GeneratedText(text, ids, "stop" if cut else choice.get("finish_reason") or "length")

        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(one, prompts))

    def score(self, token_ids: list[list[int]]) -> list[Scored]:
        out = []
        for ids in token_ids:
            try:
                resp = self._complete({"prompt": ids, "max_tokens": 1, "temperature": 0.0, "echo": True,
                                       "logprobs": 1})
            except RequestRefused as e:
                raise ScoringUnsupported(f"{self.url} does not score prompts (echo + logprobs refused with HTTP "
                                         f"{e.status}: {e.reason})") from None
            lp = (resp["choices"][0].get("logprobs") or {})
            token_lp = lp.get("token_logprobs") or []
            if len(token_lp) < len(ids):
                raise ScoringUnsupported(f"{self.url} does not return prompt logprobs (echo + logprobs)")
            target = torch.tensor([float(x) for x in token_lp[1:len(ids)]])
            top1 = self._top1_ids(lp, ids)
            out.append(Scored(target=target, top1=top1))
        return out

    def _top1_ids(self, lp: dict, ids: list[int]):
        """Top-1 token id per position from `top_logprobs` (keys are token text, not ids); None if absent."""
        top, shown = lp.get("top_logprobs") or [], lp.get("tokens") or []
        if len(top) < len(ids) or not all(top[1:len(ids)]):
            return None
        best = []
        for i in range(1, len(ids)):
            text = max(top[i].items(), key=lambda kv: kv[1])[0]
            if i < len(shown) and text == shown[i]:
                best.append(ids[i])  # the top-1 is the actual token
                continue
            enc = self.tokenizer(text, add_special_tokens=False).input_ids
            best.append(enc[0] if len(enc) == 1 else -1)  # -1: a token we cannot map never matches
        return torch.tensor(best)
