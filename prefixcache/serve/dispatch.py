"""A route's model work on the engine: submitted, awaited (streamed or to its end), and its end answered.

Every route that runs the model goes through these, so a request is submitted on the worker thread, cancelled when
its client leaves or its handler stops, and counted in the metrics the same way whatever its endpoint.  A request the
engine drops itself (it closes) answers 503, or ends its stream with an error event, never like a finished answer.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from prefixcache.engine.batching import RequestHandle
from prefixcache.engine.chat_decoder import ChatCompletion
from prefixcache.serve.delivery import job_events
from prefixcache.serve.jobs import ending, gone, unless_gone
from prefixcache.serve.protocol import error_body
from prefixcache.serve.replies import SHUTTING_DOWN, error_response, json_response, sse, status_of
from prefixcache.serve.samples import first_events
from prefixcache.serve.state import ServerState

__all__ = ["Submit", "finish_job", "finish_samples", "outcome", "run_job", "start_streams", "stream_failure"]

Submit = Callable[[Callable[[Any], None] | None], tuple[RequestHandle, Future[Any]]]
"""``submit(on_delta)``: start a request on the engine; its handle (to cancel it) and the future of its outcome."""

Events = AsyncIterator[tuple[str, Any]]
"""A job's events: ``("delta", value)`` as it streams, then ``("done", value)``, ``("error", exception)`` or
``("cancelled", None)``."""


def run_job(state: ServerState, submit: Submit, request: Request) -> Events:
    """The events of ``submit``'s job: the engine thread only posts them, the event loop frames them
    (:mod:`prefixcache.serve.delivery`)."""
    return job_events(state.work, submit, request)


async def finish_job(state: ServerState, submit: Submit, request: Request) -> tuple[str, Any]:
    """A request's end only: one future and one wake-up of the event loop, where a stream needs a queue.  A client
    that disconnects first, or a handler cancelled while waiting, cancels the engine request (``("gone", None)``).
    ``submit`` runs on the worker thread (:meth:`~prefixcache.serve.offload.RequestWork.submit`)."""
    try:
        handle, future = await state.work.submit(submit, None)
    except asyncio.CancelledError:
        return "cancelled", None
    except Exception as error:  # noqa: BLE001
        return "error", error
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[tuple[str, Any]] = loop.create_future()

    def settle(outcome: tuple[str, Any]) -> None:
        if not ended.done():  # the request may have been cancelled (client gone) before it ended
            ended.set_result(outcome)

    def on_done(done: Future[Any]) -> None:
        try:
            loop.call_soon_threadsafe(settle, ending(done))
        except RuntimeError:
            pass

    future.add_done_callback(on_done)
    try:
        answered, result = await unless_gone(request, ended)
        return result if answered else ("gone", None)
    except asyncio.CancelledError:
        # uvicorn cancels the handlers still running when its graceful shutdown times out (it never cancels one
        # whose client left): answered as a request the closing engine dropped, not as its plain 500.
        return "cancelled", None
    finally:
        handle.cancel()


async def finish_samples(
    state: ServerState, start: Callable[..., Any], request: Request, n: int
) -> list[tuple[str, Any]]:
    """The ends (:func:`finish_job`) of ``n`` samples, ``start(on_delta, sample=i)`` submitted together and awaited in
    order; those still running when the handler stops are cancelled."""
    tasks = [asyncio.ensure_future(finish_job(state, functools.partial(start, sample=i), request)) for i in range(n)]
    try:
        return [await task for task in tasks]
    finally:
        for task in tasks:
            task.cancel()


async def start_streams(
    state: ServerState, start: Callable[..., Any], request: Request, n: int, endpoint: str
) -> tuple[list[tuple[str, Any]], list[Events]] | Response:
    """``n`` samples streamed, ``start(on_delta, sample=i)`` submitted together: each one's first event and the rest
    of its events, once every sample has its first (a queued request waits here for its first token).  A response
    instead when the client left meanwhile, or when a sample was refused (every sample then cancelled)."""
    jobs = [run_job(state, functools.partial(start, sample=i), request) for i in range(n)]
    answered, heads = await unless_gone(request, first_events(jobs))
    if not answered:
        return gone()
    refused = next((head for head in heads if head[0] == "error"), None)
    if refused is not None:
        for events in jobs:
            await events.aclose()
        return outcome(state, *refused, endpoint)
    return heads, jobs


def outcome(state: ServerState, kind: str, value: Any, endpoint: str) -> ChatCompletion | Response:
    """A job's end: the finished completion, or the error response (either counted in the metrics of ``endpoint``; a
    client that left is not)."""
    if kind == "gone":
        return gone()
    if kind == "cancelled":
        state.metrics.failed(endpoint, 503)
        return json_response(error_body(SHUTTING_DOWN, kind="server_error"), 503)
    if kind != "done":
        state.metrics.failed(endpoint, status_of(value))
        return error_response(value)
    state.metrics.observe(endpoint, value.usage)
    return value


def stream_failure(state: ServerState, kind: str, value: Any, endpoint: str) -> str:
    """The SSE error event that ends a stream whose request failed or was dropped by the engine (closing) after its
    response began, counted as a failure; a stream that ends without it reads as a finished answer."""
    if kind == "cancelled":
        state.metrics.failed(endpoint, 503)
        return sse(error_body(SHUTTING_DOWN, kind="server_error"))
    state.metrics.failed(endpoint, status_of(value))
    return sse(error_body(str(value), kind="server_error"))
