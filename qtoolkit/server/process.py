"""Run `qtool serve` in a subprocess on a free loopback port (for benchmarks: the server gets its own GIL)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import httpx

from ..engine.config import EngineConfig
from ..errors import QToolError
from ..launch import python_module_argv


class ServerStartError(QToolError):
    """The server subprocess exited or never became healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(model: str, config: EngineConfig | None = None, *, max_waiting: int = 256,
                   startup_timeout_s: float = 900.0, extra_args: list[str] | None = None) -> Iterator[str]:
    """Yield the base URL of a healthy `qtool serve` running `config`; stop it (SIGTERM, then SIGKILL) on exit.

    The config crosses the process boundary as the serve command's own flags (EngineConfig.to_cli_args)."""
    port = free_port()
    cmd = [*python_module_argv("qtoolkit"), "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), *(config or EngineConfig()).to_cli_args(), "--max-waiting", str(max_waiting),
           "--log-level", "warning", *(extra_args or [])]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_parent_death_signal())
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_healthy(proc, base_url, startup_timeout_s, log)
            yield base_url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a child hook so the server gets SIGTERM if the benchmark dies without cleanup (SIGKILL, crash).

    libc is loaded here, in the parent: the hook runs between fork and exec, where importing is unsafe.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            lines = [ln.strip() for ln in log.readlines() if ln.strip()]
            last = lines[-1] if lines else "no output"
            raise ServerStartError(f"the server exited with code {proc.returncode} before it was ready "
                                   f"(last line: {last}): run the same `qtool serve` by hand to see why")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerStartError(f"the server at {base_url} was not healthy after {timeout_s:.0f} s: check the model "
                           "loads with `qtool generate`")
