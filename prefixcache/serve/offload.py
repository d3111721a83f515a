"""Where a request's own work runs: on the event loop for a small body, on a worker thread for a large one.

The work that grows with a request's body is done by :class:`RequestWork` off the event loop, so the loop goes on
answering ``/health`` and writing every other stream meanwhile.  JSON parsing and checking the fields run on a
worker thread once the body is over :data:`~prefixcache.serve.jobs.PARSE_OFF_LOOP_BYTES` (64 KiB), on the loop
below it, where they cost less than the hop to a thread.  Everything that touches the tokenizer (rendering the chat
template, tokenizing, checking the token ids on submit) runs on one worker thread for every request, large or
small: a Hugging Face fast tokenizer switches its ``split_special_tokens`` state between calls, so two threads
tokenizing at once could encode a user's ``<|im_end|>`` as the special token.  The errors are the same either way:
an exception raised on the worker thread is raised to the handler that awaits it.

One thread is enough: Python runs one thread at a time, so more would not finish the work sooner, only make the
event loop wait longer for its turn.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request

from prefixcache.errors import InvalidArgumentError
from prefixcache.serve.jobs import PARSE_OFF_LOOP_BYTES, read_body
from prefixcache.serve.protocol import BadRequest

__all__ = ["DEFAULT_WORKERS", "RequestWork", "loads_yielding"]

T = TypeVar("T")

DEFAULT_WORKERS = 1
"""Worker threads of a server's request work (more than one only for a tokenizer that is safe on several threads
at once, which :class:`~prefixcache.chat.hf_tokenizer.HFTokenizer` is not)."""


def _int(text: str) -> int:
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def loads_yielding(body: bytes | str) -> Any:
    """``json.loads(body)``, the same value and errors, for a worker thread: the C parser holds Python's lock (the
    GIL) from start to end, ~0.2 s for a million token ids, and the event loop cannot run meanwhile; called back in
    Python for every number and object, it lets the loop in every few milliseconds, at ~2.5x the parser's time."""
    return json.loads(body, parse_int=_int, object_pairs_hook=_object)


class RequestWork:
    """A server's request work: bodies read (at most ``max_request_bytes``, else a 413) and parsed, and whatever
    grows with them run off the event loop on ``workers`` threads (see the module).  Its methods are awaited on the
    event loop; what they run on a thread touches only that request's objects, the tokenizer and the engine's
    thread-safe ``submit``.  :meth:`close` stops the threads.  Raises InvalidArgumentError for a
    ``max_request_bytes`` or ``workers`` that is not a positive int."""

    def __init__(self, max_request_bytes: int, workers: int = DEFAULT_WORKERS) -> None:
        for name, value in (("max_request_bytes", max_request_bytes), ("workers", workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        self.max_request_bytes = max_request_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="prefixcache-request")

    @staticmethod
    def is_large(request: Request) -> bool:
        """Whether ``request``'s parsing and checks run on the worker thread: the body :meth:`read_json` read is
        over ``PARSE_OFF_LOOP_BYTES``.  O(1)."""
        return getattr(request.state, "body_bytes", 0) > PARSE_OFF_LOOP_BYTES

    async def read_json(self, request: Request) -> Any:
        """The request's body parsed as JSON, on a worker thread when it is large.  Raises BadRequest: 413 for a body
        over ``max_request_bytes`` (see :func:`~prefixcache.serve.jobs.read_body`), 400 for one that is not JSON or
        nests too deep to parse."""
        body = await read_body(request, self.max_request_bytes)
        request.state.body_bytes = len(body)
        try:
            return await self.call(request, json.loads if not self.is_large(request) else loads_yielding, body)
        except RecursionError:
            raise BadRequest("the request body nests objects and arrays too deep to parse") from None
        except ValueError:
            raise BadRequest("the request body is not valid JSON") from None

    async def call(self, request: Request, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: at once for a small request, on a worker thread for a large one (:meth:`is_large`); what
        it raises is raised here."""
        if not self.is_large(request):
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def tokenizing(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the worker thread, whatever the request's size: work that touches the tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def submit(self, submit: Callable[[Any], tuple[Any, Future[Any]]], on_delta: Any) -> Any:
        """``submit(on_delta)`` (a job's start: render, tokenize and submit it, returning ``(handle, future)``) on the
        worker thread, as :meth:`tokenizing` runs it.  When the awaiting handler is cancelled (client gone,
        shutdown) while the job is still being submitted, the job is cancelled as soon as it exists, so no job
        outlives its handler."""
        started = self._pool.submit(submit, on_delta)
        try:
            return await asyncio.shield(asyncio.wrap_future(started))
        except asyncio.CancelledError:
            started.add_done_callback(_cancel_started)
            raise

    def close(self, wait: bool = False) -> None:
        """Stop the worker threads once the work queued on them is done (``wait``: block until then); a request
        after it fails (500), as one to the closed engine would."""
        self._pool.shutdown(wait=wait)


def _cancel_started(started: Future[Any]) -> None:
    if not started.cancelled() and started.exception() is None:
        handle, _ = started.result()
        handle.cancel()
