"""OpenAI-compatible request and response shapes, and the OpenAI error JSON.

Requests are validated by pydantic, so a wrong type or out-of-range value becomes a 400 naming the field.
Unknown fields are ignored (clients send many optional ones); fields we cannot honour are refused.
`ignore_eos` and `top_k` are extensions with vLLM's names, so one load generator drives both servers.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# Bounds on every field whose size costs engine time: the body limit alone does not bound per-token work
# (100,000 one-character stop strings fit in 1 MB and are scanned on every token of the sequence).
MAX_CHOICES = 16
MAX_STOP_STRINGS = 32  # the code eval sends 6; vLLM sets no bound
MAX_STOP_CHARS = 256
MAX_PROMPTS = 256  # prompts in one /v1/completions batch
MAX_MESSAGES = 1024
MAX_LOGPROBS = 20  # top alternatives per token: OpenAI's and vLLM's cap
SEED_MAX = 2**63 - 1  # torch.Generator seeds are 64-bit; n choices use seed + i, wrapped into this range


class APIError(Exception):
    """An error answered as OpenAI error JSON with an HTTP status; never disturbs other requests."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # 0 or -1: disabled (vLLM uses -1); the cap keeps it a 32-bit int: one top_k past int64 failed a whole batch
    top_k: int = Field(0, ge=-1, le=2**31 - 1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of > 1 is not supported: use n for several samples")
        return v

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stops)} stop strings: send at most {MAX_STOP_STRINGS}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is longer than {MAX_STOP_CHARS} characters: shorten it")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, gt=0)  # OpenAI's default for completions
    echo: bool = False  # the prompt comes back before the completion (and in logprobs), as in OpenAI's API
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token
    suffix: str | None = None

    @field_validator("echo", "logprobs")
    @classmethod
    def _not_streamed(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, False) and info.data.get("stream"):
            raise ValueError(f"{info.field_name} is answered once the completion ends: set stream to false")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (fill-in-the-middle) is not supported: leave the field out")
        return v

    @field_validator("prompt")
    @classmethod
    def _bounded_prompts(cls, v: Any) -> Any:
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"{len(v)} prompts in one request: send at most {MAX_PROMPTS}")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token list, or a batch of them."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p) if p else [p]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: Any = None
    max_tokens: int | None = Field(None, gt=0)  # None: the rest of the context, as vLLM does
    max_completion_tokens: int | None = Field(None, gt=0)

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("chat logprobs are not supported by this server: use /v1/completions with logprobs")
        return v

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_block(prompt_tokens: int, completion_tokens: int, **extra: Any) -> dict[str, Any]:
    """OpenAI usage; `extra` carries extensions (e.g. speculative-decoding acceptance stats)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, **extra}


def completion_chunk(rid: str, model: str, index: int, text: str, finish_reason: str | None,
                     created: int) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, index: int, delta: dict[str, str], finish_reason: str | None,
               created: int) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, obj: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


def now() -> int:
    return int(time.time())
