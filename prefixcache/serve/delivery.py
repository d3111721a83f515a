"""How a streamed job's events cross from the engine thread to the event loop without slowing the engine.

The engine thread steps every request; what it does per token for a stream is only to append the event to a
:class:`Mailbox` (a deque append, O(1)).  The first event posted since the loop last emptied the mailbox schedules
one ``call_soon_threadsafe`` (a write to the loop's self-pipe, a syscall that gives up the GIL); the others of the
same step ride on that wake-up.  So a step that makes a token for each of ``k`` streams wakes the loop once, not
``k`` times, and the loop hands each event to its job's queue, frames it as SSE and writes it while the engine goes on
with its next forward.  A job's end (its future's callback) goes through the same mailbox, so it always follows the
job's last delta.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from prefixcache.serve.jobs import ending
from prefixcache.serve.offload import RequestWork

__all__ = ["Mailbox", "job_events"]


class Mailbox:
    """Events posted from any thread, delivered in order to their ``asyncio.Queue`` on ``loop``, one loop wake-up per
    batch of posts (see the module docstring).  :meth:`post` is thread-safe and O(1)."""

    __slots__ = ("__weakref__", "_loop", "_posted", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._posted: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[Any], event: Any) -> None:
        """Put ``event`` into ``queue`` on the loop, after every event posted before it; dropped once the loop is
        closed (nobody is listening)."""
        self._posted.append((queue, event))
        if not self._scheduled:
            # Set before the wake-up is scheduled: a post racing this one either sees it (and the delivery it
            # schedules takes both) or schedules a second delivery, which finds nothing or the rest.
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:
                self._posted.clear()

    def _deliver(self) -> None:
        # Cleared before emptying: an event posted from here on schedules its own delivery.
        self._scheduled = False
        posted = self._posted
        while posted:
            queue, event = posted.popleft()
            queue.put_nowait(event)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def _mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The mailbox of ``loop`` (one per loop: a test may run one app under several loops)."""
    mailbox = _MAILBOXES.get(loop)
    if mailbox is None:
        mailbox = _MAILBOXES[loop] = Mailbox(loop)
    return mailbox


async def job_events(
    work: RequestWork, submit: Callable[[Callable[[Any], None]], tuple[Any, Future[Any]]], request: Any = None
) -> AsyncIterator[tuple[str, Any]]:
    """A streamed request's events: its deltas (what ``submit`` hands ``on_delta``: ``(text, logprob records)``), then
    its end (see :func:`~prefixcache.serve.jobs.ending`; a request refused at submit ends with ``"error"`` at once).
    ``submit`` runs on ``work``'s worker thread (:meth:`RequestWork.submit`).  Closing this cancels the request."""
    mailbox = _mailbox(asyncio.get_running_loop())
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    post = mailbox.post

    def on_delta(delta: Any) -> None:  # on the engine thread
        post(events, ("delta", delta))

    try:
        handle, future = await work.submit(submit, on_delta)
    except Exception as error:  # noqa: BLE001 - refused at submit: answered as the request's error
        yield "error", error
        return
    future.add_done_callback(lambda done: post(events, ending(done)))
    try:
        while True:
            kind, value = await events.get()
            yield kind, value
            if kind != "delta":
                return
    finally:
        handle.cancel()
