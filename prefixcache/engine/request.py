"""A request of the batching engine: the handle its caller holds (tokens as they come, the result, cancel) and the
record the engine keeps of it while it waits, runs, or waits again after a preemption."""

from __future__ import annotations

import asyncio
import queue
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixcache.cache.radix_cache import Lease
from prefixcache.cache.tokens import as_token_array
from prefixcache.engine.runner import GenerationResult
from prefixcache.engine.sampling import SamplingParams
from prefixcache.models.base import LiveKV

__all__ = ["EngineRequest", "RequestHandle"]

_END = object()


class RequestHandle:
    """A submitted request: iterate it for its token ids as they are produced, ``result()`` (or ``await`` it) for
    the :class:`GenerationResult`, ``cancel()`` to drop it (its blocks and locks are released at the next step)."""

    def __init__(self) -> None:
        self.future: Future[GenerationResult] = Future()
        self._tokens: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cancelled = False

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until done; raises what the request raised, ``concurrent.futures.CancelledError`` if cancelled,
        ``TimeoutError`` after ``timeout`` seconds."""
        return self.future.result(timeout)

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()

    def __iter__(self) -> Iterator[int]:
        while (item := self._tokens.get()) is not _END:
            yield item
        self.future.result()  # re-raise the request's error, if any, after the tokens it produced

    def cancel(self) -> None:
        """Ask the engine to drop the request; harmless once it has finished."""
        self.cancelled = True

    def _emit(self, token: int) -> None:
        self._tokens.put(token)

    def _finish(self, result: GenerationResult | None = None, error: BaseException | None = None) -> None:
        self._tokens.put(_END)
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One request inside a :class:`~prefixcache.engine.batching.BatchEngine`: what it asked for, where it stands
    (waiting, running with a lease, or preempted to resume) and what it produced.  The engine's own record."""

    prompt: list[int]
    sampling: SamplingParams
    namespace: str  # the tree namespace: the runner's fingerprint at admission and the user's namespace
    user_namespace: str | None
    handle: RequestHandle
    submitted_at: float
    prompt_array: array  # the prompt as the cache stores it, converted once
    arrival: int
    waited_steps: int = 0  # steps spent waiting without being admitted (the fairness bound counts these)
    prompt_inserted: bool = False  # the prompt's K/V are in the tree while the request goes on
    live: LiveKV = field(default_factory=LiveKV)
    lease: Lease | None = None
    cached: int = 0  # prompt tokens found cached at first admission (a resumption's hits are not the prompt's)
    copied: int = 0
    host_cached: int = 0
    preemptions: int = 0
    position: int = 0  # tokens of prompt + generated whose K/V are written
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    first_token_at: float | None = None
    request_id: str | None = None
    retention: tuple[int, float | None] | None = None
    on_token: Callable[[int], bool] | None = None

    def sequence_length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def token_at(self, index: int) -> int:
        return self.prompt[index] if index < len(self.prompt) else self.generated[index - len(self.prompt)]

    def known_tokens(self) -> array:
        """The prompt and the tokens generated so far, as the cache stores them."""
        return self.prompt_array + as_token_array(self.generated) if self.generated else self.prompt_array
