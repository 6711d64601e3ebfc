"""Talk to one sandboxed process without ever blocking: feed its stdin, read stdout, stderr and the result pipe
incrementally (keeping a bounded tail of each), and stop at a deadline. Every wait has a timeout."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

_CHUNK = 1 << 16


@dataclass
class Collected:
    stdout: bytes
    stderr: bytes
    result: bytes
    returncode: int | None
    timed_out: bool
    output_exceeded: bool
    seconds: float


class _Tail:
    """The last `keep` bytes of a stream, and how many bytes it carried."""

    def __init__(self, keep: int):
        self.keep, self.buf, self.total = keep, bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self.buf += data
        if len(self.buf) > 2 * self.keep:
            del self.buf[:-self.keep]

    def value(self) -> bytes:
        return bytes(self.buf[-self.keep:])


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process and its group (bwrap's PID namespace takes every descendant with it)."""
    for fn in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            fn()
        except (ProcessLookupError, PermissionError):
            pass


def collect(proc: subprocess.Popen, payload: bytes, result_fd: int, *, wall_s: float, keep: int,
            output_limit: int) -> Collected:
    """Drive `proc` to its end or the deadline; closes every pipe end it was given."""
    start = time.monotonic()
    deadline = start + wall_s
    sel = selectors.DefaultSelector()
    tails = {proc.stdout.fileno(): _Tail(keep), proc.stderr.fileno(): _Tail(keep), result_fd: _Tail(256)}
    for fd in tails:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    stdin = proc.stdin.fileno()
    os.set_blocking(stdin, False)
    sel.register(stdin, selectors.EVENT_WRITE)
    pending, timed_out, exceeded = memoryview(payload), False, False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                fd = key.fd
                if fd == stdin:
                    try:
                        pending = pending[os.write(fd, pending[:_CHUNK]):]
                    except (BrokenPipeError, BlockingIOError) as e:
                        if isinstance(e, BlockingIOError):
                            continue
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    data = os.read(fd, _CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                    continue
                tails[fd].add(data)
                if tails[proc.stdout.fileno()].total + tails[proc.stderr.fileno()].total > output_limit:
                    exceeded = True
                    break
            if exceeded:
                break
    finally:
        sel.close()
    if not (timed_out or exceeded):  # every pipe closed: give the process what is left of its time to exit
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0) + 0.5)
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out or exceeded:
        kill(proc)
    returncode = _wait(proc)
    out = Collected(tails[proc.stdout.fileno()].value(), tails[proc.stderr.fileno()].value(),
                    tails[result_fd].value(), returncode, timed_out, exceeded, time.monotonic() - start)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        f.close()
    os.close(result_fd)
    return out


def _wait(proc: subprocess.Popen) -> int | None:
    try:
        return proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return None  # unkillable (D state): give up on it rather than hang the evaluator
