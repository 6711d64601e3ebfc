"""Drives the synchronous, single-threaded engine from one background thread for the asyncio server.

HTTP handlers never touch the engine: they post add/abort commands to a thread-safe queue and read their
outputs from an asyncio.Queue that the engine thread fills (one loop callback per step, not per token).
Admission is counted on the event loop, so the bound on in-flight requests holds however fast they arrive.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from ..errors import QToolError
from .metrics import ServerMetrics

log = logging.getLogger("qtoolkit.server")

_IDLE_POLL_S = 0.5  # how often an idle engine thread checks whether it should stop


@dataclass
class EngineFailure:
    """Put on a request's queue when the engine refused (400) or failed (500) a request."""

    message: str
    status: int = 500


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int  # which choice of the HTTP request this engine request feeds


class Overloaded(Exception):
    """The in-flight bound is reached; the caller answers 503 with Retry-After."""


class EngineDriver:
    def __init__(self, engine: Any, metrics: ServerMetrics, *, max_in_flight: int):
        self.engine = engine
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # touched on the event loop only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # touched on the engine thread only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    # ---- event-loop side -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="qtool-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def admit(self, n: int) -> None:
        """Reserve room for n engine requests or raise Overloaded; release() gives it back."""
        if self.in_flight + n > self.max_in_flight:
            raise Overloaded
        self.in_flight += n
        self.metrics.in_flight.set(self.in_flight)

    def release(self, n: int) -> None:
        self.in_flight -= n
        self.metrics.in_flight.set(self.in_flight)

    def add(self, request_id: str, prompt_ids: list[int], params: Any, out: asyncio.Queue, index: int) -> None:
        sink = _Sink(asyncio.get_running_loop(), out, index)
        self._commands.put(("add", request_id, prompt_ids, params, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # ---- engine-thread side ----------------------------------------------------------------------------------
    def _run(self) -> None:
        self.metrics.record_stats(self.engine.stats())
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            self._apply_commands(block=not busy)
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a bug in the engine must not kill the server: fail what ran, keep serving
                self._fail_all(traceback.format_exc())
                continue
            # Metrics first: a client that saw a token must find it reflected in /metrics.
            self.metrics.record_step(sum(len(o.new_token_ids) for o in outputs), self.engine.stats())
            self._deliver(outputs)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        changed = False
        while True:
            changed |= self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        if changed and not self.engine.has_unfinished_requests():
            self.metrics.record_stats(self.engine.stats())  # e.g. the last abort freed every block

    def _apply(self, cmd: tuple) -> bool:
        if cmd[0] == "add":
            _, rid, prompt_ids, params, sink = cmd
            try:
                self.engine.add_request(rid, prompt_ids, params)
            except Exception as e:  # the handler validated it; the engine may still refuse (QToolError: bad input)
                failure = EngineFailure(str(e), 400 if isinstance(e, QToolError) else 500)
                sink.loop.call_soon_threadsafe(sink.queue.put_nowait, (sink.index, failure))
                return False
            self._sinks[rid] = sink
            return True
        if cmd[0] == "abort":
            rid = cmd[1]
            if self._sinks.pop(rid, None) is not None:
                try:
                    self.engine.abort_request(rid)
                except Exception:  # finished in the same step the client went away
                    log.debug("abort of %s found nothing to abort", rid)
                return True
        return False

    def _deliver(self, outputs: list) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted by its client meanwhile
            if out.finished:
                del self._sinks[out.request_id]
            batches.setdefault(sink.loop, []).append((sink.queue, (sink.index, out)))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, tb: str) -> None:
        log.error("engine step failed; failing %d request(s)\n%s", len(self._sinks), tb)
        self.last_error = tb.strip().splitlines()[-1]
        for rid, sink in list(self._sinks.items()):
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, (sink.index, EngineFailure(self.last_error)))
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s after an engine failure also failed", rid)
        self._sinks.clear()


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)
