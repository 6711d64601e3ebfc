"""Run one function in a fresh (spawned) Python process and wait for it: its memory goes back to the system when it
ends, whatever the libraries it called keep cached or the allocator keeps fragmented.

A sweep quantizes and evaluates one candidate after another. In one process each candidate's quantizer and
engines left heap behind that `return_freed_memory` could not hand back, and the sweep's process carried 0.26-0.7
GiB more than a single sign-off's into its benchmark and diagnosis (measurements/2026-12-05/issue43m/README.md).

The child dies with its parent (PR_SET_PDEATHSIG), so a sign-off killed with -9 leaves no orphan holding its
folder's lock; its stdout goes to stderr as the parent's does (stdout carries the verdict). An exception in the
child comes back as one of the same kind where the sign-off tells kinds apart (a full disk, a user error), else
as a RuntimeError carrying its type and message; a child that dies without one is an error naming its exit.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..errors import OutputWriteError, QToolError
from ..launch import parent_death_signal


def _child(conn: Connection, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    die_with_parent = parent_death_signal(signal.SIGKILL)
    if die_with_parent is not None:  # elsewhere than Linux an orphan is possible, as for any other child
        die_with_parent()
    # stdout to stderr at the descriptor: `fn`'s module was imported when the arguments were unpickled, and a
    # logger bound to sys.stdout then (llm-compressor's) writes to descriptor 1
    sys.stdout.flush()
    os.dup2(2, 1)
    try:
        fn(*args)
        conn.send(None)
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which decides what it is
        kind = "disk" if isinstance(e, OutputWriteError) else "user" if isinstance(e, QToolError) else "bug"
        conn.send((kind, str(e) if kind != "bug" else f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    finally:
        conn.close()


def run_apart(what: str, fn: Callable[..., None], *args: Any) -> None:
    """`fn(*args)` in a spawned process (`fn` and `args` picklable, `fn` importable); raise what it raised."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args), name=what, daemon=True)
    proc.start()
    send.close()
    try:
        try:
            outcome = receive.recv()  # the child's outcome; EOF when it died without sending one
        except EOFError:
            outcome = "died"
        proc.join()
    finally:
        if proc.is_alive():  # the parent was interrupted: its child does not outlive the wait
            proc.kill()
            proc.join()
        receive.close()
    if outcome is None:
        return
    if outcome == "died":
        raise RuntimeError(f"{what}: its process ended with exit code {proc.exitcode} before it finished "
                           "(killed for memory?); rerun the same command to resume from its finished steps")
    kind, message = outcome
    raise OutputWriteError(message) if kind == "disk" else QToolError(message) if kind == "user" \
        else RuntimeError(message)

