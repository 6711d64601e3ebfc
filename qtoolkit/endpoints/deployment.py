"""A deployment: what eval, bench and sign-off measure — an OpenAI-compatible endpoint (vLLM, SGLang, TGI,
`qtool serve`) that someone else runs, or a local checkpoint that qtoolkit serves itself.

Keys come from environment variables only (a command line shows in `ps` and in shell history, a report is
mailed around): the role's own variable first, then the shared ones. Only the variable's *name* is ever recorded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..errors import BackendError

ROLE_KEY_ENV = {"candidate": "QTOOLKIT_CANDIDATE_API_KEY", "baseline": "QTOOLKIT_BASELINE_API_KEY"}
SHARED_KEY_ENV = ("QTOOLKIT_API_KEY", "OPENAI_API_KEY")
RETRY_STATUS = (429, 503)  # the server asks us to come back later
MAX_RETRY_AFTER_S = 30.0  # a longer Retry-After is a server that is down, not busy
MAX_BACKOFF_S = 8.0


class EndpointError(BackendError):  # a QToolError: exit 2
    """An endpoint is unreachable, refuses our key, or serves a different model than named."""


@dataclass(frozen=True)
class Deployment:
    role: str  # "candidate" | "baseline"
    url: str | None = None  # server root of an endpoint; None: a local checkpoint served by qtoolkit
    local: str | None = None  # local model source: the weights (local) or the tokenizer and memory figures
    model_id: str | None = None  # the id the endpoint must serve (checked against /v1/models)
    timeout_s: float = 300.0
    retries: int = 4

    @property
    def is_endpoint(self) -> bool:
        return self.url is not None

    def api_key_env(self) -> str | None:
        """Name of the environment variable that holds this deployment's key, if any is set."""
        for name in (ROLE_KEY_ENV.get(self.role), *SHARED_KEY_ENV):
            if name and os.environ.get(name):
                return name
        return None

    def api_key(self) -> str | None:
        name = self.api_key_env()
        return os.environ[name] if name else None

    def headers(self) -> dict[str, str]:
        key = self.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}


def server_root(url: str) -> str:
    """Accept `http://host:port`, `.../v1` or `.../v1/`; return the server root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def endpoint(role: str, url: str, *, local: str | None = None, model_id: str | None = None,
             timeout_s: float = 300.0) -> Deployment:
    if not url.startswith(("http://", "https://")):
        raise EndpointError(f"the {role} endpoint {url!r} is not an http(s) URL: pass e.g. http://host:8000/v1")
    return Deployment(role, server_root(url), local=local, model_id=model_id, timeout_s=timeout_s)


def backoff_s(attempt: int, retry_after: str | None) -> float:
    """Seconds to wait before retry `attempt` + 1: the server's Retry-After (capped), else exponential."""
    if after := retry_after:
        try:
            return min(max(float(after), 0.0), MAX_RETRY_AFTER_S)
        except ValueError:
            pass  # an HTTP date: fall back to our own schedule
    return min(0.5 * 2.0 ** attempt, MAX_BACKOFF_S)


def request(client: httpx.Client, method: str, url: str, *, retries: int, what: str, fix: str,
            json: Any = None, repeatable: bool = True, describe: str | None = None) -> httpx.Response:
    """One request with bounded retries; returns the first answer that is neither a 5xx nor a 429.

    A request that never reached the server (connection refused) or that it asked us to send again (429, 503) is
    retried whatever it is. A 5xx or a connection that dropped after the request went out is retried only when
    the request is `repeatable` (a read, a greedy or seeded generation): sent again, a sampled one would draw
    another answer, which must not stand in for the first. What is left is an EndpointError (exit 2) naming the
    endpoint and the request (`describe`), never a wrong answer."""
    last, tries = "", 0
    for attempt in range(retries):
        tries = attempt + 1
        response = None
        try:
            response = client.request(method, url, json=json)
            if response.status_code < 500 and response.status_code not in RETRY_STATUS:
                return response
            last = f"HTTP {response.status_code}"
            again = repeatable or response.status_code in RETRY_STATUS
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            again = repeatable or isinstance(e, httpx.ConnectError)
        if not again:
            last += "; not sent again: the request samples without a seed, so a retry would draw another answer"
            break
        if attempt + 1 < retries:
            time.sleep(backoff_s(attempt, response.headers.get("retry-after") if response else None))
    asked = f"; the request: {method} {describe}" if describe else ""
    raise EndpointError(f"{what} {url} did not answer after {tries} tr{'y' if tries == 1 else 'ies'} ({last}){asked}: "
                        f"{fix}")


