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

Speculative decoding (``speculate="tree"``, :mod:`prefixcache.engine.speculation`): a greedy decoding request's row
computes its last token and a draft of up to ``k`` tokens from a :class:`~prefixcache.engine.speculation.DraftSource`
(the drafts take what the step's budget leaves after one token per decoding row, and blocks only where the pool has
them free); the picks from its ``1 + k`` logits rows are taken one by one as decode steps would take them, up to the
first that differs from the draft, and the K/V and blocks of the rejected positions are given back.  Sampled
requests, forced answers, the serial calls and models with recurrent layers decode one token a step.

With ``policy="lpm"`` a request's prompt is inserted into the cache as soon as its prefill ends
(:meth:`RadixCache.insert_prefix`), not when it finishes: requests admitted while it decodes hit its prompt.

The core keeps the queues, the step and each request's way through it; its parts do one job each: the lease of an
admitted request (:mod:`prefixcache.engine.admission`), the rows of a step (:mod:`prefixcache.engine.batch_plan`),
the writes into the tree (:mod:`prefixcache.engine.tree_writes`) and the result record
(:mod:`prefixcache.engine.outcome`).

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
import operator
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import torch

from prefixcache.cache.radix_cache import RadixCache
from prefixcache.engine.admission import admit
from prefixcache.engine.batch_plan import BatchPlanner
from prefixcache.engine.checks import RequestChecks
from prefixcache.engine.outcome import generation_result
from prefixcache.engine.preemption import can_preempt_for, choose_victim
from prefixcache.engine.request import EngineRequest
from prefixcache.engine.scheduler import POLICIES, admission_order, held_back
from prefixcache.engine.speculation import DraftSource, check_speculate, draft_room, speculates
from prefixcache.engine.tree_writes import TreeWrites
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.base import BatchRow, CausalLM, forward_batch, truncate_live

__all__ = ["EngineCore"]

logger = logging.getLogger(__name__)


