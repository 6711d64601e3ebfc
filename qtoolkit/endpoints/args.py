"""`--base-url` and `--endpoint` with vLLM's meaning, shared by `eval`, `bench serve` and `signoff`.

As in `vllm bench serve`: `--base-url` is the server (`http://host:8000`; a trailing `/v1` is accepted) and
`--endpoint` is the API route on it (`/v1/completions`, or `/v1/chat/completions` where a command can use it).
For compatibility with earlier qtoolkit releases, `--endpoint` given a full URL (`http://host:8000/v1`) is read as
the server, plus the route when the URL ends in one.
"""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit, urlunsplit

from ..errors import QToolError

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def add_server_arguments(p: argparse.ArgumentParser, *, who: str, routes: tuple[str, ...],
                         prefix: str = "") -> None:
    """`--{prefix}base-url` and `--{prefix}endpoint` for the server that serves `who`."""
    p.add_argument(f"--{prefix}base-url", dest=f"{prefix.replace('-', '_')}base_url", metavar="URL",
                   help=f"an OpenAI-compatible server that serves {who}, e.g. http://host:8000 (vLLM's --base-url)")
    p.add_argument(f"--{prefix}endpoint", dest=f"{prefix.replace('-', '_')}endpoint", metavar="PATH",
                   help=f"API route on --{prefix}base-url: {' or '.join(routes)} (vLLM's --endpoint; default "
                        f"{routes[0]}); a full URL is read as --{prefix}base-url, as earlier qtoolkit releases did")


def resolve_server(base_url: str | None, endpoint: str | None, routes: tuple[str, ...],
                   flag: str = "--endpoint") -> tuple[str | None, str]:
    """(server root without /v1, or None when no server was named; the route)."""
    if endpoint and endpoint.startswith(("http://", "https://")):
        if base_url:
            raise QToolError(f"{flag} {endpoint} is a URL and --base-url is given too: pass --base-url URL and "
                             f"{flag} PATH (e.g. /v1/completions)")
        parts = urlsplit(endpoint)
        path = parts.path.rstrip("/")
        route = next((r for r in ROUTES if path.endswith(r)), None)
        base_url = urlunsplit((parts.scheme, parts.netloc, path[: len(path) - len(route)] if route else path, "", ""))
        endpoint = route
    route = endpoint or routes[0]
    if not route.startswith("/"):
        route = "/" + route
    if route not in routes:
        raise QToolError(f"{flag} {route} is not a route this command uses: pass {' or '.join(routes)}")
    if base_url is not None:
        if not base_url.startswith(("http://", "https://")):
            raise QToolError(f"--base-url {base_url} is not an http(s) URL: pass e.g. http://127.0.0.1:8000")
        base_url = base_url.rstrip("/").removesuffix("/v1")
    elif endpoint and not endpoint.startswith("http"):
        raise QToolError(f"{flag} {endpoint} is a route: name the server with --base-url URL too")
    return base_url, route
