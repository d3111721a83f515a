"""The parent's side of what runs in an engine process: a request's handle, and each request or call in flight."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from prefixcache.errors import EngineDeadError

__all__ = ["RemoteHandle", "RemoteJob"]


class RemoteHandle:
    """A request running in an :class:`~prefixcache.engine.process.EngineProcess`: ``future`` holds its outcome (the
    :class:`~prefixcache.engine.results.GenerationResult`, or ``ChatCompletion`` for a chat; its error, the child's
    refusal of it included; a ``concurrent.futures.CancelledError`` once ``cancel()`` took effect), ``cancel()`` drops
    it (its blocks are freed at the engine's next step; harmless once it has finished).  ``cancel()`` never waits on
    the child: it queues a message, or takes back the request's own if that was not sent yet (its future is then
    cancelled at once)."""

    __slots__ = ("_ask_cancel", "cancelled", "future")

    def __init__(self, ask_cancel: Callable[[], None], future: Future[Any]) -> None:
        self._ask_cancel = ask_cancel
        self.future = future
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if not self.future.done() or self.future.cancelled():  # cancelled by its holder: the child runs it still
            try:
                self._ask_cancel()
            except EngineDeadError:
                pass  # its future fails on its own

    def result(self, timeout: float | None = None) -> Any:
        """Block until done; raises what the request raised."""
        return self.future.result(timeout)


class RemoteJob:
    """A request (``op`` ``"chat"`` or ``"submit"``, with its ``handle`` and callbacks) or a function run in the child
    (``"call"``, ``"query"``), from its queueing until its end message settles ``future``."""

    __slots__ = ("error", "future", "handle", "job_id", "on_delta", "on_logprob", "op")

    def __init__(
        self,
        op: str,
        future: Future[Any],
        handle: RemoteHandle | None = None,
        on_delta: Any = None,
        on_logprob: Any = None,
    ) -> None:
        self.op = op
        self.future = future
        """Its outcome: the request's handle's future, or a call's or query's result."""
        self.handle = handle
        self.on_delta = on_delta
        self.on_logprob = on_logprob
        self.error: BaseException | None = None
        """What a callback raised: the request is cancelled and fails with it, as in-process."""
        self.job_id = 0
        """Its id, given when its message is queued."""

    def deliver(self, text: str, records: tuple[Any, ...]) -> None:
        """A delta of the request: its logprob ``records``, then its ``text``, to its callbacks (on the receiver
        thread).  A callback's exception cancels the request, which then fails with it; later deltas are dropped."""
        if self.error is not None:
            return
        try:
            if self.on_logprob is not None:
                for record in records:
                    self.on_logprob(record)
            if self.on_delta is not None and text:
                self.on_delta(text)
        except BaseException as error:  # noqa: BLE001 - the request's error, a SystemExit too: it must not end the
            self.error = error  # receiver thread (every request would wait forever), as the engine thread serves on
            assert self.handle is not None
            self.handle.cancel()
