"""The bytes a route answers with: JSON bodies, SSE lines, errors in OpenAI's shape, and the app's exception handlers.

Every error, the router's own 404 and 405 included, has OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``; a request's failure is counted in the server's metrics by its path.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from prefixcache.errors import CapacityError, EngineDeadError, OutOfBlocksError, PoolBusyError, PrefixCacheError
from prefixcache.serve.auth import Unauthorized
from prefixcache.serve.jobs import gone
from prefixcache.serve.protocol import BadRequest, error_body
from prefixcache.serve.state import server_state

__all__ = ["SHUTTING_DOWN", "add_error_handlers", "error_response", "json_response", "sse", "status_of"]

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down: the request was cancelled before it finished"
"""The message of a request the closing engine dropped (503)."""

# The bytes Starlette's JSONResponse renders, from encoders built once rather than per response or SSE chunk.
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_SSE_JSON = json.JSONEncoder(ensure_ascii=False)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``body`` as a JSON response.  A lone surrogate (JSON's ``"\\ud800"`` escape, echoed back in an error naming a
    field) has no UTF-8 form: it is written as that escape again, still valid JSON, rather than failing with a 500."""
    data = _JSON.encode(body).encode("utf-8", "backslashreplace")
    return Response(data, status, headers, media_type="application/json")


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON: ``"data: {...}\\n\\n"``."""
    return f"data: {_SSE_JSON.encode(obj)}\n\n"


def status_of(error: BaseException) -> int:
    """The HTTP status of a request that raised ``error``: 400 for the client's mistake (a prompt the pool can never
    hold included), 503 while other requests hold the pool or once the engine process is gone, 500 otherwise."""
    # PoolBusyError derives from CapacityError but is transient: running requests hold the pool, a retry can pass.
    if isinstance(error, CapacityError) and not isinstance(error, PoolBusyError):
        return 400
    if isinstance(error, (OutOfBlocksError, EngineDeadError)):
        return 503
    return 400 if isinstance(error, PrefixCacheError) else 500


def error_response(error: BaseException) -> Response:
    """``error`` answered in OpenAI's error shape, with :func:`status_of`'s status (a BadRequest's own); a 500 names
    only the exception's type."""
    if isinstance(error, BadRequest):
        kind = "not_found_error" if error.status == 404 else "invalid_request_error"
        body = error_body(str(error), kind=kind, param=error.param, code=error.code)
        return json_response(body, error.status)
    status = status_of(error)
    kind = "invalid_request_error" if status == 400 else "server_error"
    message = str(error) if status != 500 else f"internal error: {type(error).__name__}"
    return json_response(error_body(message, kind=kind), status)


async def unauthorized(request: Request, error: Unauthorized) -> Response:
    body = error_body(str(error), param=None, code="invalid_api_key")
    return json_response(body, 401, {"WWW-Authenticate": "Bearer"})


async def client_disconnected(request: Request, error: ClientDisconnect) -> Response:
    # An upload cut off mid-body is the client's doing and nobody reads the answer: one line, not a traceback.
    logger.info("client disconnected before sending its whole body: %s %s", request.method, request.url.path)
    return gone()


async def http_error(request: Request, error: HTTPException) -> Response:
    # The router's own 404 (no such path) and 405 (wrong method), in the error shape every OpenAI client parses.
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = f"{error.detail}: {request.method} {request.url.path}"
    body = error_body(message, kind=kind, code=str(error.detail).lower().replace(" ", "_"))
    return json_response(body, error.status_code, error.headers)


async def engine_dead(request: Request, error: EngineDeadError) -> Response:
    # /health, /metrics and the other reads of an engine process that is gone: unavailable, not a traceback.
    logger.error("%s %s: %s", request.method, request.url.path, error)
    return json_response(error_body(str(error), kind="server_error"), 503)


async def bad_request(request: Request, error: BadRequest) -> Response:
    server_state(request).metrics.failed(request.url.path, error.status)
    return error_response(error)


def add_error_handlers(app: FastAPI) -> None:
    """Answer what a route raises in OpenAI's error shape: a missing or unknown API key 401, a bad request its own
    status (counted in the metrics), the router's 404 and 405, a gone engine process 503, and an upload its client
    cut off 499 (logged on one line)."""
    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(ClientDisconnect, client_disconnected)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(EngineDeadError, engine_dead)
    app.add_exception_handler(BadRequest, bad_request)
