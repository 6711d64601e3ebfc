"""The FastAPI app: OpenAI-compatible routes over one engine, plus /health and /metrics.

Every refusal (bad input, unknown model, bad key, overload) is decided before the engine sees the request, so
refused requests never disturb running ones. The key and the body size are checked on the headers, before the
body is read (guard.py); prompts are tokenized on a worker thread, so a long prompt does not stall the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.params import SamplingParams
from ..errors import QToolError
from .control import add_control_routes
from .drain import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain, DrainGate
from .driver import EngineDriver, EngineStopped, Overloaded
from .generation import Generation
from .guard import DEFAULT_MAX_BODY_BYTES, GuardMiddleware
from .logprobs import logprobs_blocks
from .metrics import ServerMetrics
from .protocol import (
    SEED_MAX,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    completion_chunk,
    new_id,
    now,
    usage_block,
    usage_chunk,
)

log = logging.getLogger("qtoolkit.server")

RETRY_AFTER_S = 1
DEFAULT_REQUEST_TIMEOUT_S = 1800.0


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class ServerState:
    def __init__(self, engine: Any, *, names: list[str], api_key: str | None, max_waiting: int,
                 request_timeout_s: float, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.drain = Drain(shutdown_timeout_s)
        # one worker: the tokenizer copy is not shared between threads, and tokenizing is cheap next to a step
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qtool-tokenize")
        # The engine thread detokenizes with engine.tokenizer; the event loop tokenizes with its own copy.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.score_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qtool-score")
        self.score_tokenizer = copy.deepcopy(engine.tokenizer)
        self.model_name = names[0]
        self.names = set(names)
        self.api_key = api_key
        self.metrics = ServerMetrics(in_flight=lambda: self.driver.in_flight, engine_up=lambda: self.driver.alive)
        self.driver = EngineDriver(engine, self.metrics, max_in_flight=engine.config.max_num_seqs + max_waiting)

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """A request needing more engine slots than the server ever admits can never run: 400, not a 503 to
        retry forever."""
        if num_prompts * n > self.driver.max_in_flight:
            raise APIError(400, f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences, but this server "
                                f"admits at most {self.driver.max_in_flight} at once: send fewer prompts or a "
                                "smaller n", param="n", code="too_many_sequences")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    async def logprobs(self, req: CompletionRequest, prompts: list[list[int]], final: list[Any]) -> list[Any]:
        """`choices[i].logprobs` for each choice (None unless asked for), computed after generation."""
        if req.logprobs is None:
            return [None] * len(final)
        return await asyncio.get_running_loop().run_in_executor(
            self.score_pool, logprobs_blocks, self.engine, self.score_tokenizer, prompts,
            [f.token_ids for f in final], req.logprobs, req.echo)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(404, f"model {model!r} does not exist: this server serves {self.model_name!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    def encode_prompt(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"{param} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                               param=param)
            ids = list(prompt)
        if not ids:
            raise APIError(400, f"{param} is empty: send at least one token", param=param)
        return ids

    def encode_chat(self, req: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        text = self.tokenizer.apply_chat_template([m.as_template_dict() for m in req.messages], tokenize=False,
                                                  add_generation_prompt=True)
        return self.encode_prompt(self.tokenizer.encode(text, add_special_tokens=False), "messages")

    def budget(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
        """max_tokens checked against the context window; None means whatever the context leaves."""
        limit = self.engine.max_model_len
        room = limit - num_prompt_tokens
        if max_tokens is None and room > 0:
            return room
        if max_tokens is None or num_prompt_tokens + max_tokens > limit:
            asked = "" if max_tokens is None else f" and max_tokens is {max_tokens}"
            raise APIError(400, f"the prompt is {num_prompt_tokens} tokens{asked}, but this model's context is "
                                f"{limit} tokens: shorten the prompt or lower max_tokens", param=param,
                           code="context_length_exceeded")
        return max_tokens

    def check_admission(self, num_prompts: int, n: int) -> None:
        """Before any tokenizing: a request that cannot run is refused first (400), then one that cannot run
        now (503), so a full server spends no work on what it will refuse. start() reserves the slots."""
        self.check_fan_out(num_prompts, n)
        self.admit(num_prompts * n)
        self.driver.release(num_prompts * n)

    def admit(self, n: int) -> None:
        self.drain.check_admission()
        try:
            self.driver.admit(n)
        except Overloaded:
            raise APIError(503, f"the server is at capacity ({self.driver.max_in_flight} requests in flight): "
                                f"retry after {RETRY_AFTER_S} s", kind="server_error", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStopped as e:
            raise APIError(503, f"the engine stopped, so this server admits nothing: {e}", kind="server_error",
                           code="engine_stopped") from None

    def log_exit(self) -> None:
        """The line an operator reads after a shutdown: whether every request's KV blocks came back."""
        try:
            stats = self.engine.stats()
        except Exception as e:  # noqa: BLE001 - a broken engine must not turn a clean exit into a traceback
            log.warning("engine stopped; its KV use could not be read (%s: %s)", type(e).__name__, e)
            return
        log.warning("engine stopped: %d request(s) running, %d KV block(s) in use", stats.num_running,
                    stats.kv_blocks_used)

    def start(self, prompts: list[list[int]], params: list[SamplingParams]) -> Generation:
        self.admit(len(prompts))
        gen = Generation(self.driver, self.metrics, prompts, params, self.request_timeout_s, self.drain.generations)
        gen.launch()
        return gen


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, choice: int) -> SamplingParams:
    top_k = max(req.top_k, 0)
    # n seeded choices must not be copies; wrapping keeps seed + choice a valid 64-bit seed
    seed = None if req.seed is None else (req.seed + choice) % (SEED_MAX + 1)
    params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=top_k, top_p=req.top_p,
                            seed=seed, stop=req.stop_list(), ignore_eos=req.ignore_eos)
    try:
        params.validate()  # refuse here with a 400, not mid-stream
    except QToolError as e:
        raise APIError(400, str(e)) from None
    return params


