"""A request of the engine: the handle its caller holds (tokens as they come, the result, cancel) and the
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
from prefixcache.engine.logits import LogitsPipeline
from prefixcache.engine.results import GenerationResult, TokenLogprob
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

    def emit(self, token: int) -> None:
        """The engine hands over a new token id (iterating the handle yields it)."""
        self._tokens.put(token)

    def settle(self, result: GenerationResult | None = None, error: BaseException | None = None) -> None:
        """The engine ends the request with ``result`` or ``error``; iteration ends after the tokens emitted."""
        self._tokens.put(_END)
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One request inside the engine core (:class:`~prefixcache.engine.core.EngineCore`): what it asked for, where it
    stands (waiting, running with a lease, or preempted to resume) and what it produced.  Made by
    :meth:`~prefixcache.engine.checks.RequestChecks.request`; the engine's own record.

    Its known tokens are the prompt followed by the forced tokens (teacher forcing) or by the tokens generated so far;
    ``position`` of them have their K/V written.
    """

    prompt: list[int]
    prompt_array: array  # the prompt as the cache stores it, converted once
    sampling: SamplingParams
    user_namespace: str | None
    handle: RequestHandle
    forced: list[int] | None = None  # teacher-forced answer: computed after the prompt, never sampled
    return_logits: bool = False  # keep the float32 logits of the prompt positions prefilled
    recompute_prompt: bool = False  # match nothing at first admission: every prompt position is prefilled
    request_id: str | None = None
    retention: tuple[int, float | None] | None = None
    on_token: Callable[[int], Any] | None = None
    on_logprob: Callable[[TokenLogprob], Any] | None = None  # called with each record, before on_token
    namespace: str = ""  # the tree namespace: the fingerprint at the latest admission and the user's namespace
    submitted_at: float = 0.0
    arrival: int = 0
    waited_steps: int = 0  # steps spent waiting without being admitted (the fairness bound counts these)
    prompt_inserted: bool = False  # the prompt's K/V are in the tree while the request goes on
    live: LiveKV = field(default_factory=LiveKV)
    lease: Lease | None = None
    table: torch.Tensor | None = None  # the lease's block table on the device, made from ``table_source``
    table_source: Any = None  # the lease's block-table array that ``table`` was made from
    picker: LogitsPipeline | None = None  # made at first admission, kept across preemptions
    cached: int = 0  # prompt tokens found cached at first admission (a resumption's hits are not the prompt's)
    copied: int = 0
    host_cached: int = 0
    unresumed: int = 0  # prompt tokens matched but not resumable (a recurrent model's state was not kept there)
    pending_state: Any = None  # a recurrent model's state before the prompt's last token, until the prompt is inserted
    preemptions: int = 0
    position: int = 0  # known tokens whose K/V are written
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per sampled token (sampling.logprobs set)
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # chunks of [tokens, vocab] float32 on the CPU
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per prompt token after a computed row
    logits_until: int = 0  # prompt positions up to which prompt_logits (and prompt_logprobs) hold rows
    awaiting_verdict: bool = False  # a token was sampled; its caller decides whether the request stops there
    external_verdict: bool = False  # the caller, not on_token, decides after each sampled token (serial streams)
    first_token_at: float | None = None
    draft: tuple[int, ...] = ()  # this step's speculative draft, verified in its row after the last generated token
    draft_state: Any = None  # the draft source's own record of this request (its drafting context), kept throughout
    drafted_tokens: int = 0  # draft tokens verified, over the request's steps
    accepted_tokens: int = 0  # of them, accepted (each then stands among ``generated``)

    @property
    def wants_prompt_rows(self) -> bool:
        """Whether every computed prompt position's logits are needed: kept (``return_logits``) or reduced to records
        (``sampling.prompt_logprobs``)."""
        return self.return_logits or self.sampling.prompt_logprobs is not None

    def keep_prompt_rows(self, start: int, end: int, logits: torch.Tensor) -> None:
        """Keep what is asked of the prompt positions ``start .. end - 1`` just computed (``logits``: their rows,
        ``[end - start, vocab]``) that no earlier forward kept (a resumed request computes some again): the float32
        rows (``return_logits``, copied to the CPU) and their records (``sampling.prompt_logprobs``: row p gives
        prompt token p + 1's; the prompt's last row, which predicts a generated token, gives none).  O(rows * vocab).
        """
        lo, hi = max(start, self.logits_until), min(end, len(self.prompt))
        if hi <= lo:
            return
        rows = logits[lo - start : hi - start]
        if self.return_logits:
            self.prompt_logits.append(rows.float().cpu())
        if self.sampling.prompt_logprobs is not None:
            following = self.prompt[lo + 1 : hi + 1]
            self.prompt_logprobs += self.picker.prompt_logprobs(rows[: len(following)], following)
        self.logits_until = hi

    @property
    def answer(self) -> list[int]:
        """The known tokens after the prompt: the forced ones, or those generated so far."""
        return self.forced if self.forced is not None else self.generated

    def sequence_length(self) -> int:
        """Known tokens: the prompt and :attr:`answer`."""
        return len(self.prompt) + len(self.answer)

    def known_tokens(self) -> array:
        """The known tokens (see :meth:`sequence_length`), as the cache stores them."""
        answer = self.answer
        return self.prompt_array + as_token_array(answer) if answer else self.prompt_array

    def num_new_tokens(self) -> int:
        """Tokens the request may add after its prompt: its forced tokens, or ``max_new_tokens``."""
        return len(self.forced) if self.forced is not None else self.sampling.max_new_tokens