@dataclass
class EndpointInfo:
    """What an endpoint says about itself; recorded in reports next to every figure measured through it."""

    role: str
    url: str
    model_id: str  # the model measured
    model_ids: list[str]  # everything /v1/models lists
    models: list[dict[str, Any]] = field(default_factory=list)  # /v1/models entries (owned_by, root, max_model_len)
    server: str | None = None  # the `server` response header (uvicorn, ...)
    version: dict[str, Any] | None = None  # /version where exposed (vLLM)
    api_key_env: str | None = None  # the variable's name, never its value
    # endpoints/identity.py: the key reuse is keyed by (model id + a fingerprint of its answers), the fingerprint,
    # and what changed since the last run in the same output folder (a redeploy at the same URL)
    identity: str | None = None
    fingerprint: dict[str, Any] | None = None
    changed: str | None = None


def probe(dep: Deployment) -> EndpointInfo:
    """List the endpoint's models, check the named one is served, and read what version information it exposes."""
    assert dep.url is not None
    flag = f"--{dep.role}-endpoint"
    with httpx.Client(headers=dep.headers(), timeout=min(dep.timeout_s, 30.0)) as client:
        r = request(client, "GET", f"{dep.url}/v1/models", retries=dep.retries, what=f"the {dep.role} endpoint",
                    fix=f"start the server or fix {flag}")
        if r.status_code in (401, 403):
            names = " or ".join((ROLE_KEY_ENV[dep.role], *SHARED_KEY_ENV))
            raise EndpointError(f"the {dep.role} endpoint {dep.url} refused the API key (HTTP {r.status_code}): "
                                f"set {names} in the environment to the server's key")
        try:
            r.raise_for_status()
            entries = [m for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
        except (httpx.HTTPError, ValueError, AttributeError):
            raise EndpointError(f"the {dep.role} endpoint {dep.url}/v1/models answered HTTP {r.status_code} "
                                f"without a model list: is {flag} an OpenAI-compatible server?") from None
        ids = [str(m["id"]) for m in entries]
        model_id = _pick(dep, ids)
        version = None
        try:  # vLLM exposes /version; others answer 404, which just means "nothing to record"
            v = client.get(f"{dep.url}/version")
            if v.status_code == 200 and isinstance(v.json(), dict):
                version = v.json()
        except (httpx.HTTPError, ValueError):
            pass
    keep = ("id", "owned_by", "root", "max_model_len", "created")
    return EndpointInfo(dep.role, dep.url, model_id, ids, [{k: m[k] for k in keep if k in m} for m in entries],
                        server=r.headers.get("server"), version=version, api_key_env=dep.api_key_env())


def _pick(dep: Deployment, ids: list[str]) -> str:
    if not ids:
        raise EndpointError(f"the {dep.role} endpoint {dep.url} serves no model (/v1/models is empty)")
    if dep.model_id is not None:
        if dep.model_id not in ids:
            raise EndpointError(f"the {dep.role} endpoint {dep.url} serves {ids}, not {dep.model_id!r}: fix "
                                f"--{dep.role}-model-id or point --{dep.role}-endpoint at the right server")
        return dep.model_id
    if len(ids) > 1:
        raise EndpointError(f"the {dep.role} endpoint {dep.url} serves several models {ids}: name one with "
                            f"--{dep.role}-model-id")
    return ids[0]
