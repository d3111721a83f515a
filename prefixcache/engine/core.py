"""The engine core: the one implementation of scheduling, prefill, decode, stopping, preemption and the result
record, behind every way a request runs.

Requests join and leave between steps (Orca, OSDI'22; the scheduling of vLLM and SGLang).  Each :meth:`EngineCore.step`
admits waiting requests (:mod:`prefixcache.engine.scheduler` orders them), runs every decoding request's next token
and, under a token budget, a chunk of each admitted prompt's uncached suffix (chunked prefill, as in Sarathi and
vLLM's ``max_num_batched_tokens``), all in one call of :func:`~prefixcache.models.base.forward_batch`, then picks
each finished row's next token (:mod:`prefixcache.engine.logits`) and retires the requests that ended.

Per request: match the longest cached prefix (at most ``len - 1`` prompt tokens: the last prompt token is always
computed, its logits start decoding), lock it, copy the rows of a partially matched block into a private block,
reserve blocks for the rest (evicting unreferenced leaves), prefill the remaining tokens at positions continuing
from the cached length, decode, insert prompt + generated tokens into the tree so the next turn reuses them, unlock.
Each request keeps its own :class:`~prefixcache.models.base.LiveKV` and lease, so its tokens do not depend on what
runs beside it (greedy: equal to running alone; logits within float rounding).  Whatever goes wrong midway (model
error, out of blocks, a callback's exception, a cancel) releases every lock and block the request took, and nothing
it half-wrote is cached.

Request options: teacher forcing (``forced``: the answer is given, computed in one pass after the prompt, finish
reason ``"forced"``), prompt logits (``return_logits``) or their records (``sampling.prompt_logprobs``, made as each
chunk is computed: :meth:`EngineRequest.keep_prompt_rows`), the log-probabilities of the sampled tokens
(``sampling.logprobs``: one record per token, made when it is picked, by :meth:`LogitsPipeline.logprobs`; a resumed
request recomputes the tokens it knows and records only the ones it picks anew), and who decides whether a sampled
token ends the request: its ``on_token`` callback (returning True stops it there, as a stop token would, the token's
K/V not computed) or, with ``external_verdict``, the caller, through :meth:`EngineCore.conclude` before the next step
(the serial generator of :meth:`~prefixcache.engine.runner.PrefixCachingRunner.stream`, which yields the token
first).

With ``policy="lpm"`` a request's prompt is inserted into the cache as soon as its prefill ends
(:meth:`RadixCache.insert_prefix`), not when it finishes: requests admitted while it decodes hit its prompt.

Admission reserves a request's known tokens only; when a running request's next block cannot be had because the
others hold the pool, the latest admitted ones are preempted (recompute preemption,
:mod:`prefixcache.engine.preemption`): each caches what it has computed, frees its blocks and waits at the front of
the queue, due, to resume where it stopped.  Its output is unchanged.  Resuming is admission: after a weight change
the resumed request matches nothing of the old weights and recomputes its prompt and tokens with the new ones.  A
core with one request (the serial calls) never preempts: a shortage fails the request with the cache's error
(PoolBusyError, OutOfBlocksError).

Thread safety: :meth:`EngineCore.add` and a handle's ``cancel()`` may be called from any thread; one thread steps.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
import torch

from prefixcache.cache.radix_cache import RadixCache
from prefixcache.engine.checks import RequestChecks
from prefixcache.engine.logits import LogitsPipeline
from prefixcache.engine.preemption import can_preempt_for, choose_victim
from prefixcache.engine.request import EngineRequest
from prefixcache.engine.results import GenerationResult, Usage
from prefixcache.engine.scheduler import POLICIES, admission_order, held_back
from prefixcache.errors import InvalidArgumentError, OutOfBlocksError
from prefixcache.models.base import BatchRow, CausalLM, forward_batch

__all__ = ["EngineCore"]

logger = logging.getLogger(__name__)


class EngineCore:
    """Steps requests through ``model`` and ``cache``; ``checks`` name their namespaces at each admission.

    ``max_batch_tokens`` bounds the tokens of one step (decode rows first, one token each, then chunks of prompts
    and of forced answers in admission order; None: no bound, a prompt prefills in one forward); ``max_running``
    the requests holding leases at once.  ``policy`` is ``"lpm"`` (prefix-aware, see
    :mod:`prefixcache.engine.scheduler`) or ``"fcfs"``; ``max_wait_steps`` is the fairness bound of ``"lpm"``.
    Raises InvalidArgumentError for a bound below 1 or an unknown policy.
    """

    def __init__(
        self,
        model: CausalLM,
        cache: RadixCache,
        checks: RequestChecks,
        *,
        max_batch_tokens: int | None = 512,
        max_running: int = 32,
        policy: str = "lpm",
        max_wait_steps: int = 32,
        state_interval: int = 0,
    ) -> None:
        if isinstance(state_interval, bool) or not isinstance(state_interval, int) or state_interval < 0:
            raise InvalidArgumentError(f"state_interval must be a non-negative int (tokens), got {state_interval!r}")
        if state_interval % cache.block_size:
            raise InvalidArgumentError(
                f"state_interval ({state_interval} tokens) must be a multiple of the block size ({cache.block_size})"
            )
        bounds = [("max_running", max_running), ("max_wait_steps", max_wait_steps)]
        if max_batch_tokens is not None:
            bounds.insert(0, ("max_batch_tokens", max_batch_tokens))
        for name, value in bounds:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if policy not in POLICIES:
            raise InvalidArgumentError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.model, self.cache, self.pool, self.checks = model, cache, cache.pool, checks
        self.recurrent = bool(getattr(model, "recurrent", False))
        """The model has recurrent layers: its state is snapshot at the end of every prompt and every answer, before
        a prompt's last token (a repeated prompt recomputes that one) and every ``state_interval`` tokens of a
        prompt (0: never), and kept by the cache beside the K/V (:mod:`prefixcache.cache.resume`); requests resume
        only there.  Prefill chunks of such a model end at those positions (vLLM caches Mamba states at block
        boundaries, SGLang's MambaRadixCache on tree nodes)."""
        self.state_interval = state_interval if self.recurrent else 0
        if self.recurrent and cache.max_state_bytes is None:
            raise InvalidArgumentError(
                f"{getattr(model, 'name', type(model).__name__)} has recurrent layers: serve it with a "
                "RadixCache(resume_states=True), which keeps their state snapshots"
            )
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.policy = policy
        self.max_wait_steps = max_wait_steps
        self._in_step = False
        self.lock = threading.Condition()
        """Guards :attr:`waiting`; a front end that steps on another thread waits on it."""
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []  # in admission order; changed by the stepping thread only
        self._arrivals = itertools.count()
        self.steps = 0
        """Batched forwards run."""
        self.cancelled_requests = 0
        """Requests dropped by ``cancel()`` (or a front end closing) before they finished (their blocks were freed)."""
        self.preempted_requests = 0
        """Preemptions: a running request gave its blocks back to wait and resume (once per preemption)."""

    # ---- what a front end calls ----------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Queue a checked request (:meth:`RequestChecks.request`); thread-safe."""
        request.submitted_at = time.perf_counter()
        with self.lock:
            request.arrival = next(self._arrivals)
            self.waiting.append(request)
            self.lock.notify_all()

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        with self.lock:
            return bool(self.waiting or self.running)

    def step(self) -> bool:
        """One step: drop cancelled requests, admit waiting ones, plan the batch (preempting where the pool runs
        short), run one batched forward, pick tokens, retire finished requests.  Returns :meth:`has_work`.  A model's
        or callback's exception fails the requests it concerns (their handles hold it); a BaseException that is not
        an Exception (KeyboardInterrupt) is raised again once they are released.  InvalidArgumentError inside a step."""
        if self._in_step:  # a request's callback stepping again would corrupt the step under way
            raise InvalidArgumentError("EngineCore.step() called from inside a step (a request's callback)")
        self._in_step = True
        try:
            return self._step()
        finally:
            self._in_step = False

    def _step(self) -> bool:
        self._drop_cancelled()
        self._admit()
        rows, members = self._plan()
        if rows:
            self.steps += 1
            try:
                logits = forward_batch(self.model, rows, self.pool.kv)
            except BaseException as error:  # noqa: BLE001 - the error belongs to the requests, not the engine
                for request in members:
                    self._fail(request, error)
                if not isinstance(error, Exception):
                    raise
                logits = []
            for request, row, row_logits in zip(members, rows, logits, strict=False):
                try:
                    self._computed(request, row.token_ids.numel(), row_logits)
                except BaseException as error:  # noqa: BLE001 - a pick's error fails its request, the others go on
                    self._fail(request, error)
                    if not isinstance(error, Exception):
                        raise
        return self.has_work()

    def conclude(self, request: EngineRequest, stop: bool = False) -> None:
        """The caller's verdict on the token(s) ``request`` just produced (``external_verdict`` requests, which
        wait for it): ``stop`` ends it there as a stop token would; else its stop tokens and ``max_new_tokens``
        decide.  A forced request finishes (``"forced"``)."""
        if not request.awaiting_verdict:
            return
        request.awaiting_verdict = False
        if request.forced is not None:
            self._finish(request, "forced")
            return
        reason = request.picker.ends(request.generated[-1], len(request.generated), stop)
        if reason is not None:
            self._finish(request, reason)

    def abort(self, request: EngineRequest, error: BaseException) -> None:
        """End ``request`` now with ``error`` (its blocks and locks released, nothing of it cached), wherever it
        stands; harmless once it has finished."""
        with self.lock:
            if request in self.waiting:
                self.waiting.remove(request)
        self._fail(request, error)

    def cancel(self, request: EngineRequest) -> None:
        """Drop ``request`` as ``cancel()`` does (counted in :attr:`cancelled_requests`); from the stepping thread."""
        self.cancelled_requests += 1
        self._fail(request, CancelledError())

    def take_all(self) -> list[EngineRequest]:
        """Remove every waiting and running request from the core and return them (a front end ends them)."""
        with self.lock:
            requests = [*self.waiting, *self.running]
            self.waiting.clear()
            self.running.clear()
            self.lock.notify_all()
        return requests

    # ---- admission -----------------------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        with self.lock:
            waiting = [r for r in self.waiting if r.handle.cancelled]
            for request in waiting:
                self.waiting.remove(request)
        for request in waiting + [r for r in self.running if r.handle.cancelled]:
            self.cancel(request)

    def _admit(self) -> None:
        with self.lock:
            waiting = list(self.waiting)
        if not waiting:
            return
        self._refresh_namespaces(waiting)
        admitted: set[int] = set()
        if len(self.running) < self.max_running:
            for request, cached in admission_order(waiting, self.cache, self.policy, self.max_wait_steps):
                if len(self.running) >= self.max_running:
                    break
                if cached is not None and held_back(request, cached, self.running, self.cache.block_size):
                    continue
                outcome = self._try_admit(request)
                if outcome is None:
                    break  # running requests hold the pool: wait for them to finish and free it
                admitted.add(id(request))
                with self.lock:
                    self.waiting.remove(request)
        for request in waiting:
            if id(request) not in admitted:
                request.waited_steps += 1

    def _refresh_namespaces(self, waiting: list[EngineRequest]) -> None:
        """Check the weights before admitting: waiting requests move to the current fingerprint's namespace, so
        nothing cached with weights changed (or ``runner.invalidate()``) since their submit is served to them.  A
        preempted request moves too (resuming is admission).  O(parameters) integer reads per step while a request
        waits."""
        self.checks.refresh_weights()
        for request in waiting:
            request.namespace = self.checks.namespace_key(request.user_namespace)

    def _try_admit(self, request: EngineRequest) -> bool | None:
        """Acquire ``request``'s lease and move it to running (True), or fail it (False), or leave it waiting because
        the pool is held by running requests (None)."""
        cache = self.cache
        # A first admission matches the prompt (never into forced tokens); a resumption all it knows, except that one
        # owing prompt logits matches no further than its first missing row: what others cached meanwhile must not
        # skip rows it has not returned yet.
        tokens = request.prompt_array if request.preemptions == 0 else request.known_tokens()
        match = tokens
        if request.preemptions and request.wants_prompt_rows and request.logits_until < len(request.prompt):
            match = tokens[: request.logits_until + 1]
        elif request.preemptions == 0 and request.recompute_prompt:
            match = tokens[:1]  # a match ends one short of the tokens: nothing cached is used
        try:
            request.lease = cache.acquire(
                match,
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
            if self.running:
                return None
            self._fail(request, error)
            return False
        except Exception as error:  # noqa: BLE001 - this request fails, the others go on
            self._fail(request, error)
            return False
        request.position = request.lease.num_cached_tokens
        if self.recurrent:
            request.live.start_state = request.lease.resume_state
        if request.preemptions == 0:
            request.cached, request.copied = request.position, request.lease.num_copied_tokens
            request.unresumed = request.lease.num_matched_tokens - request.position if self.recurrent else 0
            request.host_cached = request.lease.num_host_tokens
            request.logits_until = request.position  # the rows start at the first prefilled position, resumed or not
            request.live.capacity = len(request.prompt) + request.num_new_tokens()
            request.picker = LogitsPipeline(
                request.sampling, self.pool.kv.device, self.model.vocab_size, request.prompt_array
            )
        self.running.append(request)
        return True

    # ---- the batch -----------------------------------------------------------------------------------------

    def _plan(self) -> tuple[list[BatchRow], list[EngineRequest]]:
        budget = self.max_batch_tokens if self.max_batch_tokens is not None else float("inf")
        rows, members = [], []
        # A forced answer is computed as a prompt is, in chunks: it takes what the decode rows leave of the budget,
        # else one long answer admitted first would hold back every decode row for many steps.
        decoding = [r for r in self.running if r.forced is None and r.position >= len(r.prompt)]
        chunked = [r for r in self.running if r.forced is not None or r.position < len(r.prompt)]
        for request in decoding + chunked:
            if budget <= 0:
                break
            if request.awaiting_verdict or request not in self.running:
                continue  # its caller has not decided yet; or preempted to make room for one before it
            known = request.sequence_length()
            if request.forced is not None and request.position < len(request.prompt):
                known = len(request.prompt)  # the prompt in one pass, its forced answer in the next (as served alone)
            end = int(min(known, request.position + budget))
            if self.recurrent and request.position < len(request.prompt):
                end = min(end, self._next_state_point(request))
            if end > request.lease.capacity_tokens and not self._reserve(request, end, members):
                continue
            table = self._block_table(request)
            token_ids = self._token_ids(request, request.position, end)
            wants_logits = request.wants_prompt_rows and request.position < len(request.prompt)
            rows.append(BatchRow(token_ids, request.position, table, request.live, wants_logits))
            members.append(request)
            budget -= end - request.position
        return rows, members

    def _next_state_point(self, request: EngineRequest) -> int:
        """The first position after ``request.position`` where a recurrent model's prefill stops to keep its state:
        the next multiple of ``state_interval`` inside the prompt, else the position before the prompt's last token,
        else the prompt's end."""
        prompt_length = len(request.prompt)
        stops = [prompt_length]
        if request.position < prompt_length - 1:
            stops.append(prompt_length - 1)
        if self.state_interval:
            stops.append((request.position // self.state_interval + 1) * self.state_interval)
        return min(stop for stop in stops if stop > request.position)

    def _block_table(self, request: EngineRequest) -> torch.Tensor:
        """The lease's block table on the device, made again only when the lease's table changed: a reserve makes a
        new array, an insert of the prompt rewrites it in place (and drops the tensor, :meth:`_insert_prompt`)."""
        source = request.lease.block_table
        if request.table is None or request.table_source is not source:
            request.table = self.pool.block_table_tensor(source)
            request.table_source = source
        return request.table

    def _token_ids(self, request: EngineRequest, start: int, end: int) -> torch.Tensor:
        """Known tokens ``start .. end - 1`` of ``request`` as int64 on the model's device (a prompt slice without a
        Python loop: prompts run to tens of thousands of tokens)."""
        prompt_length = len(request.prompt)
        if start >= prompt_length:  # a decode step: one token, no numpy round trip
            answer = request.answer[start - prompt_length : end - prompt_length]
            return torch.tensor(answer, dtype=torch.long, device=self.model.device)
        ids = np.frombuffer(request.prompt_array, dtype=np.uint32)[start : min(end, prompt_length)].astype(np.int64)
        if end > prompt_length:  # a resumed request recomputes its prompt and answer in one chunk
            answer = np.asarray(request.answer[: end - prompt_length], dtype=np.int64)
            ids = np.concatenate([ids, answer])
        return torch.from_numpy(ids).to(self.model.device)

    def _reserve(self, request: EngineRequest, end: int, members: list[EngineRequest]) -> bool:
        """Grow ``request``'s lease to ``end`` tokens, preempting running requests not in ``members`` (latest
        admitted first) while the pool is short; False if ``request`` was preempted itself or failed."""
        while True:
            try:
                self.cache.reserve(request.lease, end)
                return True
            except Exception as error:  # noqa: BLE001 - this request fails or waits, the others go on
                victim = choose_victim(self.running, members, request) if can_preempt_for(error) else None
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
                self.cache.commit(
                    request.lease, request.known_tokens()[: request.position], state=self._state_at(request)
                )
            else:
                self.cache.release(request.lease)
        except Exception:  # noqa: BLE001 - the tokens are only a cache hit to come: recompute them instead
            logger.exception("caching a preempted request's tokens failed; it will recompute them")
            if not request.lease.closed:
                self.cache.release(request.lease)
        self.running.remove(request)
        request.lease = request.table = request.table_source = None
        request.live.reset()
        request.pending_state = None
        request.preemptions += 1
        request.prompt_inserted = request.position >= len(request.prompt)
        request.waited_steps = self.max_wait_steps
        self.preempted_requests += 1
        logger.debug("preempted a request at %d of %d tokens", request.position, request.sequence_length())
        with self.lock:
            self.waiting.appendleft(request)

    # ---- after the forward ---------------------------------------------------------------------------------

    def _computed(self, request: EngineRequest, num_tokens: int, logits: torch.Tensor) -> None:
        """``request``'s row of ``num_tokens`` ran, with these logits (``[1 or num_tokens, vocab]``)."""
        start = request.position
        request.position = end = start + num_tokens
        prompt_length = len(request.prompt)
        if request.wants_prompt_rows and start < prompt_length:
            request.keep_prompt_rows(start, end, logits)
        if self.recurrent and end < prompt_length and not self._keep_inner_state(request):
            return
        if request.forced is None:
            if end == request.sequence_length():
                self._advance(request, logits[-1])
            return
        if end == prompt_length:
            self._prompt_computed(request)
        if end == request.sequence_length():
            self._emit_forced(request)

    def _prompt_computed(self, request: EngineRequest) -> None:
        """A forced request's prompt is computed: its first token's time, and under ``"lpm"`` its prompt cached for
        others while its forced answer runs."""
        if request.first_token_at is None:
            self._synchronize()
            request.first_token_at = time.perf_counter()
        if (self.policy == "lpm" or self.recurrent) and not request.prompt_inserted and request.forced:
            self._insert_prompt(request)

    def _synchronize(self) -> None:
        """Wait for the device's queued work, so a time read next is the time of the work, not of its launch."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _keep_inner_state(self, request: EngineRequest) -> bool:
        """A recurrent model's prefill stopped inside the prompt: keep the state there.  At a multiple of
        ``state_interval`` (a block boundary) the tree takes the prompt so far with it at once; the state before the
        prompt's last token waits for the whole prompt's insert (:meth:`_insert_prompt`), as its block is the one
        the request goes on writing.  False when the insert failed the request."""
        position = request.position
        if position == len(request.prompt) - 1:
            request.pending_state = self._state_at(request)
            return True
        if not self.state_interval or position % self.state_interval:
            return True
        try:
            self.cache.insert_prefix(request.lease, request.prompt_array[:position], state=self._state_at(request))
        except Exception as error:  # noqa: BLE001
            self._fail(request, error)
            return False
        request.table = None  # the insert rewrote the lease's table in place
        return True

    def _state_at(self, request: EngineRequest) -> Any:
        """A recurrent model's state after ``request.position`` tokens, for the cache to keep (a copy), else None:
        the model has no recurrent layers, or the request's live state stands elsewhere."""
        live = request.live
        if not self.recurrent or live.data is None or live.num_tokens != request.position:
            return None
        return self.model.take_state(live)

    def _insert_prompt(self, request: EngineRequest) -> bool:
        try:
            self.cache.insert_prefix(request.lease, request.prompt_array, state=self._state_at(request))
        except Exception as error:  # noqa: BLE001
            self._fail(request, error)
            return False
        request.table = None  # the insert may have rewritten the lease's table in place (blocks shared with the tree)
        request.prompt_inserted = True
        pending, request.pending_state = request.pending_state, None
        if pending is not None:
            try:
                self.cache.put_state(request.lease, len(request.prompt) - 1, pending)
            except Exception as error:  # noqa: BLE001
                self._fail(request, error)
                return False
        return True

    def _emit_forced(self, request: EngineRequest) -> None:
        request.generated = list(request.forced)
        for token in request.generated:
            request.handle.emit(token)
            if request.on_token is not None and not self._call(request, request.on_token, token)[0]:
                return
        request.awaiting_verdict = True
        if not request.external_verdict:
            self.conclude(request)

    def _advance(self, request: EngineRequest, logits: torch.Tensor) -> None:
        """All known tokens of ``request`` are computed: pick the next one, or finish."""
        sampling = request.sampling
        if sampling.max_new_tokens == 0:
            self._synchronize()
            self._finish(request, "prefill")
            return
        # A request that ends with this token commits its prompt in this same step, before anyone else is admitted:
        # inserting it first would only copy its partial block for nothing.
        # A recurrent model's state at the end of the prompt is a resume point worth keeping under any policy.
        inserts = self.policy == "lpm" or self.recurrent
        if inserts and not request.prompt_inserted and sampling.max_new_tokens > 1:
            if not self._insert_prompt(request):
                return
        token = request.picker.pick(logits)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        record = None
        if sampling.logprobs is not None:
            # Here, once per sampled token: a resumed request recomputes its known tokens and only then picks anew.
            record = request.picker.logprobs(logits, token)
            request.logprobs.append(record)
        request.generated.append(token)
        request.picker.accept(token)  # the penalties' history: kept by the pipeline, which outlives a preemption
        request.handle.emit(token)
        if record is not None and request.on_logprob is not None:
            if not self._call(request, request.on_logprob, record)[0]:
                return
        stop = False
        if request.on_token is not None:
            alive, stop = self._call(request, request.on_token, token)
            if not alive:
                return
        request.awaiting_verdict = True
        if not request.external_verdict:
            self.conclude(request, bool(stop))

    def _call(self, request: EngineRequest, callback: Callable[[Any], Any], value: object) -> tuple[bool, object]:
        """``(request still alive, callback(value))``; the callback's exception fails the request."""
        try:
            return True, callback(value)
        except BaseException as error:  # noqa: BLE001 - the callback's error belongs to its request
            self._fail(request, error)
            if not isinstance(error, Exception):
                raise  # KeyboardInterrupt and the like reach whoever steps, once the request is released
            return False, None

    def _finish(self, request: EngineRequest, reason: str) -> None:
        if request.pending_state is not None and not request.prompt_inserted and not self._insert_prompt(request):
            return  # the state before the prompt's last token needs the prompt in the tree before the commit
        try:
            insert = self.cache.commit(
                request.lease, request.known_tokens()[: request.position], state=self._state_at(request)
            )
            if request.retention is not None:
                priority, retain_s = request.retention
                self.cache.retain(request.prompt_array, request.namespace, priority=priority, retain_s=retain_s)
        except Exception as error:  # noqa: BLE001
            self._fail(request, error)
            return
        self.running.remove(request)
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
            unresumed_tokens=request.unresumed,
        )
        logits = None
        if request.return_logits and request.prompt_logits:
            # One chunk (a prompt prefilled in one forward) is returned as is: a copy of [n, vocab] doubles the peak.
            chunks = request.prompt_logits
            logits = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        logprobs = None if request.sampling.logprobs is None else tuple(request.logprobs)
        prompt_logprobs = None if request.sampling.prompt_logprobs is None else tuple(request.prompt_logprobs)
        result = GenerationResult(tuple(request.generated), reason, usage, logits, insert, logprobs, prompt_logprobs)
        request.handle.settle(result)

    def _fail(self, request: EngineRequest, error: BaseException) -> None:
        if request.lease is not None and not request.lease.closed:
            self.cache.release(request.lease)
        if request in self.running:
            self.running.remove(request)
        request.awaiting_verdict = False
        if not request.handle.future.done():
            request.handle.settle(error=error)
