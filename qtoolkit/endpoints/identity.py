"""An endpoint's identity: the model id it lists on /v1/models plus a fingerprint of its answers, so that a
redeploy at the same URL (another checkpoint under the same name, another dtype) is seen before anything measured
on the old deployment is reused.

The fingerprint is one greedy request on a fixed prompt with `echo` and `logprobs`: the log-probability of every
prompt token (teacher-forced, so it does not depend on where a greedy path would branch) and a short greedy
continuation. Two fingerprints are the same deployment when the tokens and the continuation are equal and no
log-probability moved by more than TOLERANCE_NATS; reuse is keyed by the *recorded* fingerprint while it still
matches, so run-to-run noise below the tolerance never forces a recomputation, and a change above it always does.
An endpoint that refuses echo or logprobs is fingerprinted by its greedy text alone, and says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..io import write_json
from ..provenance import text_sha256
from .deployment import Deployment, EndpointError, request

PROBE_PROMPT = ("Water boils at 100 degrees Celsius at sea level. The capital of France is Paris, and the capital "
                "of Japan is Tokyo. def add(a, b):\n    return a + b\nThe three primary colours are")
PROBE_TOKENS = 8
# Larger than the run-to-run noise of one deployment (fp32 and bf16 servers repeat a greedy probe to within
# 1e-3 nats, measurements/2026-12-04/issue41/identity-noise.json) and smaller than what a different checkpoint of
# the same model moves (fp8-dynamic vs fp32 of the default model: up to ~0.1 nats over the probe's tokens).
TOLERANCE_NATS = 0.01
RECORD = "endpoints.json"


@dataclass(frozen=True)
class Fingerprint:
    method: str  # "echo+logprobs" (prompt log-probs and greedy text) | "greedy-text" (the endpoint refused logprobs)
    text: str  # the greedy continuation
    tokens: list[str] = field(default_factory=list)  # the prompt's tokens as the endpoint split them
    logprobs: list[float | None] = field(default_factory=list)  # per prompt token, rounded to 1e-4

    def change_from(self, old: Fingerprint) -> str | None:
        """What differs from `old`, in a few words; None when both are the same deployment."""
        if self.method != old.method:
            return f"it now answers the probe by {self.method}, before by {old.method}"
        if self.tokens != old.tokens:
            return "it splits the probe prompt into other tokens (another tokenizer)"
        moved = [abs(a - b) for a, b in zip(self.logprobs, old.logprobs, strict=True)
                 if a is not None and b is not None]
        if moved and max(moved) > TOLERANCE_NATS:
            return f"its log-probs on the probe moved by up to {max(moved):.3f} nats (tolerance {TOLERANCE_NATS})"
        if self.text != old.text:
            return f"its greedy answer to the probe changed from {old.text!r} to {self.text!r}"
        return None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Fingerprint:
        return cls(str(d["method"]), str(d["text"]), [str(t) for t in d.get("tokens", [])],
                   [None if x is None else float(x) for x in d.get("logprobs", [])])


@dataclass(frozen=True)
class EndpointIdentity:
    url: str
    model_id: str
    fingerprint: Fingerprint

    def key(self) -> str:
        """What reuse is keyed by: the same key is the same deployment."""
        return text_sha256(json.dumps(asdict(self), sort_keys=True))

    def change_from(self, old: EndpointIdentity) -> str | None:
        if self.model_id != old.model_id:
            return f"it now serves {self.model_id!r}, before {old.model_id!r}"
        return self.fingerprint.change_from(old.fingerprint)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EndpointIdentity:
        return cls(str(d["url"]), str(d["model_id"]), Fingerprint.from_json(d["fingerprint"]))


def fingerprint(dep: Deployment, model_id: str) -> Fingerprint:
    """Ask the endpoint the probe: echo + logprobs where it gives them, else greedy text alone."""
    assert dep.url is not None
    body = {"model": model_id, "prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS, "temperature": 0.0}
    # the endpoint's own timeout: the probe may be a cold server's first generation (kernels built on first use)
    with httpx.Client(headers=dep.headers(), timeout=dep.timeout_s) as client:
        def ask(extra: dict[str, Any]) -> httpx.Response:
            return request(client, "POST", f"{dep.url}/v1/completions", json={**body, **extra}, retries=dep.retries,
                           what=f"the {dep.role} endpoint", fix=f"start the server or fix --{dep.role}-endpoint",
                           describe="the identity probe (greedy, 8 tokens)")
        r = ask({"echo": True, "logprobs": 1})
        if r.status_code == 200 and (fp := _from_echo(r.json())) is not None:
            return fp
        r = ask({})
        try:
            r.raise_for_status()
            return Fingerprint("greedy-text", str(r.json()["choices"][0].get("text", "")))
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise EndpointError(f"the {dep.role} endpoint {dep.url} gave no greedy completion of the identity probe "
                                f"(HTTP {r.status_code}: {r.text[:160]}): check it serves {model_id!r} on "
                                "/v1/completions") from None


def _from_echo(answer: dict[str, Any]) -> Fingerprint | None:
    """The prompt's tokens and log-probs from an echoed answer; None when the answer does not carry them."""
    try:
        choice = answer["choices"][0]
        lp = choice["logprobs"]
        tokens, logprobs = list(lp["tokens"]), list(lp["token_logprobs"])
        text = str(choice["text"])
    except (KeyError, IndexError, TypeError):
        return None
    if not text.startswith(PROBE_PROMPT) or len(tokens) != len(logprobs) or not tokens:
        return None
    shown = 0  # the prompt's tokens are those whose text covers the prompt
    while shown < len(tokens) and len("".join(tokens[:shown])) < len(PROBE_PROMPT):
        shown += 1
    rounded = [None if x is None else round(float(x), 4) for x in logprobs[:shown]]
    return Fingerprint("echo+logprobs", text[len(PROBE_PROMPT):], [str(t) for t in tokens[:shown]], rounded)


def settle(folder: Path, role: str, current: EndpointIdentity) -> tuple[EndpointIdentity, str | None]:
    """The identity to key reuse by in `folder`, and the change since the last run there (None if none).

    While `current` matches the identity recorded in folder/endpoints.json, the recorded one is kept (so noise
    below the tolerance changes no key); otherwise `current` replaces it and the change is named."""
    path = folder / RECORD
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        recorded = {}
    old = None
    try:
        old = EndpointIdentity.from_json(recorded[role])
    except (KeyError, TypeError, ValueError):
        pass
    change = None
    if old is not None and old.url == current.url:
        change = current.change_from(old)
        if change is None:
            return old, None
    write_json(path, {**recorded, role: asdict(current)})
    return current, change
