"""The routes that describe the server: ``GET /health``, ``GET /metrics``, ``GET /openapi.json``, ``GET /v1/models``
and ``GET /v1/models/{model_id}``.

``/health`` and ``/metrics`` stay open with API keys, as in vLLM: load balancers and Prometheus probe them without
credentials, and they show only pool-wide aggregates (no prompt, namespace or key).  The models need a key.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from prefixcache.serve.metrics import CONTENT_TYPE
from prefixcache.serve.openapi import openapi_document
from prefixcache.serve.protocol import BadRequest
from prefixcache.serve.replies import error_response, json_response
from prefixcache.serve.state import server_state

__all__ = ["add_info_routes", "health", "model", "models", "openapi", "scrape"]


async def health(request: Request) -> Response:
    """``GET /health``: ``{"status": "ok", "model", "pending_requests"}``, or 503 once an engine process is gone or
    stopped answering.  On the event loop: ``num_pending`` is O(1) under a lock held briefly (an engine process's
    without a round trip), so it answers whatever the engine does."""
    state = server_state(request)
    return json_response({"status": "ok", "model": state.model_name, "pending_requests": state.engine.num_pending})


async def scrape(request: Request) -> Response:
    """``GET /metrics``: the Prometheus text.  The engine's figures are read on one worker thread and awaited for at
    most ``metrics.figures_timeout_s``, so a silent engine gets ``prefixcache_engine_up 0`` at once
    (:mod:`prefixcache.serve.metrics`)."""
    return Response(await server_state(request).metrics.scrape(), media_type=CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    """``GET /openapi.json``: the server's OpenAPI document, built on the first request for it."""
    state = server_state(request)
    if state.openapi is None:
        state.openapi = openapi_document(request.app.title, request.app.version)
    return json_response(state.openapi)


async def models(request: Request) -> Response:
    """``GET /v1/models``: the one model served, in OpenAI's list shape."""
    state = server_state(request)
    state.authenticate(request)
    return json_response({"object": "list", "data": [state.model_card()]})


async def model(request: Request) -> Response:
    """``GET /v1/models/{model_id}``: the model served by its id; another id is a 404 ``model_not_found``."""
    state = server_state(request)
    state.authenticate(request)
    try:
        state.check_model(request.path_params["model_id"])
    except BadRequest as unknown:
        # Answered here, not raised to the handler that counts failures by path: this path holds any id.
        return error_response(unknown)
    return json_response(state.model_card())


def add_info_routes(app: FastAPI) -> None:
    """Add the health, metrics, OpenAPI and model routes to ``app``."""
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", scrape, methods=["GET"])
    app.add_route("/openapi.json", openapi, methods=["GET"])
    app.add_route("/v1/models", models, methods=["GET"])
    # ":path": an id may hold a slash ("org/name"), which the openai client sends escaped and uvicorn unescapes.
    app.add_route("/v1/models/{model_id:path}", model, methods=["GET"])
