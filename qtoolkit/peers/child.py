"""A peer in a child process, spoken to in JSON lines: one request, one answer, each under a deadline.

A native library built for another CPU dies with SIGILL the moment it runs an instruction the machine lacks, and
in-process that takes qtool (or pytest) down with it and no message. In a child, the parent sees the signal and
turns it into one line naming the peer, the signal and the fix.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any

from ..errors import QToolError
from ..launch import python_module_argv


class PeerError(QToolError):
    """A peer process failed, crashed, or did not answer in time."""


class PeerProcess:
    """`python -m MODULE` as a child: `call(request)` sends one JSON line and waits for one back."""

    def __init__(self, name: str, module: str, *, crash_hint: str) -> None:
        self.name, self.crash_hint = name, crash_hint
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(python_module_argv(module), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, bufsize=0)
        self._buffer = b""
        self._finalizer = weakref.finalize(self, _stop, self._proc)

    def call(self, request: dict[str, Any], *, timeout: float, doing: str) -> dict[str, Any]:
        """The answer to one request, or PeerError naming what the child did instead (crash, signal, hang)."""
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._death(doing) from None
        line = self._read_line(timeout, doing)
        answer = json.loads(line)
        if "error" in answer:
            self.close()
            raise PeerError(f"{self.name} peer failed while {doing}: {answer['error']}")
        return answer

    def close(self) -> None:
        self._finalizer()

    def _read_line(self, timeout: float, doing: str) -> bytes:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.close()
                    raise PeerError(f"{self.name} peer did not answer within {timeout:.0f} s while {doing}; it was "
                                    f"stopped. {self.crash_hint}")
                chunk = os.read(self._proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise self._death(doing)
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _death(self, doing: str) -> PeerError:
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.close()
            code = self._proc.returncode
        if code is not None and code < 0:
            sig = signal.Signals(-code)
            return PeerError(f"{self.name} peer died with {sig.name} ({signal.strsignal(sig)}) while {doing}. "
                             f"{self.crash_hint}")
        self._stderr.seek(0)
        last = [ln for ln in self._stderr.read().decode(errors="replace").splitlines() if ln.strip()]
        why = f": {last[-1].strip()}" if last else ""
        return PeerError(f"{self.name} peer exited with status {code} while {doing}{why}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        stream.close()


def serve(handle) -> None:
    """The child's side: answer each JSON line on stdin with `handle(request)` on the protocol channel.

    fd 1 is moved to stderr first, so a native library printing to stdout cannot corrupt the answers.
    """
    channel = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    for line in sys.stdin.buffer:
        try:
            answer = handle(json.loads(line))
        except Exception as e:  # reported to the parent as one line; the child ends
            channel.write(json.dumps({"error": f"{type(e).__name__}: {e}".splitlines()[0]}).encode() + b"\n")
            return
        channel.write(json.dumps(answer).encode() + b"\n")
