"""One HTTP request's engine requests (prompts x n choices): launch, stream or collect, and always clean up.

Cleanup is the point of this module: whatever ends a request (finish, client disconnect, cancellation, engine
failure, server shutdown), `close()` aborts the engine requests still running, which frees their KV blocks, and
gives the admission slots back. No wait is open-ended: the engine's liveness is checked every second, and a request that
outlives its deadline ends with 504.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from ..engine.params import SpeculativeUsage
from .driver import EngineDriver, EngineFailure
from .metrics import ServerMetrics
from .protocol import APIError, new_id
from .stops import StreamCursor

LIVENESS_POLL_S = 1.0


class Generation:
    def __init__(self, driver: EngineDriver, metrics: ServerMetrics, prompts: list[list[int]], params: list[Any],
                 timeout_s: float, live: set[Generation] | None = None):
        self.driver, self.metrics = driver, metrics
        self.prompts, self.params = prompts, params
        self.num_prompt_tokens = sum(len(p) for p in {tuple(p) for p in prompts})  # a prompt counts once
        self.request_ids = [new_id("req") for _ in prompts]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.final: list[Any] = [None] * len(prompts)
        self.num_output_tokens = [0] * len(prompts)
        self._first_token_at: list[float | None] = [None] * len(prompts)
        self._started_at = time.monotonic()
        self._deadline = self._started_at + timeout_s
        self._timeout_s = timeout_s
        self._cursors = [StreamCursor(p.stop) for p in params]
        self._pending: asyncio.Future | None = None
        self._closed = False
        self._live = live if live is not None else set()  # the server's running generations (drain.Drain)
        self._live.add(self)

    def launch(self) -> None:
        """Admission must already be granted (driver.admit)."""
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        for i, (rid, ids, p) in enumerate(zip(self.request_ids, self.prompts, self.params, strict=True)):
            self.driver.add(rid, ids, p, self.queue, i)

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.final)

    def end(self, err: APIError) -> bool:
        """End this request from outside (the server shuts down): its reader raises `err` next, after the outputs
        already queued. False when it already finished."""
        if self._closed or self.done:
            return False
        self.queue.put_nowait((-1, err))
        return True

    async def _next(self) -> tuple[int, Any]:
        """The next (choice, output), checking every second that the engine lives and the deadline holds."""
        while True:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self.queue.get())  # kept across polls: no item is lost
            done, _ = await asyncio.wait({self._pending}, timeout=LIVENESS_POLL_S)
            if done:
                item, self._pending = self._pending.result(), None
                return item
            if not self.driver.alive:
                raise APIError(503, f"the engine stopped: {self.driver.why_not_alive()}", kind="server_error",
                               code="engine_stopped")
            if time.monotonic() > self._deadline:
                raise APIError(504, f"the request ran past the server's {self._timeout_s:.0f} s request timeout: "
                                    "ask for fewer tokens (or raise --request-timeout)", kind="server_error",
                               code="timeout")

    async def events(self) -> AsyncIterator[tuple[int, Any, str]]:
        """(choice index, RequestOutput, text safe to stream) until every choice finished; a failure raises."""
        while not self.done:
            index, out = await self._next()
            if isinstance(out, APIError):  # ended by the server (shutdown)
                raise out
            if isinstance(out, EngineFailure):
                if out.status == 400:
                    raise APIError(400, out.message)
                if out.status == 503:
                    raise APIError(503, f"the engine stopped: {out.message}", kind="server_error",
                                   code="engine_stopped")
                raise APIError(500, f"the engine failed on this request: {out.message}", kind="server_error",
                               code="engine_error")
            now = time.monotonic()
            if out.new_token_ids and self._first_token_at[index] is None:
                self._first_token_at[index] = now
            self.num_output_tokens[index] = out.num_output_tokens
            if out.finished:
                self.final[index] = out
                first = self._first_token_at[index]
                self.metrics.record_finished(out.finish_reason or "stop",
                                             None if first is None else first - self._started_at,
                                             now - self._started_at, out.num_output_tokens)
            yield index, out, self._cursors[index].advance(out.text, out.finished)

    async def collect(self, request: Request) -> bool:
        """Run to completion; False if the client went away first (the caller then just closes)."""

        async def consume() -> None:
            async for _ in self.events():
                pass

        consumer = asyncio.create_task(consume())
        watcher = asyncio.create_task(wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
        if not consumer.done() or consumer.cancelled():
            return False
        consumer.result()  # re-raises an engine failure
        return True

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.num_output_tokens)

    def usage_extra(self) -> dict[str, Any]:
        """Usage-block extension: this request's speculative decoding figures, when the engine speculates (now:
        a benchmark may have switched its proposer off, and then the server answers as a plain one)."""
        if not self.driver.engine.mode.speculating:
            return {}
        usage = sum((f.speculative for f in self.final if f is not None), SpeculativeUsage())
        return {"speculative": usage.as_dict()}

    def close(self) -> None:
        """Abort unfinished engine requests (frees their KV blocks) and release admission. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._live.discard(self)
        if self._pending is not None:
            self._pending.cancel()
        for rid, fin in zip(self.request_ids, self.final, strict=True):
            if fin is None:
                self.driver.abort(rid)
                self.metrics.finished.labels("abort").inc()
        self.driver.release(len(self.request_ids))


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body was already read, so only disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
