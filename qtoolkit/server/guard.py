"""ASGI middleware that decides on the headers alone, before any of the body is read.

An unauthenticated client must not make the server buffer or parse its body: the key is checked on the
`Authorization` header first (401), then the declared size (413), and the body is counted as it streams in, so
a chunked body past the limit is cut off at the limit rather than read to its end.

A refusal is answered before the body arrives, so the client may still be writing when it is sent. Closing the
socket then, with the client's bytes unread, makes the kernel send a reset, and a reset discards the refusal
from the client's receive buffer before the client reads it (it sees a connection error instead of the 401).
So after a refusal the middleware discards what the client still sends, for at most `LINGER_SECONDS`, before the
connection closes: the lingering close nginx and Apache do for the same reason.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
OPEN_PATHS = frozenset({"/health"})  # probes need no key
LINGER_SECONDS = 5.0  # nginx's lingering_timeout: how long a silent client may hold a refused connection


class BodyTooLarge(HTTPException):
    """Raised from receive(): FastAPI passes HTTPExceptions through its body parsing (others become a 400)."""

    def __init__(self, limit: int):
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit} bytes: send a smaller request "
            "(or raise the server's --max-body-bytes)")


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics_need_key: bool,
                 on_reject: Callable[[int], None] = lambda status: None):
        self.app = app
        self.state = getattr(app, "state", None)  # the FastAPI app's state (app.state.qtool), for callers
        self.api_key = None if api_key is None else api_key.encode()
        self.max_body_bytes = max_body_bytes
        self.open_paths = OPEN_PATHS | (frozenset() if metrics_need_key else {"/metrics"})
        self.on_reject = on_reject

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if self.api_key is None:
            return True
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        # compare_digest on equal-type bytes: the time taken does not depend on where a wrong key differs
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        if scope["path"] not in self.open_paths and not self.authorized(headers):
            await self.refuse(receive, send, 401, "invalid API key: send `Authorization: Bearer <key>` with the "
                                                  "server's key", "invalid_api_key")
            return
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self.refuse(receive, send, 413, too_large_message(self.max_body_bytes), "body_too_large")
            return
        await self.app_with_counted_body(scope, receive, send)

    async def app_with_counted_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen = 0
        started = False

        async def counted_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self.refuse(receive, send, 413, too_large_message(self.max_body_bytes), "body_too_large")

    async def refuse(self, receive: Receive, send: Send, status: int, message: str, code: str) -> None:
        self.on_reject(status)
        body = error_body(status, message, code)
        # Connection: close, because the unread body is still on the wire and must not be parsed as a request
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        # every byte of the refusal is on the wire; the message stays open while the rest of the body is discarded
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await discard_body(receive, LINGER_SECONDS)
        await send({"type": "http.response.body", "body": b""})


async def discard_body(receive: Receive, seconds: float) -> None:
    """Read and drop request body messages until the body ends, the client leaves, or `seconds` pass."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        try:
            message = await asyncio.wait_for(receive(), left)
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
