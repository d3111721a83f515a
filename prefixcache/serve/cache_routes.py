"""The cache's own route: ``POST /v1/cache/prefill`` warms the cache with a prompt before anyone asks it.

A prefill is an engine request that generates nothing (``max_new_tokens`` 0): it runs with the others, in the
caller's namespace, and leaves the prompt's blocks in the tree, pinned at ``priority`` for ``retain_s`` seconds when
asked (:class:`~prefixcache.engine.batching.BatchEngine`'s ``submit``).  Its answer is the usage of that prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from prefixcache.engine.batching import RequestHandle
from prefixcache.engine.sampling import SamplingParams
from prefixcache.serve.dispatch import finish_job, outcome
from prefixcache.serve.protocol import parse_prefill_request, usage_json
from prefixcache.serve.replies import json_response
from prefixcache.serve.state import server_state

__all__ = ["add_cache_routes", "prefill"]

PREFILL = "/v1/cache/prefill"


async def prefill(request: Request) -> Response:
    """``POST /v1/cache/prefill``: the ``messages`` (rendered without a generation prompt) or ``prompt`` prefilled into
    the cache; answers ``{"object": "cache.prefill", "usage": ...}``."""
    state = server_state(request)
    namespace = state.authenticate(request)
    raw = await state.work.read_json(request)
    body = await state.work.call(request, parse_prefill_request, raw, state.tokenizer.vocab_size)
    if body.model is not None:
        state.check_model(body.model)
    tokenizer, engine = state.tokenizer, state.engine

    def start(on_delta: Callable[[str], None] | None) -> tuple[RequestHandle, Future[Any]]:
        if body.messages is not None:
            ids = tokenizer.render_chat(body.messages, body.tools, add_generation_prompt=False)
        elif isinstance(body.prompt, str):
            ids = tokenizer.encode(body.prompt)
        else:
            ids = body.prompt
        params = SamplingParams(max_new_tokens=0)
        handle = engine.submit(ids, params, namespace=namespace, priority=body.priority, retain_s=body.retain_s)
        return handle, handle.future

    done = outcome(state, *await finish_job(state, start, request), PREFILL)
    if isinstance(done, Response):
        return done
    return json_response({"object": "cache.prefill", "usage": usage_json(done.usage)})


def add_cache_routes(app: FastAPI) -> None:
    """Add the prefill route to ``app``."""
    app.add_route(PREFILL, prefill, methods=["POST"])
