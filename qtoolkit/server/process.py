"""Run `qtool serve` in a subprocess on a free loopback port (for benchmarks: the server gets its own GIL).

`controlled_server` also hands the server a fresh random control token, so the benchmark that started it (and
nobody else) can switch its engine's batching and speculation between measurements (control.py)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from ..engine.config import EngineConfig
from ..errors import QToolError
from ..launch import parent_death_signal, python_module_argv

CONTROL_TOKEN_ENV = "QTOOL_CONTROL_TOKEN"
CONTROL_HEADER = "X-Qtool-Control-Token"
MODE_PATH = "/qtool/engine/mode"


class ServerStartError(QToolError):
    """The server subprocess exited or never became healthy."""


@dataclass(frozen=True)
class ControlledServer:
    """A `qtool serve` subprocess this process may switch: its base URL, control token and process id."""

    url: str
    token: str
    pid: int

    def set_mode(self, *, batching: str | None = None, speculative: bool | None = None) -> dict[str, Any]:
        """Switch the idle engine's batching and/or speculation; the engine's mode after the switch."""
        body = {k: v for k, v in (("batching", batching), ("speculative", speculative)) if v is not None}
        try:
            r = httpx.post(self.url + MODE_PATH, json=body, headers={CONTROL_HEADER: self.token}, timeout=60.0)
        except httpx.HTTPError as e:
            raise QToolError(f"the server at {self.url} did not answer the mode switch ({e}): it may have died; "
                             "run the same `qtool serve` by hand to see why") from None
        if r.status_code != 200:
            raise QToolError(f"the server at {self.url} refused the mode switch {body} ({r.status_code}: "
                             f"{r.text[:300]})")
        return r.json()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(model: str, config: EngineConfig | None = None, *, max_waiting: int = 256,
                   startup_timeout_s: float = 900.0, extra_args: list[str] | None = None,
                   env: dict[str, str] | None = None, on_start: Callable[[int], None] | None = None) -> Iterator[str]:
    """Yield the base URL of a healthy `qtool serve` running `config`; stop it (SIGTERM, then SIGKILL) on exit.

    The config crosses the process boundary as the serve command's own flags (EngineConfig.to_cli_args); `env`
    adds to the child's environment; `on_start(pid)` is called once the child runs."""
    port = free_port()
    cmd = [*python_module_argv("qtoolkit"), "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), *(config or EngineConfig()).to_cli_args(), "--max-waiting", str(max_waiting),
           "--log-level", "warning", *(extra_args or [])]
    child_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                preexec_fn=parent_death_signal())
        try:
            if on_start is not None:
                on_start(proc.pid)
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


@contextlib.contextmanager
def controlled_server(model: str, config: EngineConfig | None = None, **kwargs: Any) -> Iterator[ControlledServer]:
    """server_process with the engine-mode switch on, under a fresh token only this process knows."""
    token = secrets.token_urlsafe(32)
    pid: list[int] = []
    with server_process(model, config, env={CONTROL_TOKEN_ENV: token}, on_start=pid.append, **kwargs) as url:
        yield ControlledServer(url, token, pid[0])


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