class EngineCore:
    """Steps requests through ``model`` and ``cache``; ``checks`` name their namespaces at each admission.

    ``max_batch_tokens`` bounds the tokens of one step (decode rows first, one token each, then chunks of prompts
    and of forced answers in admission order; None: no bound, a prompt prefills in one forward); ``max_running``
    the requests holding leases at once.  ``policy`` is ``"lpm"`` (prefix-aware, see
    :mod:`prefixcache.engine.scheduler`) or ``"fcfs"``; ``max_wait_steps`` is the fairness bound of ``"lpm"``.
    ``speculate`` is ``"off"`` or ``"tree"`` (greedy rows verify drafts from ``drafts``, which it then needs; a model
    with recurrent layers never speculates: see :mod:`prefixcache.engine.speculation`).
    Raises InvalidArgumentError for a bound below 1, an unknown policy or speculate mode, or ``"tree"`` without
    ``drafts``.
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
        speculate: str = "off",
        drafts: DraftSource | None = None,
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
        if check_speculate(speculate) != "off" and drafts is None:
            raise InvalidArgumentError(f"speculate={speculate!r} needs a draft source (drafts=)")
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
        self.speculate = "off" if self.recurrent else speculate
        """``"tree"``: greedy decoding rows verify drafts; ``"off"``, always for a model with recurrent layers (its
        state after a rejected draft token could not be rolled back)."""
        self.drafts = drafts if self.speculate != "off" else None
        self.drafted_tokens = 0
        """Draft tokens verified, over every request."""
        self.accepted_tokens = 0
        """Draft tokens accepted (each a generated token that took no forward of its own)."""
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
        self.planner = BatchPlanner(model, cache.pool, recurrent=self.recurrent, state_interval=self.state_interval)
        """Plans each step's batch (:mod:`prefixcache.engine.batch_plan`)."""
        self.writes = TreeWrites(model, cache, recurrent=self.recurrent, state_interval=self.state_interval)
        """A request's writes into the tree (:mod:`prefixcache.engine.tree_writes`)."""

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
            # A lone decoding row on the CPU: its forward's time tells the draft source what a verify costs.
            timed = self._verify_timer(rows, members)
            started = time.perf_counter()
            try:
                logits = forward_batch(self.model, rows, self.pool.kv)
            except BaseException as error:  # noqa: BLE001 - the error belongs to the requests, not the engine
                for request in members:
                    self._fail(request, error)
                if not isinstance(error, Exception):
                    raise
                logits = []
            if timed is not None and logits:
                timed(len(members[0].draft), time.perf_counter() - started)
            for request, row, row_logits in zip(members, rows, logits, strict=False):
                try:
                    if request.draft:
                        self._verify(request, row_logits)
                    else:
                        self._computed(request, row.token_ids.numel(), row_logits)
                except BaseException as error:  # noqa: BLE001 - a pick or tree write fails its request, the others go on
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
                if not self._try_admit(request):
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

    def _try_admit(self, request: EngineRequest) -> bool:
        """Move ``request`` to running once :func:`~prefixcache.engine.admission.admit` took its lease, or fail it:
        True, it left the queue; False when it waits for the running requests to free the pool."""
        try:
            admitted = admit(
                request,
                self.cache,
                device=self.pool.kv.device,
                vocab_size=self.model.vocab_size,
                recurrent=self.recurrent,
                can_wait=bool(self.running),
            )
        except Exception as error:  # noqa: BLE001 - this request fails, the others go on
            self._fail(request, error)
            return True
        if admitted:
            self.running.append(request)
        return admitted

    # ---- the batch -----------------------------------------------------------------------------------------

    def _plan(self) -> tuple[list[BatchRow], list[EngineRequest]]:
        draft = self._draft if self.drafts is not None else None
        return self.planner.plan(self.running, self.max_batch_tokens, self._reserve, draft)

    def _verify_timer(self, rows: list[BatchRow], members: list[EngineRequest]) -> Callable[[int, float], None] | None:
        """The draft source's ``observe`` when this step is one decoding row (its token and draft) on the CPU, where a
        forward's time is its cost (on an accelerator it would be the time of its launch); else None."""
        observe = getattr(self.drafts, "observe", None)
        if observe is None or len(rows) != 1 or self.model.device.type != "cpu":
            return None
        request = members[0]
        if request.forced is not None or rows[0].token_ids.numel() != 1 + len(request.draft):
            return None
        if request.position != request.sequence_length() - 1:
            return None
        return observe

    def _draft(self, request: EngineRequest, max_tokens: int) -> tuple[int, ...]:
        """The draft ``request`` verifies this step (also kept in ``request.draft``), of at most ``max_tokens``: none
        unless it :func:`~prefixcache.engine.speculation.speculates`; cut at the first id outside the vocabulary or
        forbidden by its grammar, and to the blocks its lease holds or the pool has free (a draft evicts nothing and
        preempts no one).  An exception (the draft source's, a grammar's) costs the step its draft, not the request.
        A proposal cut to nothing is reported to the source as a draft of 0 tokens."""
        request.draft = ()
        if not speculates(request):
            return ()
        try:
            limit = min(max_tokens, draft_room(request))
            proposal = tuple(map(operator.index, self.drafts.propose(request, limit)))
            draft = proposal[:limit]  # a source may propose more than it was asked for
            vocab = self.model.vocab_size
            draft = draft[: next((i for i, token in enumerate(draft) if not 0 <= token < vocab), len(draft))]
            draft = draft[: request.picker.draft_prefix(draft)]
            if draft:
                draft = draft[: self._draft_room(request, len(draft))]
            if proposal and not draft:
                self.drafts.verified(request, 0, 0)
        except Exception:  # noqa: BLE001 - drafts are an optimisation: decode one token instead
            logger.exception("drafting failed; decoding one token")
            return ()
        request.draft = draft
        return draft

    def _draft_room(self, request: EngineRequest, num_tokens: int) -> int:
        """Draft tokens (of ``num_tokens``) the lease can address after ``request``'s next token, reserving free
        blocks for them where it holds too few.  A block stays free for each running request (a decode row planned
        after this one may need one): a draft never makes a request wait or be preempted."""
        lease = request.lease
        end = request.position + 1 + num_tokens
        if end > lease.capacity_tokens:
            spare_blocks = max(0, self.pool.num_free_blocks - len(self.running))
            end = min(end, lease.capacity_tokens + spare_blocks * self.pool.block_size)
            try:
                self.cache.reserve(lease, end)
            except Exception:  # noqa: BLE001 - another thread took the free blocks meanwhile
                end = lease.capacity_tokens
        return max(0, min(num_tokens, end - request.position - 1))

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
        self.writes.commit_preempted(request)
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
        """``request``'s row of ``num_tokens`` ran, with these logits (``[1 or num_tokens, vocab]``).  Raises what a
        write into the tree raised (the step then fails the request)."""
        start = request.position
        request.position = end = start + num_tokens
        prompt_length = len(request.prompt)
        if request.wants_prompt_rows and start < prompt_length:
            request.keep_prompt_rows(start, end, logits)
        if self.recurrent and end < prompt_length:
            self.writes.keep_inner_state(request)
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
            self.writes.insert_prompt(request)

    def _synchronize(self) -> None:
        """Wait for the device's queued work, so a time read next is the time of the work, not of its launch."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _emit_forced(self, request: EngineRequest) -> None:
        request.generated = list(request.forced)
        for token in request.generated:
            request.handle.emit(token)
            if request.on_token is not None and not self._call(request, request.on_token, token)[0]:
                return
        request.awaiting_verdict = True
        if not request.external_verdict:
            self.conclude(request)

    def _verify(self, request: EngineRequest, logits: torch.Tensor) -> None:
        """``request``'s row computed its last token and its draft (``logits``: ``[1 + k, vocab]``, row ``i`` after
        draft token ``i - 1``): take its picks in order while each equals the draft token it verifies and the request
        goes on, then cut its live K/V and blocks back to the tokens kept (see :mod:`prefixcache.engine.speculation`).
        Raises what a tree write raised."""
        draft, request.draft = request.draft, ()
        start = request.position
        accepted = 0
        request.drafted_tokens += len(draft)  # counted before a token ends the request: its usage holds them
        self.drafted_tokens += len(draft)
        for i in range(len(draft) + 1):
            request.position = start + i + 1  # the K/V of the tokens before this pick: its own is not computed
            token = request.picker.pick(logits[i])
            agrees = i < len(draft) and token == draft[i]
            accepted += agrees
            request.accepted_tokens += agrees
            self.accepted_tokens += agrees
            self._take(request, token, logits[i])
            if not agrees or request.handle.future.done() or request.handle.cancelled:
                break  # a cancel from a callback: no token after it (the next step drops the request)
        self.drafts.verified(request, len(draft), accepted)
        if not request.handle.future.done() and request.lease is not None:
            truncate_live(self.model, request.live, request.position)
            self.cache.shrink(request.lease, request.sequence_length())

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
            self.writes.insert_prompt(request)
        self._take(request, request.picker.pick(logits), logits)

    def _take(self, request: EngineRequest, token: int, logits: torch.Tensor) -> None:
        """Append ``token``, picked from ``logits[vocab]``, to ``request``: its logprob record, the pipeline's history,
        the handle, the callbacks, then (without an external verdict) whether it ends the request."""
        sampling = request.sampling
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
        try:
            insert = self.writes.commit_finished(request)
        except Exception as error:  # noqa: BLE001
            self._fail(request, error)
            return
        self.running.remove(request)
        request.handle.settle(generation_result(request, reason, insert, time.perf_counter()))

    def _fail(self, request: EngineRequest, error: BaseException) -> None:
        request.draft = ()
        if request.lease is not None and not request.lease.closed:
            self.cache.release(request.lease)
        if request in self.running:
            self.running.remove(request)
        request.awaiting_verdict = False
        if not request.handle.future.done():
            request.handle.settle(error=error)
