"""Drives the synchronous, single-threaded engine from one background thread for the asyncio server.

HTTP handlers never touch the engine: they post add/abort commands to a thread-safe queue and read their
outputs from an asyncio.Queue that the engine thread fills (one loop callback per step, not per token).
Admission is counted on the event loop, so the bound on in-flight requests holds however fast they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
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


class EngineStopped(Exception):
    """The engine cannot go on (its thread died or it failed too often in a row): answer 503 at once."""


# After this many iterations in a row that failed, the engine is taken to be broken for good: the server stops
# admitting rather than failing every request after a full wait.
MAX_CONSECUTIVE_FAILURES = 3


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
        self.stopped_reason: str | None = None  # set once the engine cannot go on
        self._failures_in_a_row = 0

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
        return self.stopped_reason is None and self._thread is not None and self._thread.is_alive()

    def why_not_alive(self) -> str:
        if self.stopped_reason is not None:
            return self.stopped_reason
        return "the engine thread is not running" if self._thread is None or not self._thread.is_alive() else ""

    def admit(self, n: int) -> None:
        """Reserve room for n engine requests or raise Overloaded / EngineStopped; release() gives it back."""
        if not self.alive:
            raise EngineStopped(self.why_not_alive())
        if self.in_flight + n > self.max_in_flight:
            raise Overloaded
        self.in_flight += n

    def release(self, n: int) -> None:
        self.in_flight -= n

    def add(self, request_id: str, prompt_ids: list[int], params: Any, out: asyncio.Queue, index: int) -> None:
        sink = _Sink(asyncio.get_running_loop(), out, index)
        self._commands.put(("add", request_id, prompt_ids, params, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def set_mode(self, **changes: Any) -> Any:
        """Engine.set_mode(**changes) on the engine thread, between steps; its result or its exception."""
        if not self.alive:
            raise EngineStopped(self.why_not_alive())
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._commands.put(("mode", changes, loop, done))
        return await done

    # ---- engine-thread side ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.metrics.record_stats(self.engine.stats())
            while not self._stop.is_set() and self.stopped_reason is None:
                self._iterate()
        except BaseException as e:  # noqa: BLE001 - whatever ends the thread must end admission with a reason
            log.exception("the engine thread died")
            self._give_up(f"the engine thread died: {type(e).__name__}: {e}")
            return
        if self.stopped_reason is not None:
            self._drain_commands(self.stopped_reason)
        else:  # stopped by the server: the last aborts (a shutdown's) still free their KV blocks
            self._drain_commands("the server is shutting down", apply_aborts=True)

    def _iterate(self) -> None:
        """One loop iteration; an exception in any part fails the requests it touched, then the loop goes on."""
        touched: list[str] = []
        try:
            busy = self.engine.has_unfinished_requests()
            self._apply_commands(block=not busy)
            if not self.engine.has_unfinished_requests():
                return
            touched = list(self._sinks)  # a failing step may have touched any running request
            outputs = self.engine.step()
            touched = [o.request_id for o in outputs]
            # Metrics first: a client that saw a token must find it reflected in /metrics.
            self.metrics.record_step(sum(len(o.new_token_ids) for o in outputs), self.engine.stats())
            self._deliver(outputs)
        except Exception:  # a bug must not kill the server: fail what it touched, keep serving
            self._fail(touched, traceback.format_exc())
            return
        self._failures_in_a_row = 0

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        changed = False
        while True:
            try:
                changed |= self._apply(cmd)
            except Exception:  # one bad command must not lose the others, nor leave its request waiting
                self._fail_command(cmd, traceback.format_exc())
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
                if not isinstance(e, QToolError):
                    log.error("adding %s failed\n%s", rid, traceback.format_exc())
                _post(sink, EngineFailure(str(e), 400 if isinstance(e, QToolError) else 500))
                return False
            self._sinks[rid] = sink
            return True
        if cmd[0] == "mode":
            _, changes, loop, done = cmd
            try:
                _settle(loop, done, self.engine.set_mode(**changes))
            except Exception as e:  # busy (409) or a bad value (400): the caller answers it
                _settle(loop, done, error=e)
                return False
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

    def _fail_command(self, cmd: tuple, tb: str) -> None:
        log.error("engine command %s failed\n%s", cmd[0], tb)
        self.last_error = tb.strip().splitlines()[-1]
        if cmd[0] == "add":
            rid, sink = cmd[1], cmd[4]
            self._sinks.pop(rid, None)
            _post(sink, EngineFailure(self.last_error))
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid)

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
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is left to read these
                log.warning("dropped %d output(s) for a closed event loop", len(items))

    def _fail(self, request_ids: list[str], tb: str) -> None:
        self.last_error = tb.strip().splitlines()[-1]
        self._failures_in_a_row += 1
        log.error("engine loop iteration failed (%d in a row); failing %d request(s)\n%s", self._failures_in_a_row,
                  len(request_ids), tb)
        with contextlib.suppress(Exception):  # the metrics may be what failed
            self.metrics.record_loop_failure()
        for rid in request_ids:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                _post(sink, EngineFailure(self.last_error))
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s after an engine failure also failed", rid)
        if self._failures_in_a_row >= MAX_CONSECUTIVE_FAILURES:
            self._give_up(f"the engine failed {self._failures_in_a_row} iterations in a row (last: "
                          f"{self.last_error}): restart the server")

    def _give_up(self, reason: str) -> None:
        """Stop admitting and fail every request that is waiting, so none waits for an engine that is gone."""
        log.critical("%s", reason)
        self.stopped_reason = reason
        for sink in self._sinks.values():
            _post(sink, EngineFailure(reason, 503))
        self._sinks.clear()
        self._drain_commands(reason)

    def _drain_commands(self, reason: str, *, apply_aborts: bool = False) -> None:
        """Fail every queued add with `reason`; queued aborts run only on an engine that still works (their KV)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "abort" and apply_aborts:
                with contextlib.suppress(Exception):
                    self._apply(cmd)
            elif cmd[0] == "add":
                _post(cmd[4], EngineFailure(reason, 503))
            elif cmd[0] == "mode":
                _settle(cmd[2], cmd[3], error=EngineStopped(reason))


def _post(sink: _Sink, item: Any) -> None:
    try:
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, (sink.index, item))
    except RuntimeError:  # its event loop is closed
        pass


def _settle(loop: asyncio.AbstractEventLoop, done: asyncio.Future, result: Any = None, *,
            error: BaseException | None = None) -> None:
    """Resolve a future of the event loop from the engine thread (unless its caller has gone)."""
    def resolve() -> None:
        if done.done():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)
    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # its event loop is closed
        pass


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)
