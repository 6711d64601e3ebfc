"""The engine-mode switch a benchmark drives: `GET/POST /qtool/engine/mode` switches batching (continuous/static)
and whether the loaded proposer is used, so one server measures several systems in turn.

The route exists only when the server was started with a control token (`QTOOL_CONTROL_TOKEN` in its
environment, which `server_process(control=True)` sets to a fresh random token); without one it is a 404 like
any unknown path. Each call must carry the token in `X-Qtool-Control-Token`, checked before the body is read
(401 otherwise). A switch happens only while the engine runs nothing (409 otherwise), on the engine thread.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from ..engine.params import EngineInputError
from ..errors import QToolError
from .driver import EngineStopped
from .process import CONTROL_HEADER, CONTROL_TOKEN_ENV, MODE_PATH
from .protocol import APIError

MIN_TOKEN_CHARS = 16


class ModeRequest(BaseModel):
    """The switch asked for: each field left out (or null) stays as it is."""

    model_config = ConfigDict(extra="forbid")

    batching: Literal["continuous", "static"] | None = None
    speculative: bool | None = None


def control_token_from_env() -> str | None:
    """The token the server was started with, taken out of the environment so no child inherits it."""
    token = os.environ.pop(CONTROL_TOKEN_ENV, "") or None
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise QToolError(f"{CONTROL_TOKEN_ENV} holds {len(token)} characters: give it at least {MIN_TOKEN_CHARS} "
                         "random ones (or unset it to serve without the mode switch)")
    return token


def add_control_routes(app: FastAPI, state: Any, token: str | None) -> None:
    """The mode routes over `state.driver`, when `token` is set."""
    if not token:
        return
    expected = token.encode()

    def check_token(request: Request) -> None:
        given = request.headers.get(CONTROL_HEADER, "").encode()
        if not secrets.compare_digest(given, expected):
            raise APIError(401, f"the engine-mode switch needs this server's control token in {CONTROL_HEADER}",
                           code="invalid_control_token")

    @app.get(MODE_PATH)
    async def get_mode(request: Request) -> dict[str, Any]:
        check_token(request)
        return state.engine.mode.to_json()

    @app.post(MODE_PATH)
    async def set_mode(request: Request) -> dict[str, Any]:
        check_token(request)
        try:
            body = ModeRequest.model_validate(json.loads(await request.body() or b"{}"))
        except (ValueError, ValidationError) as e:
            first = str(e).strip().splitlines()[0][:200]
            raise APIError(400, f"the mode switch takes a JSON object with `batching` (continuous or static) "
                                f"and/or `speculative` (true or false): {first}") from None
        try:
            mode = await state.driver.set_mode(**body.model_dump(exclude_none=True))
        except EngineInputError as e:
            raise APIError(400, str(e)) from None
        except QToolError as e:  # EngineBusyError: requests in flight
            raise APIError(409, str(e), code="engine_busy") from None
        except EngineStopped as e:
            raise APIError(503, f"the engine stopped: {e}", kind="server_error", code="engine_stopped") from None
        return mode.to_json()
