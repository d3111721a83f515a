"""What the server's routes share about engine jobs: the callbacks that turn a request's tokens into stream events, the
event a finished request ends with, how a waiting handler watches for its client leaving, and ``n`` > 1 — several
samples of one prompt, each its own engine request.

``n`` samples are submitted together: the first prefills the prompt and, under prefix-aware admission, the others
wait for it and then find it cached (each computes only the prompt's last position again), so the prompt is
prefilled once.  Sample i uses ``seed + i`` when a seed is given (past the largest seed, ``2**63 - 1``, it wraps to 0),
so it is exactly what a request of that seed alone returns; without a seed each sample draws from its own unseeded
generator.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from prefixcache.serve.protocol import BadRequest
from prefixcache.serve.samples import summed_usage

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "PARSE_OFF_LOOP_BYTES",
    "closing",
    "deliveries",
    "ending",
    "gone",
    "merged_choices",
    "read_body",
    "sample_request_id",
    "sample_seed",
    "unless_gone",
]

T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 32 << 20
"""The largest request body a server reads (32 MiB: a prompt of several million tokens as JSON text); beyond it, 413."""

PARSE_OFF_LOOP_BYTES = 1 << 16
"""Bodies larger than this (64 KiB) are parsed on a worker thread: a small one is parsed faster than a thread hop."""


def deliveries(on_delta: Callable[[Any], None] | None, logprobs: int | None) -> dict[str, Any]:
    """:func:`submit_chat`'s callbacks for a job whose events go to ``on_delta``: each text delta as ``(text, the
    logprob records of the tokens since the previous delta)`` (``()`` when not asked).  On the engine thread."""
    if on_delta is None:
        return {}
    if logprobs is None:
        return {"on_delta": lambda text: on_delta((text, ()))}
    pending: list[Any] = []

    def delta(text: str) -> None:
        records = tuple(pending)
        pending.clear()
        on_delta((text, records))

    return {"on_delta": delta, "on_logprob": pending.append}


def ending(future: Future[Any]) -> tuple[str, Any]:
    """A finished request's event: ``("done", value)``, ``("error", exception)`` or ``("cancelled", None)``."""
    error = future.exception()
    if isinstance(error, CancelledError):
        return "cancelled", None
    return ("error", error) if error is not None else ("done", future.result())


_SEEDS = 2**63
"""Seeds are 0 .. 2**63 - 1 (:class:`~prefixcache.engine.sampling.SamplingParams`)."""


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample ``sample`` (0 for the first) of a request of ``seed``: ``seed + sample`` modulo ``2**63``
    (so a valid seed never makes a sample's invalid); None without one."""
    return None if seed is None else (seed + sample) % _SEEDS


def sample_request_id(request_id: str, sample: int) -> str:
    """The engine request id of sample ``sample``: the request's for the first, ``"{request_id}-{sample}"`` after it,
    so that the samples' shared prompt counts as cache hits, not as one request's own retries (self-hits)."""
    return request_id if sample == 0 else f"{request_id}-{sample}"


def merged_choices(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One response of ``n`` choices from the responses of its ``n`` samples (each with one choice): choice i is sample
    i's, ``index`` i; the usage counts the prompt once (sample 0's prompt and cached tokens) and the completion tokens
    of all samples."""
    body = dict(bodies[0])
    body["choices"] = [{**sample["choices"][0], "index": i} for i, sample in enumerate(bodies)]
    if body.get("usage") is not None:
        body["usage"] = summed_usage([sample["usage"] for sample in bodies])
    return body


async def closing(lines: AsyncIterator[str], events: Any) -> AsyncIterator[str]:
    """``lines``, then close the job's ``events`` however the response ends (finished, failed, or the client gone),
    which cancels the job and frees its blocks."""
    try:
        async for line in lines:
            yield line
    finally:
        await events.aclose()


def gone() -> Response:
    """What a request whose client disconnected answers (nginx's 499); nobody reads it."""
    return Response(status_code=499)


async def client_gone(request: Request) -> None:
    """Return once the client has disconnected: the ASGI ``http.disconnect`` message, read after the body as
    Starlette's ``StreamingResponse`` does (uvicorn never cancels a handler whose client went away)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


WATCH_AFTER_S = 0.05
"""A client is watched for a disconnect only once its answer has taken this long: a watcher costs ~0.4 ms."""


async def unless_gone(request: Request, waiter: Awaitable[T]) -> tuple[bool, T | None]:
    """``(True, waiter's result)``, or ``(False, None)`` when the client disconnects first (``waiter`` is then
    cancelled and awaited, so a job it drives is cancelled before this returns)."""
    task = asyncio.ensure_future(waiter)
    gone = None
    try:
        await asyncio.wait((task,), timeout=WATCH_AFTER_S)
        if task.done():
            return True, task.result()
        gone = asyncio.ensure_future(client_gone(request))
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # this handler was cancelled (uvicorn's shutdown): so is what it waited for
        raise
    finally:
        if gone is not None:
            gone.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes: a ``Content-Length`` above it is refused before anything is read,
    and a body streamed past it (chunked) as soon as it gets there.  Raises ``BadRequest`` with status 413 (OpenAI's
    ``request_too_large``)."""
    too_large = BadRequest(f"the request body is over {limit:,} bytes", None, 413, "request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
