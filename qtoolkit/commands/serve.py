"""`qtool serve`: an OpenAI-compatible HTTP server over the engine."""

from __future__ import annotations

import argparse

from ..engine.config import EngineConfig, add_engine_args
from ..errors import QToolError

HELP = "serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics)"


EXAMPLES = """\
examples:
  qtool serve --model out/int4 --port 8000
  curl -s localhost:8000/v1/completions -d '{"model": "out/int4", "prompt": "def add(a, b):", "max_tokens": 32}'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="`default`, a Hugging Face folder or a .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback only by default)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait beyond --max-num-seqs; past it the server answers 503")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body accepted; past it the server answers 413 (default 8 MiB)")
    p.add_argument("--metrics-need-key", action="store_true", help="require --api-key on /metrics too")
    p.add_argument("--request-timeout", type=float, default=1800.0,
                   help="seconds a request may run before it ends with 504 (default 1800)")
    p.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish while new ones get 503; the "
                        "rest then end with a clean error (default 0, as vLLM: end them at once)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="level of the HTTP server's (uvicorn) and the engine's log lines")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from ..server import serve  # start-up time: the server loads torch, fastapi and uvicorn

    if not 0 < args.port < 65536:
        raise QToolError(f"--port {args.port} is not a TCP port: pass 1-65535")
    if args.max_waiting < 0:
        raise QToolError("--max-waiting must be >= 0")
    if args.max_body_bytes <= 0 or args.request_timeout <= 0:
        raise QToolError("--max-body-bytes and --request-timeout must be > 0")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise QToolError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    if args.metrics_need_key and args.api_key is None:
        raise QToolError("--metrics-need-key needs --api-key: pass the key the scraper will send")
    config = EngineConfig.from_args(args)  # bad engine flags fail before the port is checked or the model loads
    serve(args.model, config, host=args.host, port=args.port, api_key=args.api_key, max_waiting=args.max_waiting,
          log_level=args.log_level, max_body_bytes=args.max_body_bytes, metrics_need_key=args.metrics_need_key,
          request_timeout_s=args.request_timeout, shutdown_timeout_s=args.shutdown_timeout)
    return 0