def create_app(engine: Any, *, served_model_names: list[str] | None = None, api_key: str | None = None,
               max_waiting: int = 256, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               metrics_need_key: bool = False, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
               shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S, control_token: str | None = None) -> Any:
    """An ASGI app over `engine`. In-flight requests are bounded by the engine's max_num_seqs + max_waiting;
    past it: 503. On shutdown, in-flight requests get `shutdown_timeout_s` to finish (drain.py). With a
    `control_token`, the engine-mode switch (control.py) is served too.

    The FastAPI app is `app.app.app` behind the guard (key and body size) and the drain gate; `app.state.qtool`
    is the server state."""
    state = ServerState(engine, names=served_model_names or [engine.model_name], api_key=api_key,
                        max_waiting=max_waiting, request_timeout_s=request_timeout_s,
                        shutdown_timeout_s=shutdown_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.driver.start()
        yield
        state.drain.end_all()  # uvicorn stopped without a drain (its own timeout ran out): end what is left
        state.driver.stop()
        state.log_exit()
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        state.score_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="qtoolkit", lifespan=lifespan)
    app.state.qtool = state
    _add_error_handlers(app, state)
    _add_info_routes(app, state)
    _add_completion_routes(app, state)
    add_control_routes(app, state, control_token)
    return GuardMiddleware(DrainGate(app, state.drain), api_key=api_key, max_body_bytes=max_body_bytes,
                           metrics_need_key=metrics_need_key,
                           on_reject=lambda status: state.metrics.rejected.labels(str(status)).inc())


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every refusal leaves as an OpenAI-style error body, counted by status."""
    def error_response(err: APIError) -> JSONResponse:
        state.metrics.rejected.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            msg, param = f"the body is not valid JSON ({detail}): send a JSON object", None
        else:
            param = ".".join(loc) or "body"
            msg = f"{param}: {first.get('msg', 'invalid value')}"
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        return error_response(APIError(400, msg + more, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = "body_too_large" if err.status_code == 413 else str(err.status_code)
        return error_response(APIError(err.status_code, str(err.detail), code=code,
                                       headers=dict(err.headers or {})))


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if state.drain.draining:
            return JSONResponse({"status": "draining", "reason": state.drain.reason}, status_code=503)
        if state.driver.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped", "reason": state.driver.why_not_alive()}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": now(),
                                            "owned_by": "qtoolkit", "max_model_len": state.engine.max_model_len}]}


def _add_completion_routes(app: FastAPI, state: ServerState) -> None:
    def encode_completion(req: CompletionRequest) -> tuple[list[list[int]], list[int]]:
        prompts = [state.encode_prompt(p, "prompt") for p in req.prompts()]
        return prompts, [state.budget(len(p), req.max_tokens, "prompt") for p in prompts]

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        state.check_admission(len(req.prompts()), req.n)
        prompts, budgets = await state.off_loop(encode_completion, req)
        expanded = [(p, b) for p, b in zip(prompts, budgets, strict=True) for _ in range(req.n)]
        params = [sampling_params(req, b, i % req.n) for i, (_, b) in enumerate(expanded)]
        gen = state.start([p for p, _ in expanded], params)
        rid, created, model = new_id("cmpl"), now(), state.model_name
        if req.stream:
            async def events() -> AsyncIterator[str]:
                async for index, out, text in gen.events():
                    if text or out.finished:
                        yield sse(completion_chunk(rid, model, index, text, out.finish_reason, created))
            return _event_stream(gen, events(), rid, model, created, "text_completion", req.include_usage())
        try:
            if not await gen.collect(request):
                return Response(status_code=499)  # nobody is listening
        finally:
            gen.close()
        sent = [p for p in req.prompts() for _ in range(req.n)]
        heads = await state.off_loop(lambda: [p if isinstance(p, str) else state.tokenizer.decode(p)
                                              for p in sent]) if req.echo else [""] * len(sent)
        logprobs = await state.logprobs(req, gen.prompts, gen.final)
        choices = [{"index": i, "text": head + f.text, "logprobs": lp, "finish_reason": f.finish_reason}
                   for i, (head, f, lp) in enumerate(zip(heads, gen.final, logprobs, strict=True))]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices,
                             "usage": usage_block(gen.num_prompt_tokens, gen.num_completion_tokens,
                                                  **gen.usage_extra())})

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        state.check_admission(1, req.n)
        prompt = await state.off_loop(state.encode_chat, req)
        budget = state.budget(len(prompt), req.max_new_tokens(), "messages")
        gen = state.start([prompt] * req.n, [sampling_params(req, budget, i) for i in range(req.n)])
        rid, created, model = new_id("chatcmpl"), now(), state.model_name
        if req.stream:
            async def events() -> AsyncIterator[str]:
                for i in range(req.n):
                    yield sse(chat_chunk(rid, model, i, {"role": "assistant", "content": ""}, None, created))
                async for index, out, text in gen.events():
                    if text:
                        yield sse(chat_chunk(rid, model, index, {"content": text}, None, created))
                    if out.finished:
                        yield sse(chat_chunk(rid, model, index, {}, out.finish_reason, created))
            return _event_stream(gen, events(), rid, model, created, "chat.completion.chunk", req.include_usage())
        try:
            if not await gen.collect(request):
                return Response(status_code=499)
        finally:
            gen.close()
        choices = [{"index": i, "message": {"role": "assistant", "content": f.text}, "logprobs": None,
                    "finish_reason": f.finish_reason} for i, f in enumerate(gen.final)]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices,
                             "usage": usage_block(gen.num_prompt_tokens, gen.num_completion_tokens,
                                                  **gen.usage_extra())})


class EventStream(StreamingResponse):
    """SSE response that runs `on_close` however it ends, even when cancelled before the first chunk."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _event_stream(gen: Any, events: AsyncIterator[str], rid: str, model: str, created: int, obj: str,
                  include_usage: bool) -> EventStream:
    """The SSE framing both endpoints share: their chunks, an optional usage chunk, `[DONE]`; errors as a chunk."""
    async def chunks() -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
            if include_usage:
                usage = usage_block(gen.num_prompt_tokens, gen.num_completion_tokens, **gen.usage_extra())
                yield sse(usage_chunk(rid, model, obj, created, usage))
            yield sse("[DONE]")
        except APIError as e:
            yield sse(e.body())
        finally:
            gen.close()
    return EventStream(chunks(), on_close=gen.close)
