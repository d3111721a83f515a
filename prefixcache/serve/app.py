"""The OpenAI-compatible HTTP API (FastAPI), assembled from its routes, one module per resource:

- :mod:`~prefixcache.serve.completion_routes`: ``/v1/chat/completions`` (with tools) and ``/v1/completions``;
- :mod:`~prefixcache.serve.responses_routes`: ``/v1/responses`` and a stored response by id;
- :mod:`~prefixcache.serve.tokenize_routes`: vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``;
- :mod:`~prefixcache.serve.cache_routes`: ``/v1/cache/prefill`` (prefix warming);
- :mod:`~prefixcache.serve.info_routes`: ``/health``, ``/metrics``, ``/openapi.json`` and the models.

Every ``/v1`` request is authenticated first (a 401 touches nothing: no body is parsed, no cache state read or
changed), its namespace taken from its API key, and its model work submitted to one
:class:`~prefixcache.engine.batching.BatchEngine`: concurrent requests run together, one batched forward per step
(continuous batching, chunked prefill, prefix-aware admission), on the engine's one thread, so no two forwards ever
race on the pool.  The event loop only writes the responses, and parses, checks and renders a small request (a large
one on a worker thread: :mod:`prefixcache.serve.offload`).  What the routes share is one
:class:`~prefixcache.serve.state.ServerState` (``app.state.server``); their errors are answered in OpenAI's shape by
:mod:`prefixcache.serve.replies`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from prefixcache.engine.process import EngineProcess
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.serve.auth import ApiKeys
from prefixcache.serve.cache_routes import add_cache_routes
from prefixcache.serve.completion_routes import add_completion_routes
from prefixcache.serve.info_routes import add_info_routes
from prefixcache.serve.jobs import DEFAULT_MAX_REQUEST_BYTES
from prefixcache.serve.replies import add_error_handlers
from prefixcache.serve.response_store import DEFAULT_MAX_STORED_RESPONSES
from prefixcache.serve.responses_routes import add_response_routes
from prefixcache.serve.snapshots import SHUTDOWN_SAVE_TIMEOUT_S
from prefixcache.serve.state import ServerState, build_state
from prefixcache.serve.tokenize_routes import add_tokenize_routes

__all__ = ["create_app"]

# Each resource's routes, in the order they are added.  They are plain Starlette routes (app.add_route): each handler
# reads its own body (to answer a bad one in OpenAI's error shape) and builds its own response, so FastAPI's
# per-request dependency solving and response serialization (~0.1 ms a request) would buy nothing.  The bodies'
# schemas are declared once (prefixcache.serve.schemas): the handlers validate with them and /openapi.json publishes
# them.
ROUTES = (add_info_routes, add_completion_routes, add_cache_routes, add_response_routes, add_tokenize_routes)

# FastAPI's native OpenTelemetry (FastAPI >= 0.165) checks the global providers on every request and wraps each in
# its middleware; the server's own /metrics covers what it would record, so it is switched off where it exists.
_NO_TELEMETRY = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The server's life: its snapshot restored before the first request and saved periodically and at the end
    (when it keeps one); its engine and worker threads closed at the end."""
    state: ServerState = app.state.server
    if state.snapshots is None:
        yield
        state.engine.close()
        state.work.close()
        return
    await state.snapshots.restore()
    periodic = asyncio.create_task(state.snapshots.run_periodic())
    try:
        yield
    finally:
        periodic.cancel()
        await state.snapshots.save(timeout_s=SHUTDOWN_SAVE_TIMEOUT_S)
        state.engine.close()
        state.work.close()


def create_app(
    runner: PrefixCachingRunner | EngineProcess,
    *,
    model_name: str = "prefixcache",
    api_keys: ApiKeys | None = None,
    snapshot_dir: str | os.PathLike[str] | None = None,
    snapshot_every_s: float | None = None,
    max_batch_tokens: int = 512,
    max_running: int = 32,
    speculate: str = "off",
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app serving ``runner`` as model ``model_name``; ``api_keys`` (default: open) map keys to
    namespaces.  ``app.state.engine`` is the :class:`~prefixcache.engine.batching.BatchEngine` stepping every request
    on its own thread (``max_batch_tokens`` and ``max_running`` are its bounds, ``speculate`` its speculative decoding,
    ``"off"`` or ``"tree"``: see :mod:`prefixcache.engine.speculation`; closed when the app shuts down: call
    ``app.state.engine.close()`` yourself when the app is used without its lifespan, as with httpx's ASGI transport)
    and ``app.state.runner`` the runner.  Given an :class:`~prefixcache.engine.process.EngineProcess` instead of a
    runner, the app serves that engine in its own process (it is ``app.state.engine`` and ``app.state.runner``; its
    own options apply, ``max_batch_tokens``, ``max_running`` and ``speculate`` are not used; closed with the app): the
    event loop then
    never holds the engine's GIL (``prefixcache serve``'s default).

    With ``snapshot_dir`` the app's lifespan restores the cache from that snapshot folder at start (cold, saying why,
    when there is none or it is refused), saves it every ``snapshot_every_s`` seconds and on a clean shutdown
    (:class:`~prefixcache.serve.snapshots.SnapshotKeeper`, ``app.state.snapshots``).  The Responses API keeps the last
    ``max_stored_responses`` responses of each API key's namespace, within a byte bound (``app.state.responses``).  A
    request body over ``max_request_bytes`` (``app.state.max_request_bytes``) is a 413 in OpenAI's error shape, read no
    further.  Everything the routes share is ``app.state.server`` (:class:`~prefixcache.serve.state.ServerState`).
    Raises InvalidArgumentError for a ``max_request_bytes`` below 1."""
    state = build_state(
        runner,
        model_name=model_name,
        api_keys=api_keys,
        snapshot_dir=snapshot_dir,
        snapshot_every_s=snapshot_every_s,
        max_batch_tokens=max_batch_tokens,
        max_running=max_running,
        speculate=speculate,
        max_stored_responses=max_stored_responses,
        max_request_bytes=max_request_bytes,
    )
    state.engine.start()
    app = FastAPI(title="prefixcache", lifespan=lifespan, openapi_url=None, **_NO_TELEMETRY)
    app.state.server = state
    for name in ("runner", "engine", "metrics", "snapshots", "responses", "max_request_bytes"):
        setattr(app.state, name, getattr(state, name))
    for add_routes in ROUTES:
        add_routes(app)
    add_error_handlers(app)
    return app
