"""Continuous batching as a service: many requests from many threads through one engine core, stepped on one thread.

:class:`BatchEngine` is the threaded front end of :class:`~prefixcache.engine.core.EngineCore` (which does the
scheduling, batched prefill and decode, stopping and preemption; see :mod:`prefixcache.engine.core` and the admission
policy in :mod:`prefixcache.engine.scheduler`): it checks and queues requests from any thread, runs functions
between steps (:meth:`BatchEngine.call_soon`: snapshot restore, and the copy of a :meth:`BatchEngine.save_snapshot`
whose files a writer thread writes), steps in a background thread or in the caller's, and ends everything on
:meth:`BatchEngine.close`.  The server, ``generate_many`` and the framework adapters that batch run on it; the
runner's serial calls drive the same core with one request.

Thread safety: :meth:`BatchEngine.submit`, :meth:`BatchEngine.call_soon` and ``cancel()`` may be called from any
thread; one thread steps the engine (the background thread after :meth:`BatchEngine.start`, else whoever calls
:meth:`BatchEngine.run_until_idle`).  A request's ``on_token`` callback and :meth:`BatchEngine.call_soon`'s
functions run on that thread, between forwards.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from prefixcache.cache.snapshot import SnapshotSummary
from prefixcache.cache.stats import CacheStats
from prefixcache.cache.tokens import TokenIds
from prefixcache.engine.request import EngineRequest, RequestHandle
from prefixcache.engine.results import TokenLogprob
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.scheduler import POLICIES, admission_order
from prefixcache.engine.snapshot_saver import SnapshotSaver
from prefixcache.engine.speculation import DraftSource
from prefixcache.errors import InvalidArgumentError

__all__ = ["POLICIES", "BatchEngine", "EngineFigures", "RequestHandle"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """What a server's metrics read of an engine at once (:meth:`BatchEngine.figures`): its cache's stats, its
    counts of preemptions and cancellations, and speculation's draft tokens verified and accepted."""

    cache: CacheStats
    preempted_requests: int
    cancelled_requests: int
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class BatchEngine:
    """Runs many requests together on ``runner``'s model and cache (continuous batching with chunked prefill).

    ``max_batch_tokens`` bounds the tokens of one step (decode rows first, one token each, then chunks of prompts
    and of forced answers in admission order); ``max_running`` the requests holding leases at once.  ``policy`` is
    ``"lpm"`` (prefix-aware scheduling, see :mod:`prefixcache.engine.scheduler`) or ``"fcfs"``; ``max_wait_steps`` is
    the fairness bound of ``"lpm"``: steps a request may wait before no later arrival is admitted ahead of it.
    ``speculate="tree"`` has greedy requests verify drafts (from ``drafts``; by default the runner's
    :meth:`~PrefixCachingRunner.tree_drafts`) in their decode rows: see :mod:`prefixcache.engine.speculation`.
    Raises InvalidArgumentError for a bound below 1, an unknown policy or speculate mode.
    """

    def __init__(
        self,
        runner: PrefixCachingRunner,
        *,
        max_batch_tokens: int = 512,
        max_running: int = 32,
        policy: str = "lpm",
        max_wait_steps: int = 32,
        speculate: str = "off",
        drafts: DraftSource | None = None,
    ) -> None:
        if max_batch_tokens is None:
            raise InvalidArgumentError("max_batch_tokens must be a positive int, got None")
        self.runner = runner
        self.core = runner.new_core(
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            policy=policy,
            max_wait_steps=max_wait_steps,
            speculate=speculate,
            drafts=drafts,
        )
        """The engine core this front end steps."""
        self._lock = self.core.lock
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stepping: int | None = None  # the id of the thread inside step(), if any
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._saver = SnapshotSaver(runner, self.call_soon)

    max_batch_tokens = property(lambda self: self.core.max_batch_tokens, doc="Tokens one step may hold.")
    max_running = property(lambda self: self.core.max_running, doc="Requests holding leases at once.")
    policy = property(lambda self: self.core.policy, doc='Admission policy, "lpm" or "fcfs".')
    max_wait_steps = property(lambda self: self.core.max_wait_steps, doc='Fairness bound of "lpm", in steps.')
    steps = property(lambda self: self.core.steps, doc="Batched forwards run.")
    cancelled_requests = property(
        lambda self: self.core.cancelled_requests,
        doc="Requests dropped by ``cancel()`` or :meth:`close` before they finished (their blocks were freed).",
    )
    preempted_requests = property(
        lambda self: self.core.preempted_requests,
        doc="Preemptions: a running request gave its blocks back to wait and resume (once per preemption).",
    )

    @property
    def _waiting(self) -> deque[EngineRequest]:
        return self.core.waiting

    def _admission_order(self, waiting: list[EngineRequest]) -> list[tuple[EngineRequest, int | None]]:
        core = self.core
        return admission_order(waiting, core.cache, core.policy, core.max_wait_steps)

    def submit(
        self,
        prompt_ids: TokenIds,
        sampling: SamplingParams | None = None,
        *,
        namespace: str | None = None,
        request_id: str | None = None,
        priority: int | None = None,
        retain_s: float | None = None,
        on_token: Callable[[int], bool] | None = None,
        forced_tokens: TokenIds | None = None,
        return_logits: bool = False,
        on_logprob: Callable[[TokenLogprob], None] | None = None,
        recompute_prompt: bool = False,
    ) -> RequestHandle:
        """Queue a request; thread-safe.  Checks it as :meth:`PrefixCachingRunner.generate` does
        (:meth:`~prefixcache.engine.checks.RequestChecks.request`) and raises the same errors at once
        (InvalidTokensError, CapacityError, NamespaceError, InvalidArgumentError).  The weights are checked when the
        request is admitted: one changed while it waited moves the runner to a new fingerprint, and the request
        matches only what the new weights computed.

        ``request_id``, ``priority``, ``retain_s``, ``forced_tokens`` and ``return_logits`` mean what they mean for
        :meth:`PrefixCachingRunner.stream` (self-hit accounting; the prompt retained once cached; teacher forcing;
        the prompt's logits in the result); ``recompute_prompt`` uses nothing cached for this request, so that with
        ``return_logits`` every prompt position's logits come back (its prompt is cached for others all the same).
        ``on_token(token_id)`` is called on the engine thread with each generated token; returning True ends the request
        there as ``steps.send("stop")`` ends a runner stream: finish reason ``"stop"``, that token's K/V not computed,
        the prompt and the tokens before it cached.  An exception from it fails the request (its blocks freed, nothing
        cached); a KeyboardInterrupt or SystemExit does too, then reaches the caller of :meth:`run_until_idle` (the
        background thread logs it and serves on).
        With ``sampling.logprobs`` set, ``on_logprob(record)`` gets each sampled token's
        :class:`~prefixcache.engine.results.TokenLogprob` on the engine thread, just before ``on_token`` gets the
        token (its exception fails the request as ``on_token``'s does); the result's ``logprobs`` hold them all.
        Raises InvalidArgumentError for an ``on_token`` or ``on_logprob`` that is not callable, a ``request_id`` that
        is not a str or None, or a closed engine."""
        request = self.runner.checks.request(
            prompt_ids,
            sampling,
            namespace=namespace,
            forced_tokens=forced_tokens,
            return_logits=return_logits,
            recompute_prompt=recompute_prompt,
            request_id=request_id,
            priority=priority,
            retain_s=retain_s,
            on_token=on_token,
            on_logprob=on_logprob,
        )
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("the engine is closed")
            self.core.add(request)  # the condition is reentrant
        return request.handle

    def call_soon(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn()`` on the engine thread before the next step's forward (never during one): for work that reads
        or fills the pool, such as snapshot save and restore.  Thread-safe; the future holds ``fn``'s result or
        exception, or a ``RuntimeError`` when the engine closes first.  Raises
        InvalidArgumentError once the engine is closed."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("the engine is closed")
            self._calls.append((fn, future))
            self._lock.notify_all()
        return future

    def save_snapshot(self, directory: str | os.PathLike[str]) -> Future[SnapshotSummary]:
        """Save what the runner caches (as :meth:`PrefixCachingRunner.save_snapshot`) into the snapshot folder
        ``directory`` without making the requests wait for the disk; returns at once, thread-safe.  The copy is taken
        on the engine thread between two steps (the tree and a memcpy of its blocks), the files are written and
        fsynced on a writer thread while the engine steps on (:mod:`prefixcache.engine.snapshot_saver`: one save at a
        time, a second waits for the first, one into the same folder that has not been copied yet is joined).
        Without :meth:`start`, the copy waits for a :meth:`step`.  The future holds the ``SnapshotSummary``, or the
        error (:class:`~prefixcache.errors.SnapshotWriteError`: the previous version is kept; a ``RuntimeError`` when
        the engine closes before the copy).  :meth:`close` waits for a save being written.  Raises
        InvalidArgumentError for a ``directory`` that is not a path, or once the engine is closed."""
        return self._saver.save(directory)

    def load_snapshot(self, directory: str | os.PathLike[str]) -> Future[Any]:
        """:meth:`PrefixCachingRunner.load_snapshot` of ``directory`` on the engine thread between two steps (as
        :meth:`call_soon`); the future holds its ``SnapshotSummary`` or error.  Raises InvalidArgumentError once the
        engine is closed."""
        return self.call_soon(lambda: self.runner.load_snapshot(directory))

    def evict_all(self) -> Future[Any]:
        """Empty the runner's cache of every unreferenced block on the engine thread between two steps (as
        :meth:`call_soon`).  Raises InvalidArgumentError once the engine is closed."""
        return self.call_soon(self.runner.cache.evict_all)

    def figures(self) -> EngineFigures:
        """The cache's stats and the engine's counters, read now from any thread (an engine process's in one round
        trip).  O(1)."""
        core = self.core
        return EngineFigures(
            self.runner.cache.stats(),
            self.preempted_requests,
            self.cancelled_requests,
            core.drafted_tokens,
            core.accepted_tokens,
        )

    @property
    def num_pending(self) -> int:
        """Requests waiting or running, plus functions queued by :meth:`call_soon`."""
        with self._lock:
            return len(self.core.waiting) + len(self.core.running) + len(self._calls)

    def _busy(self) -> bool:
        return bool(self.core.waiting or self.core.running or self._calls)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is waiting or running (another thread steps the engine); False on timeout.  Raises
        InvalidArgumentError for a ``timeout`` that is not None or a number of seconds (NaN would wait forever), and
        when called on the thread that steps (from ``on_token`` or a :meth:`call_soon` function): the engine cannot
        become idle while its own step waits."""
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout)
        ):
            raise InvalidArgumentError(f"timeout must be None or a number of seconds, got {timeout!r}")
        self._refuse_on_engine_thread("wait_idle()")
        with self._lock:
            return self._lock.wait_for(lambda: not self._busy(), timeout)

    def _refuse_on_engine_thread(self, call: str) -> None:
        if self._stepping == threading.get_ident():
            raise InvalidArgumentError(
                f"{call} called on the thread that steps the engine (from on_token, on_logprob or a call_soon "
                "function) would wait on itself; call it from another thread, or return and let the step end"
            )

    def run_until_idle(self) -> None:
        """Step in the calling thread until no request is waiting or running.  Raises InvalidArgumentError when
        called on the thread that steps (from ``on_token``, ``on_logprob`` or a :meth:`call_soon` function): that
        step holds the engine, so this would wait on itself."""
        self._refuse_on_engine_thread("run_until_idle()")
        while self.step():
            pass

    def start(self) -> None:
        """Step in a background daemon thread from now on (until :meth:`close`)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="prefixcache-batch-engine", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop the background thread after its current step; requests still queued are cancelled.  Called on the
        thread that steps (from an ``on_token`` callback or a :meth:`call_soon` function), it returns at once and
        the current step cancels them as it ends.  The futures of the requests it cancels call back on the thread
        that cancels them, which counts as the stepping thread meanwhile: a step from such a callback raises."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        self._saver.close()
        if self._stepping == threading.get_ident():
            return  # joining this thread, or taking the step lock it holds, would wait forever
        if thread is not None:
            thread.join()
        with self._step_lock:
            self._as_stepper(self._drain)
        self._saver.join()  # after the drain: a save waiting for its copy has failed by now

    def _as_stepper(self, fn: Callable[[], None]) -> None:
        """``fn()`` marked as run by the thread that steps (the caller holds the step lock): the done callbacks of the
        futures it ends run here, and an engine call from one that would wait on this lock raises instead."""
        self._stepping = threading.get_ident()
        try:
            fn()
        finally:
            self._stepping = None

    def _drain(self) -> None:
        """Cancel every waiting and running request and fail the queued calls (the engine is closed); under the step
        lock."""
        for request in self.core.take_all():
            self.core.cancel(request)
        with self._lock:
            calls, self._calls = list(self._calls), deque()
            self._lock.notify_all()
        for _, future in calls:
            # Not CancelledError: asyncio.wrap_future turns that into the awaiting task's own cancellation.
            future.set_exception(RuntimeError("the engine closed before the call ran"))

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._busy():
                    self._lock.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 - a fault in the engine's own code must not strand every request
                logger.exception("a batching step failed; failing the requests it held")
                self._fail_all(error)
            except BaseException:  # noqa: BLE001 - a callback's or model's SystemExit, KeyboardInterrupt...: the step
                # failed and released the requests it concerned; ending the thread would strand all the others
                logger.exception("a request raised a BaseException on the engine thread; serving the others on")

    def _fail_all(self, error: BaseException) -> None:
        """Fail every waiting and running request with ``error`` (their leases released): after a step raised, the
        engine goes on serving new requests instead of leaving these to wait forever on a dead thread."""
        with self._step_lock:
            self._as_stepper(lambda: self._abort_all(error))
            with self._lock:
                self._lock.notify_all()

    def _abort_all(self, error: BaseException) -> None:
        for request in self.core.take_all():
            try:
                self.core.abort(request, error)
            except Exception:  # noqa: BLE001 - fail the rest even if one release fails
                logger.exception("releasing a failed request's lease failed")

    def step(self) -> bool:
        """One scheduling step: run the queued :meth:`call_soon` functions, then one step of the core (drop cancelled
        requests, admit waiting ones, plan the batch, one batched forward, pick tokens, retire finished requests).
        Returns whether any request is still waiting or running.  Raises InvalidArgumentError on the thread that
        steps (from ``on_token``, ``on_logprob`` or a :meth:`call_soon` function), which holds the step."""
        self._refuse_on_engine_thread("step()")
        with self._step_lock:
            self._stepping = threading.get_ident()
            try:
                self._run_calls()
                self.core.step()
                with self._lock:
                    busy = self._busy()
                    if not busy:
                        self._lock.notify_all()  # wake wait_idle()
            finally:
                try:
                    if self._closed:  # close() was called during the step, on this thread or waiting for the lock
                        self._drain()  # still marked as stepping: the futures it cancels call back on this thread
                finally:
                    self._stepping = None
            return busy and not self._closed

    def _run_calls(self) -> None:
        # Each call stays queued while it runs, so wait_idle() and num_pending count it; calls queued meanwhile
        # wait for the next step.
        with self._lock:
            count = len(self._calls)
        for _ in range(count):
            with self._lock:
                fn, future = self._calls[0]
            try:
                if future.set_running_or_notify_cancel():
                    future.set_result(fn())
            except BaseException as error:  # noqa: BLE001 - the caller's error, handed back through its future
                future.set_exception(error)
            finally:
                with self._lock:
                    self._calls.popleft()
