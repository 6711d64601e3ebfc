"""OpenAI-compatible HTTP server over the qtoolkit engine (FastAPI + uvicorn).

`create_app(engine, ...)` builds the ASGI app for an existing engine; `serve(...)` loads a model and runs it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from typing import TYPE_CHECKING, Any

import uvicorn

from ..engine.config import EngineConfig
from ..errors import QToolError
from ..progress import status
from .app import DEFAULT_REQUEST_TIMEOUT_S, create_app
from .control import control_token_from_env
from .drain import DEFAULT_SHUTDOWN_TIMEOUT_S, END_GRACE_S, DrainingServer
from .guard import DEFAULT_MAX_BODY_BYTES

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["create_app", "serve", "build_engine", "build_engine_off_main_thread"]

log = logging.getLogger("qtoolkit.server")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port_free(host: str, port: int) -> None:
    """Fail before the model loads, not after, when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise QToolError(f"cannot listen on {host}:{port} ({e.strerror}): pass another --port or --host") from None


def build_engine(model: Any, config: EngineConfig | None = None) -> Engine:
    # start-up time: a load generator importing server.process or server.metrics loads no torch
    from ..engine import Engine

    return Engine(model, config or EngineConfig())


def build_engine_off_main_thread(model: Any, config: EngineConfig | None = None) -> Engine:
    """build_engine in a short-lived helper thread, so the main thread never runs an OpenMP parallel region.

    The engine steps on the driver's thread. Once the main thread has run a parallel region (loading a model
    runs many), its idle OpenMP pool makes every parallel region of another thread slow on a 2-core machine:
    a 3072x576 GEMV takes 135 us from the main thread, 190-350 us from a thread after the main thread has run one,
    and 110-130 us from a thread when it has not; batch-1 decode in the engine thread runs at 24 tok/s with the
    main thread's pool alive and at 37 tok/s without it.
    A helper thread's pool goes away with the thread."""
    box: dict[str, Any] = {}

    def load() -> None:
        try:
            box["engine"] = build_engine(model, config)
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    loader = threading.Thread(target=load, name="qtool-load")
    loader.start()
    loader.join()
    if "error" in box:
        raise box["error"]
    return box["engine"]


def serve(model: Any = "default", config: EngineConfig | None = None, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_waiting: int = 256, log_level: str = "info",
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics_need_key: bool = False,
          request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
          shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
    """Load `model` into an engine built from `config` and serve it until SIGTERM or SIGINT; then drain (in-flight
    requests get `shutdown_timeout_s` to finish, the rest end cleanly) and return."""
    config = config or EngineConfig()
    control_token = control_token_from_env()
    if not _is_loopback(host) and api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    check_port_free(host, port)
    status(f"loading {model} ({config.batching} batching, KV cache {config.kv_budget})")
    engine = build_engine_off_main_thread(model, config)
    st = engine.stats()
    status(f"KV cache: {st.kv_cache_dtype}, {st.kv_capacity_tokens} tokens fit in {config.kv_budget} "
           f"({st.kv_bytes_per_token} bytes a token)")
    names = [engine.model_name] + [str(model)] * (str(model) != engine.model_name)
    app = create_app(engine, served_model_names=names, api_key=api_key, max_waiting=max_waiting,
                     max_body_bytes=max_body_bytes, metrics_need_key=metrics_need_key,
                     request_timeout_s=request_timeout_s, shutdown_timeout_s=shutdown_timeout_s,
                     control_token=control_token)
    status(f"serving {engine.model_name} on http://{host}:{port}/v1")
    # uvicorn's own graceful timeout starts after the drain, which has already ended every request
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=END_GRACE_S), app.state.qtool.drain)
    server.run()
    if not server.started:
        raise QToolError(f"the server on {host}:{port} did not start (see the lines above): pass another --port "
                         "or --host")
