"""Any OpenAI-compatible endpoint (qtool serve, vLLM) as an eval backend.

Generation uses /v1/completions with prompts built locally (chat template included), so the endpoint sees
the same text as the in-process backends. Scoring uses /v1/completions with `echo` and `logprobs=1`, which
gives the log-probability of every prompt token and the top-1 alternative; full distributions are not
exposed, so KL divergence cannot be computed through an endpoint and tasks say so.
"""

from __future__ import annotations

import time
from typing import Any

from . import backend
from .backend import BackendError, Generation, GenParams, Scored, ScoringUnsupported, load_tokenizer


class RequestRefused(BackendError):
    """The endpoint answered with a 4xx: retrying will not help."""


class OpenAIBackend:
    name = "openai"
    full_distributions = False

    def __init__(self, url: str, *, model_spec: str | None = None, tokenizer_spec: str | None = None,
                 retries: int = 3, timeout_s: float = 300.0, concurrency: int = 8, **_: Any):
        import httpx

        from qtoolkit.sources import resolve_model

        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.retries, self.concurrency = retries, concurrency
        self.client = httpx.Client(timeout=timeout_s)
        models = self._request("GET", "/models")
        data = models.get("data") or [{}]
        self.model_id = data[0].get("id", "default")
        tok_spec = tokenizer_spec or model_spec
        if tok_spec is None:
            raise BackendError(f"{url} needs a local tokenizer: pass --model (or --baseline) naming the same model")
        self.source = resolve_model(tok_spec)
        self.tokenizer = load_tokenizer(self.source.path)
        self._score_supported: bool | None = None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "endpoint": self.url, "model_id": self.model_id,
                "tokenizer": self.source.describe()}

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        import httpx

        last = ""
        for attempt in range(self.retries):
            try:
                r = self.client.request(method, self.url + path, json=payload)
                if r.status_code < 500:
                    if r.status_code >= 400:
                        raise RequestRefused(f"{self.url}{path} refused the request ({r.status_code}: "
                                           f"{r.text[:200]}): check the endpoint serves the model")
                    return r.json()
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(min(2.0 ** attempt * 0.5, 4.0))
        raise BackendError(f"endpoint {self.url} did not answer after {self.retries} tries ({last}): "
                           "start the server or fix --endpoint")

    def _complete(self, payload: dict) -> dict:
        return self._request("POST", "/completions", {"model": self.model_id, **payload})

    def generate(self, prompts: list[str], params: GenParams) -> list[Generation]:
        from concurrent.futures import ThreadPoolExecutor

        def one(prompt: str) -> Generation:
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
            text, cut = backend.truncate_at_stop(choice.get("text", ""), params.stop)
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            return Generation(text, ids, "stop" if cut else choice.get("finish_reason") or "length")

        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(one, prompts))

    def score(self, token_ids: list[list[int]]) -> list[Scored]:
        import torch

        out = []
        for ids in token_ids:
            try:
                resp = self._complete({"prompt": ids, "max_tokens": 1, "temperature": 0.0, "echo": True,
                                       "logprobs": 1})
            except RequestRefused as e:
                raise ScoringUnsupported(f"{self.url} cannot score prompts (echo + logprobs refused: {e})") from None
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
        import torch

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
