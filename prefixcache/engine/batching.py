"""Continuous batching: many requests through one runner's cache and model, one batched forward per step.

Requests join and leave between steps (Orca, OSDI'22; the scheduling of vLLM and SGLang).  Each step runs every
decoding request's next token and, under a token budget, a chunk of each waiting prompt's uncached suffix (chunked
prefill, as in Sarathi and vLLM's ``max_num_batched_tokens``), all in one call of
:func:`~prefixcache.models.base.forward_batch`.  Each request keeps its own :class:`~prefixcache.models.base.LiveKV`
and its own lease on the cache, exactly as :meth:`PrefixCachingRunner.generate` does one at a time, so its tokens
are its serial output (greedy: equal; logits within float rounding).

Prefix-aware scheduling (``policy="lpm"``, the default), after SGLang's longest-prefix-match policy (Zheng et al.,
"SGLang: Efficient Execution of Structured Language Model Programs", 2024):

- Waiting requests are admitted longest cached prefix first (ties in arrival order), so the requests that reuse the
  most run while their prefix is still cached.  Fairness bound: a request that has waited ``max_wait_steps`` steps
  is *due*; due requests are admitted before all others, in arrival order (preempted ones, due at once, first), and
  are never held back (below).  So a later arrival overtakes a request only during the first ``max_wait_steps``
  steps that request waits.
- A request's prompt is inserted into the cache as soon as its prefill ends (:meth:`RadixCache.insert_prefix`), not
  when it finishes: requests admitted while it decodes hit its prompt.
- A waiting request whose prompt shares at least one block more with the prompt of a running request still in
  prefill than the cache holds now is held back until that prefill is inserted, then matched again: N requests
  that arrive together behind one uncached system prompt prefill it once, not N times.

``policy="fcfs"`` is the engine without these: arrival order, no holding back, prompts cached when requests finish.

Admission reserves a request's prompt only; when a running request's next block cannot be had because the others
hold the pool, the latest admitted ones are preempted (recompute preemption, :mod:`prefixcache.engine.preemption`):
each caches what it has computed, frees its blocks and waits at the front of the queue, due, to resume where it
stopped.  Its output is unchanged; ``preempted_requests`` counts them.  Resuming is admission: after a weight
change the resumed request matches nothing of the old weights and recomputes its prompt and tokens with the new ones.

Thread safety: :meth:`BatchEngine.submit`, :meth:`BatchEngine.call_soon` and ``cancel()`` may be called from any
thread; one thread steps the engine (the background thread after :meth:`BatchEngine.start`, else whoever calls
:meth:`BatchEngine.run_until_idle`).  A request's ``on_token`` callback and :meth:`BatchEngine.call_soon`'s
functions run on that thread, between forwards.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np
import torch

from prefixcache.cache.stats import check_request_id
from prefixcache.cache.tokens import TokenIds, as_token_array
from prefixcache.engine.preemption import can_preempt_for, choose_victim
from prefixcache.engine.request import EngineRequest, RequestHandle
from prefixcache.engine.runner import GenerationResult, PrefixCachingRunner, Usage, check_retention
from prefixcache.engine.sampling import SamplingParams, sample_token, sampling_generator
from prefixcache.errors import InvalidArgumentError, OutOfBlocksError
from prefixcache.models.base import BatchRow, forward_batch

logger = logging.getLogger(__name__)
POLICIES = ("lpm", "fcfs")
"""Admission policies: longest cached prefix first with shared prefills (``"lpm"``), or arrival order (``"fcfs"``)."""


class BatchEngine:
    """Runs many requests together on ``runner``'s model and cache (continuous batching with chunked prefill).

    ``max_batch_tokens`` bounds the tokens of one step (decode rows first, one token each, then prefill chunks in
    admission order); ``max_running`` the requests holding leases at once.  ``policy`` is ``"lpm"`` (prefix-aware
    scheduling, see the module docstring) or ``"fcfs"``; ``max_wait_steps`` is the fairness bound of ``"lpm"``: steps
    a request may wait before no later arrival is admitted ahead of it.  Raises InvalidArgumentError for a bound
    below 1 or an unknown policy.
    """

    def __init__(
        self,
        runner: PrefixCachingRunner,
        *,
        max_batch_tokens: int = 512,
        max_running: int = 32,
        policy: str = "lpm",
        max_wait_steps: int = 32,
    ) -> None:
        bounds = (("max_batch_tokens", max_batch_tokens), ("max_running", max_running))
        for name, value in (*bounds, ("max_wait_steps", max_wait_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if policy not in POLICIES:
            raise InvalidArgumentError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.runner = runner
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.policy = policy
        self.max_wait_steps = max_wait_steps
        self._arrivals = itertools.count()
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._lock = threading.Condition()
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stepping: int | None = None  # the id of the thread inside step(), if any
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self.steps = 0
        self.cancelled_requests = 0
        """Requests dropped by ``cancel()`` or :meth:`close` before they finished (their blocks were freed)."""
        self.preempted_requests = 0
        """Preemptions: a running request gave its blocks back to wait and resume (once per preemption)."""

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
    ) -> RequestHandle:
        """Queue a request; thread-safe.  Checks it as :meth:`PrefixCachingRunner.generate` does and raises the same
        errors at once (InvalidTokensError, CapacityError, NamespaceError, InvalidArgumentError).  The weights are
        checked again when the request is admitted: one changed while it waited moves the runner to a new
        fingerprint, and the request matches only what the new weights computed, as at the runner's admission.

        ``request_id``, ``priority`` and ``retain_s`` mean what they mean for :meth:`PrefixCachingRunner.stream`
        (self-hit accounting; the prompt retained once cached).  ``on_token(token_id)`` is called on the engine
        thread with each generated token; returning True ends the request there as ``steps.send("stop")`` ends a
        runner stream: finish reason ``"stop"``, that token's K/V not computed, the prompt and the tokens before it
        cached.  An exception from it fails the request (its blocks freed, nothing cached); a KeyboardInterrupt or
        SystemExit does too, then reaches the caller of :meth:`run_until_idle` (the background thread logs it and
        serves on).  Raises InvalidArgumentError for an ``on_token`` that is not callable or a ``request_id`` that is
        not a str or None."""
        sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InvalidArgumentError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if on_token is not None and not callable(on_token):
            raise InvalidArgumentError(f"on_token must be callable or None, got {type(on_token).__name__}")
        check_request_id(request_id)  # here, not in the background step where the cache would refuse it
        runner = self.runner
        prompt = [int(t) for t in runner._check_tokens(prompt_ids, "prompt")]
        retention = check_retention(priority, retain_s)
        runner._check_capacity(len(prompt) + sampling.max_new_tokens)
        runner._check_weights()
        request = EngineRequest(
            prompt,
            sampling,
            runner.namespace_key(namespace),
            namespace,
            RequestHandle(),
            time.perf_counter(),
            as_token_array(prompt),
            0,
            request_id=request_id,
            retention=retention,
            on_token=on_token,
        )
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("the engine is closed")
            request.arrival = next(self._arrivals)
            self._waiting.append(request)
            self._lock.notify_all()
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

    @property
    def num_pending(self) -> int:
        """Requests waiting or running, plus functions queued by :meth:`call_soon`."""
        with self._lock:
            return len(self._waiting) + len(self._running) + len(self._calls)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is waiting or running (another thread steps the engine); False on timeout.  Raises
        InvalidArgumentError for a ``timeout`` that is not None or a number of seconds (NaN would wait forever), and
        when called on the thread that steps (from ``on_token`` or a :meth:`call_soon` function): the engine cannot
        become idle while its own step waits."""
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout)
        ):
            raise InvalidArgumentError(f"timeout must be None or a number of seconds, got {timeout!r}")
        if self._stepping == threading.get_ident():
            raise InvalidArgumentError("wait_idle() called on the thread that steps the engine would wait on itself")
        with self._lock:
            return self._lock.wait_for(lambda: not (self._waiting or self._running or self._calls), timeout)

    def run_until_idle(self) -> None:
        """Step in the calling thread until no request is waiting or running."""
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
        the current step cancels them as it ends."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        if self._stepping == threading.get_ident():
            return  # joining this thread, or taking the step lock it holds, would wait forever
        if thread is not None:
            thread.join()
        with self._step_lock:
            self._drain()

    def _drain(self) -> None:
        """Cancel every waiting and running request and fail the queued calls (the engine is closed); under the step
        lock."""
        for request in [*self._waiting, *self._running]:
            self._cancel(request)
        with self._lock:
            self._waiting.clear()
            self._running.clear()
            calls, self._calls = list(self._calls), deque()
            self._lock.notify_all()
        for _, future in calls:
            # Not CancelledError: asyncio.wrap_future turns that into the awaiting task's own cancellation.
            future.set_exception(RuntimeError("the engine closed before the call ran"))

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._waiting and not self._running and not self._calls:
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
            with self._lock:
                requests = [*self._waiting, *self._running]
                self._waiting.clear()
            for request in requests:
                try:
                    self._fail(request, error)
                except Exception:  # noqa: BLE001 - fail the rest even if one release fails
                    logger.exception("releasing a failed request's lease failed")
            with self._lock:
                self._running.clear()
                self._lock.notify_all()

    def step(self) -> bool:
        """One scheduling step: drop cancelled requests, admit waiting ones, plan the batch (preempting where the pool
        runs short), run one batched forward, sample, retire finished requests.  Returns whether any request is still
        waiting or running."""
        with self._step_lock:
            self._stepping = threading.get_ident()
            try:
                busy = self._step()
            finally:
                self._stepping = None
                if self._closed:  # close() was called during the step, on this thread or waiting for the lock
                    self._drain()
            return busy and not self._closed

    def _step(self) -> bool:
        self._run_calls()
        self._drop_cancelled()
        self._admit()
        rows, members = self._plan()
        if rows:
            self.steps += 1
            try:
                logits = forward_batch(self.runner.model, rows, self.runner.pool.kv)
            except BaseException as error:  # noqa: BLE001 - the error belongs to the requests, not the engine
                for request in members:
                    self._fail(request, error)
                if not isinstance(error, Exception):
                    raise  # KeyboardInterrupt and the like reach whoever steps, once the requests are released
                logits = []
            for request, row, row_logits in zip(members, rows, logits, strict=False):
                request.position += row.token_ids.numel()
                if request.position == request.sequence_length():
                    self._advance(request, row_logits[-1])
        with self._lock:
            busy = bool(self._waiting or self._running or self._calls)
            if not busy:
                self._lock.notify_all()  # wake wait_idle()
            return busy

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

    def _drop_cancelled(self) -> None:
        with self._lock:
            waiting = [r for r in self._waiting if r.handle.cancelled]
            for request in waiting:
                self._waiting.remove(request)
        for request in waiting + [r for r in self._running if r.handle.cancelled]:
            self._cancel(request)

    def _cancel(self, request: EngineRequest) -> None:
        self.cancelled_requests += 1
        self._fail(request, CancelledError())

    def _admit(self) -> None:
        with self._lock:
            waiting = list(self._waiting)
        if not waiting:
            return
        self._refresh_namespaces(waiting)
        admitted: set[int] = set()
        if len(self._running) < self.max_running:
            for request, cached in self._admission_order(waiting):
                if len(self._running) >= self.max_running:
                    break
                if cached is not None and self._held_back(request, cached):
                    continue
                outcome = self._try_admit(request)
                if outcome is None:
                    break  # running requests hold the pool: wait for them to finish and free it
                admitted.add(id(request))
                with self._lock:
                    self._waiting.remove(request)
        for request in waiting:
            if id(request) not in admitted:
                request.waited_steps += 1

    def _refresh_namespaces(self, waiting: list[EngineRequest]) -> None:
        """Check the weights before admitting: waiting requests move to the current fingerprint's namespace, so
        nothing cached with weights changed (or ``runner.invalidate()``) since their submit is served to them.  A
        preempted request moves too (resuming is admission): it then recomputes its prompt and tokens with the new
        weights, instead of matching what it cached with the old ones or not, as eviction had it.  O(parameters)
        integer reads per step while a request waits."""
        self.runner._check_weights()
        for request in waiting:
            request.namespace = self.runner.namespace_key(request.user_namespace)

    def _admission_order(self, waiting: list[EngineRequest]) -> list[tuple[EngineRequest, int | None]]:
        """``(request, cached tokens)`` in the order to try, the count None where the request may not be held back:
        arrival order under ``"fcfs"``; under ``"lpm"`` the due requests in arrival order, then the others by cached
        prefix, longest first (ties in arrival order).  O(waiting x prompt) C-speed token comparison."""
        if self.policy == "fcfs":
            return [(request, None) for request in waiting]
        due = [(r, None) for r in waiting if r.waited_steps >= self.max_wait_steps]
        cache = self.runner.cache
        others = [
            (r, cache.cached_length(r.prompt_array, r.namespace, for_prefill=True))
            for r in waiting
            if r.waited_steps < self.max_wait_steps
        ]
        others.sort(key=lambda pair: (-pair[1], pair[0].arrival))
        return due + others

    def _held_back(self, request: EngineRequest, cached: int) -> bool:
        """Whether a running request still in prefill will insert a prompt that gives ``request`` (``cached`` tokens
        cached now) at least one block more cached prefix."""
        limit = len(request.prompt) - 1
        for other in self._running:
            if other.namespace != request.namespace or other.prompt_inserted or other.position >= len(other.prompt):
                continue
            shared = min(_common_prefix(request.prompt_array, other.prompt_array), limit)
            if shared - cached >= self.runner.cache.block_size:
                return True
        return False

    def _try_admit(self, request: EngineRequest) -> bool | None:
        """Acquire ``request``'s lease and move it to running (True), or fail it (False), or leave it waiting because
        the pool is held by running requests (None)."""
        cache, pool = self.runner.cache, self.runner.pool
        tokens = request.known_tokens()  # a preempted request resumes: its prompt and what it generated
        try:
            request.lease = cache.acquire(
                tokens,
                request.namespace,
                request_id=request.request_id,
                num_tokens=len(tokens),
                resumed=request.preemptions > 0,
            )
            cache.reserve(request.lease, len(tokens))
        except OutOfBlocksError as error:
            if request.lease is not None:
                cache.release(request.lease)
                request.lease = None
            if self._running:
                return None
            self._fail(request, error)
            return False
        except Exception as error:  # noqa: BLE001 - this request fails, the others go on
            self._fail(request, error)
            return False
        request.position = request.lease.num_cached_tokens
        if request.preemptions == 0:
            request.cached, request.copied = request.position, request.lease.num_copied_tokens
            request.host_cached = request.lease.num_host_tokens
            request.live.capacity = len(request.prompt) + request.sampling.max_new_tokens
            request.generator = sampling_generator(request.sampling, pool.kv.device)
        self._running.append(request)
        return True

    def _plan(self) -> tuple[list[BatchRow], list[EngineRequest]]:
        budget = self.max_batch_tokens
        rows, members = [], []
        decoding = [r for r in self._running if r.position >= len(r.prompt)]
        prefilling = [r for r in self._running if r.position < len(r.prompt)]
        for request in decoding + prefilling:
            if budget <= 0:
                break
            if request not in self._running:
                continue  # preempted to make room for one before it
            end = min(request.sequence_length(), request.position + budget)
            if end > request.lease.capacity_tokens and not self._reserve(request, end, members):
                continue
            ids = [request.token_at(i) for i in range(request.position, end)]
            table = self.runner.pool.block_table_tensor(request.lease.block_table)
            token_ids = torch.tensor(ids, dtype=torch.long, device=self.runner.model.device)
            rows.append(BatchRow(token_ids, request.position, table, request.live))
            members.append(request)
            budget -= end - request.position
        return rows, members

    def _reserve(self, request: EngineRequest, end: int, members: list[EngineRequest]) -> bool:
        """Grow ``request``'s lease to ``end`` tokens, preempting running requests not in ``members`` (latest
        admitted first) while the pool is short; False if ``request`` was preempted itself or failed."""
        while True:
            try:
                self.runner.cache.reserve(request.lease, end)
                return True
            except Exception as error:  # noqa: BLE001 - this request fails or waits, the others go on
                victim = choose_victim(self._running, members, request) if can_preempt_for(error) else None
                if victim is None:
                    self._fail(request, error)
                    return False
                self._preempt(victim)
                if victim is request:
                    return False

    def _preempt(self, request: EngineRequest) -> None:
        """Cache the tokens ``request`` has computed, free its blocks and queue it first, due, to resume."""
        try:
            if request.position:
                self.runner.cache.commit(request.lease, request.known_tokens()[: request.position])
            else:
                self.runner.cache.release(request.lease)
        except Exception:  # noqa: BLE001 - the tokens are only a cache hit to come: recompute them instead
            logger.exception("caching a preempted request's tokens failed; it will recompute them")
            if not request.lease.closed:
                self.runner.cache.release(request.lease)
        self._running.remove(request)
        request.lease = None
        request.live.reset()
        request.preemptions += 1
        request.prompt_inserted = request.position >= len(request.prompt)
        request.waited_steps = self.max_wait_steps
        self.preempted_requests += 1
        logger.debug("preempted a request at %d of %d tokens", request.position, request.sequence_length())
        with self._lock:
            self._waiting.appendleft(request)

    def _advance(self, request: EngineRequest, logits: torch.Tensor) -> None:
        """All known tokens of ``request`` are computed: sample the next one, or finish."""
        sampling = request.sampling
        if sampling.max_new_tokens == 0:
            self._finish(request, "prefill")
            return
        # A request that ends with this token commits its prompt in this same step, before anyone else is admitted:
        # inserting it first would only copy its partial block for nothing.
        if self.policy == "lpm" and not request.prompt_inserted and sampling.max_new_tokens > 1:
            try:
                self.runner.cache.insert_prefix(request.lease, request.prompt_array)
            except Exception as error:  # noqa: BLE001
                self._fail(request, error)
                return
            request.prompt_inserted = True
        token = sample_token(logits, sampling, request.generator)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        request.generated.append(token)
        request.handle._emit(token)
        if request.on_token is not None:
            try:
                stop = request.on_token(token)
            except BaseException as error:  # noqa: BLE001 - the callback's error belongs to its request
                self._fail(request, error)
                if not isinstance(error, Exception):
                    raise  # KeyboardInterrupt and the like reach whoever steps, once the request is released
                return
            if stop:
                self._finish(request, "stop")
                return
        if token in sampling.stop_token_ids:
            self._finish(request, "stop")
        elif len(request.generated) >= sampling.max_new_tokens:
            self._finish(request, "length")

    def _finish(self, request: EngineRequest, reason: str) -> None:
        committed = [request.token_at(i) for i in range(request.position)]
        try:
            insert = self.runner.cache.commit(request.lease, committed)
            if request.retention is not None:
                priority, retain_s = request.retention
                self.runner.cache.retain(request.prompt_array, request.namespace, priority=priority, retain_s=retain_s)
        except Exception as error:  # noqa: BLE001
            self._fail(request, error)
            return
        self._running.remove(request)
        now = time.perf_counter()
        first = request.first_token_at if request.first_token_at is not None else now
        usage = Usage(
            prompt_tokens=len(request.prompt),
            cached_tokens=request.cached,
            prefilled_tokens=len(request.prompt) - request.cached,
            copied_tokens=request.copied,
            generated_tokens=len(request.generated),
            ttft_s=first - request.submitted_at,
            decode_s=now - first,
            host_cached_tokens=request.host_cached,
        )
        request.handle._finish(GenerationResult(tuple(request.generated), reason, usage, None, insert))

    def _fail(self, request: EngineRequest, error: BaseException) -> None:
        if request.lease is not None and not request.lease.closed:
            self.runner.cache.release(request.lease)
        if request in self._running:
            self._running.remove(request)
        if not request.handle.future.done():
            request.handle._finish(error=error)


def _common_prefix(a: array, b: array) -> int:
    """Length of the common prefix of two token arrays (numpy views, no copy)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.frombuffer(a, dtype=np.uint32, count=n) != np.frombuffer(b, dtype=np.uint32, count=n))
    return int(diff[0]) if diff.size else n
