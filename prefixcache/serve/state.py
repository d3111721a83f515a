"""What every route of one server reads: :class:`ServerState`, hung on ``app.state.server``.

A route is a module-level function of its request; it finds the engine, the tokenizer, the API keys, the metrics and
the Responses store through :func:`server_state`, never through a closure, so each resource's routes live in their
own module (``serve/*_routes.py``) and :func:`~prefixcache.serve.app.create_app` only assembles them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.process import EngineProcess
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.serve.auth import ApiKeys
from prefixcache.serve.logprobs import TokenStrings
from prefixcache.serve.metrics import ServerMetrics
from prefixcache.serve.offload import RequestWork
from prefixcache.serve.protocol import BadRequest
from prefixcache.serve.responses import ResponseStore
from prefixcache.serve.snapshots import SnapshotKeeper

__all__ = ["ServerState", "build_state", "server_state"]


@dataclass(slots=True)
class ServerState:
    """One server's shared objects.

    ``runner`` serves the model ``model_name`` through ``engine`` (a :class:`BatchEngine` over it, or the
    :class:`EngineProcess` itself, then ``runner is engine``); ``keys`` map API keys to namespaces; ``work`` reads
    bodies and runs what grows with them off the event loop; ``metrics`` counts requests; ``strings`` caches the
    logprobs' token strings; ``responses`` keeps the Responses API's answers; ``snapshots`` keeps the cache's snapshot
    folder (None without one); ``openapi`` is ``/openapi.json``'s document once built.
    """

    runner: PrefixCachingRunner | EngineProcess
    engine: BatchEngine | EngineProcess
    model_name: str
    keys: ApiKeys
    work: RequestWork
    metrics: ServerMetrics
    strings: TokenStrings
    responses: ResponseStore
    snapshots: SnapshotKeeper | None
    openapi: dict[str, Any] | None = None

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    @property
    def max_request_bytes(self) -> int:
        """The largest request body read, in bytes; a larger one is a 413."""
        return self.work.max_request_bytes

    def authenticate(self, request: Request) -> str | None:
        """The namespace of ``request``'s API key (None on an open server).  Raises Unauthorized (401) for a missing
        or unknown key when keys are configured."""
        return self.keys.namespace_for(request.headers.get("authorization"))

    def check_model(self, name: str) -> None:
        """Raises BadRequest (404, ``model_not_found``) unless ``name`` is the model served."""
        if name != self.model_name:
            message = f"the model {name!r} does not exist; this server serves {self.model_name!r}"
            raise BadRequest(message, "model", 404, "model_not_found")

    def model_card(self) -> dict[str, Any]:
        """The served model in OpenAI's ``model`` object shape."""
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "prefixcache"}


def build_state(
    runner: PrefixCachingRunner | EngineProcess,
    *,
    model_name: str,
    api_keys: ApiKeys | None,
    snapshot_dir: str | os.PathLike[str] | None,
    snapshot_every_s: float | None,
    max_batch_tokens: int,
    max_running: int,
    max_stored_responses: int,
    speculate: str = "off",
    max_request_bytes: int,
) -> ServerState:
    """The state of a server over ``runner`` (arguments as :func:`~prefixcache.serve.app.create_app` takes them); its
    engine is built but not started.  Raises InvalidArgumentError for a ``max_request_bytes`` below 1 (before any
    engine is built), a ``max_stored_responses`` below 0, or a bad snapshot folder or interval."""
    work = RequestWork(max_request_bytes)
    keys = api_keys if api_keys is not None else ApiKeys.open()
    engine: BatchEngine | EngineProcess = (
        runner
        if isinstance(runner, EngineProcess)
        else BatchEngine(runner, max_batch_tokens=max_batch_tokens, max_running=max_running, speculate=speculate)
    )
    return ServerState(
        runner=runner,
        engine=engine,
        model_name=model_name,
        keys=keys,
        work=work,
        metrics=ServerMetrics(engine),
        strings=TokenStrings(runner.tokenizer),
        responses=ResponseStore(max_stored_responses, namespaces=set(keys.namespaces.values()) or {None}),
        snapshots=None if snapshot_dir is None else SnapshotKeeper(engine, snapshot_dir, snapshot_every_s),
    )


def server_state(request: Request) -> ServerState:
    """The state of the server ``request`` came to.  O(1)."""
    return request.app.state.server
