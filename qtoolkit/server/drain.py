"""Graceful shutdown: SIGTERM or SIGINT drains the server, then it exits 0.

Draining, the server refuses new work at the door (503 with Retry-After, `Connection: close`) and `/health`
answers 503 `draining`, so a load balancer takes it out of rotation; requests already in flight run on for up to
`--shutdown-timeout` seconds. Those still running then end with a clean error (a last SSE error event for a
stream, a JSON 503 otherwise, code `shutting_down`) and their engine requests are aborted, which frees their KV
blocks; only then does uvicorn's own shutdown start, so it finds no request to cancel (its cancellation is what
answered 500 with a CancelledError traceback). A second signal ends what runs at once.

The default timeout, 0, is vLLM's `--shutdown-timeout` default: in-flight requests end at once, cleanly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from .protocol import APIError

if TYPE_CHECKING:
    from .generation import Generation

log = logging.getLogger("qtoolkit.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 0.0  # vLLM's default: abort in-flight requests at once (cleanly)
END_GRACE_S = 5.0  # once requests are ended, how long their handlers get to send the last event
RETRY_AFTER_S = 1  # a client retrying after this lands on another replica (this one stops listening)
OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered while draining: probes and scrapers see the state
_POLL_S = 0.05

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def shutting_down(detail: str) -> APIError:
    return APIError(503, f"the server is shutting down ({detail}): send the request again, to another replica",
                    kind="server_error", code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


class Drain:
    """The drain's state, on the event loop: what is in flight, and whether new work is refused."""

    def __init__(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.draining = False  # refusing new requests
        self.ending = False  # past the timeout: what still runs is being ended
        self.active = 0  # HTTP requests on work routes being answered (tokenizing, generating, sending)
        self.generations: set[Generation] = set()  # their engine work, which end() stops
        self.in_flight_at_signal = 0
        self.ended = 0
        self.refused = 0
        self._forced = False

    @property
    def reason(self) -> str:
        if self.ending:
            return "the server is shutting down: in-flight requests past --shutdown-timeout are being ended"
        return f"the server is shutting down: {self.active} request(s) in flight get up to {self.timeout_s:g} s"

    def on_signal(self, name: str, exit_now: Callable[[], None]) -> None:
        """First signal: start draining. A later one: end what runs now."""
        if self.draining:
            log.warning("%s again: ending the %d request(s) still in flight now", name, self.active)
            self._forced = True
            return
        self.draining = True
        self.in_flight_at_signal = self.active
        log.warning("%s: draining: new requests get 503; %d in flight get up to %g s to finish "
                    "(--shutdown-timeout)", name, self.active, self.timeout_s)
        asyncio.get_running_loop().create_task(self._run(exit_now))

    async def _run(self, exit_now: Callable[[], None]) -> None:
        t0 = time.monotonic()
        try:
            deadline = t0 + self.timeout_s
            while self.active and time.monotonic() < deadline and not self._forced:
                await asyncio.sleep(_POLL_S)
            if self.active:
                self.end_all()
                end_by = time.monotonic() + END_GRACE_S
                while self.active and time.monotonic() < end_by:
                    await asyncio.sleep(_POLL_S)
            log.warning("drained in %.1f s: %d request(s) in flight at the signal, %d ended by the shutdown, "
                        "%d refused; %d still open", time.monotonic() - t0, self.in_flight_at_signal, self.ended,
                        self.refused, self.active)
        finally:
            exit_now()

    def end_all(self) -> None:
        self.ending = True
        detail = "past its --shutdown-timeout" if self.timeout_s > 0 else "it does not wait (--shutdown-timeout 0)"
        for gen in list(self.generations):
            if gen.end(shutting_down(detail)):
                self.ended += 1

    def check_admission(self) -> None:
        """Requests already inside the door start while draining; none starts once the rest are being ended."""
        if self.ending:
            raise shutting_down("in-flight requests are being ended")


class DrainGate:
    """ASGI middleware: counts the requests being answered and refuses new ones while draining."""

    def __init__(self, app: Any, drain: Drain):
        self.app, self.drain = app, drain
        self.state = getattr(app, "state", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            self.drain.refused += 1
            await refuse(send, shutting_down("it is draining"))
            return
        self.drain.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.active -= 1


async def refuse(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    # Connection: close, so a keep-alive client's next request goes to a new connection (another replica)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *((k.lower().encode(), v.encode()) for k, v in err.headers.items())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM/SIGINT handed to the drain; uvicorn's own shutdown starts when it is done.

    The signal is not recorded for re-raising (uvicorn re-raises it after shutting down, which would make a
    drained server exit by the signal instead of with 0)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or not self.started:  # still starting: nothing to drain
            self.should_exit = True
            return
        name = signal.Signals(sig).name
        # a signal handler runs between two bytecodes of the loop's thread: hand the work to the loop itself
        self._loop.call_soon_threadsafe(self.drain.on_signal, name, self._exit)

    def _exit(self) -> None:
        self.should_exit = True
