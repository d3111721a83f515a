"""An engine in a process of its own: :class:`EngineProcess` runs a :class:`~prefixcache.engine.batching.BatchEngine`
in a child process and offers the server what it uses of one (``submit``, :func:`~prefixcache.engine.chat.submit_chat`,
snapshots, counters, ``close``).

Why: in one process, the server's event loop and the engine's thread share one GIL.  Every streamed token costs the
loop about 0.1 ms of Python with the GIL held (uvloop's wake-up, the ASGI send chain, the socket write), and the
engine's thread waits for it between its many small tensor operations: a few percent of a small model's token time
(issue 30; ``prefixcache bench serve`` measures it).  In its own process the engine has a GIL of its own; per token it
only pickles the text delta and writes it to a socket (a syscall that gives up its GIL).  vLLM's V1 splits its API
server and its ``EngineCore`` the same way.

What crosses the socket (the child's side is :mod:`prefixcache.engine.process_main`, the messages
:mod:`prefixcache.engine.process_wire`): the parent sends each request as its prompt ids, its :class:`SamplingParams`
(a grammar travels as its source and is rebuilt in the child over the child's own tokenizer, see
:func:`~prefixcache.engine.grammar.register_tokenizer`) and its decoder's arguments; the child runs it exactly as
in-process (``submit_chat``: the stop strings and the detokenizer on the engine thread, so a stop string ends the
request before that token's K/V are computed, as in-process) and sends back each text delta with its logprob
records, then the end.

This module is the parent's proxy: its requests and calls in flight (:mod:`prefixcache.engine.remote_jobs`) and the
receiver thread that ends them; the child's start and exit are :mod:`prefixcache.engine.process_child`, its
heartbeat's watch :mod:`prefixcache.engine.process_watchdog`.

Nothing waits on the child without a bound (issue 44).  The parent writes on a sender thread of its own
(:class:`~prefixcache.engine.outbox.Outbox`): a submit or a cancel only queues its message, so a child that does not
read (stopped, stuck) never holds the caller, a server's event loop included.  A submit does not wait for the
child's answer either: what the child's checks refuse fails the handle's future.  The child's heartbeat tells a
child that is stopped from one that is busy: a watchdog thread that has heard nothing from it for
``answer_timeout_s`` fails every request and call in flight at once with EngineDeadError, and every new one, until
the child is heard again (then it serves on).

A request that failed or was cancelled never runs in the child if the child has not started it: its message, if it
still waits on the sender thread, is taken back unsent (nor is a cancel sent for it), and the cancels of those the
child may have been sent go on a second socket, which the child reads before it admits each request (a cancel that
comes before its request is kept until the request comes, which is then answered cancelled).  So a child stopped with
requests queued for it, continued after they got their 503, reads at most the few already in its socket's buffer and
admits none of them; on the one socket, their cancels came after all of them, and it prefilled them all first.

Thread safety: every method may be called from any thread.  ``on_delta`` and ``on_logprob`` run on the parent's
receiver thread (not the engine's): they must not block, as on the engine thread.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import pickle
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from prefixcache.engine.batching import BatchEngine, EngineFigures
from prefixcache.engine.chat import PreparedChat
from prefixcache.engine.outbox import Outbox
from prefixcache.engine.process_child import ChildProcess
from prefixcache.engine.process_watchdog import Watchdog
from prefixcache.engine.process_wire import NOT_ADMITTED, receive_message, settle
from prefixcache.engine.remote_jobs import RemoteHandle, RemoteJob
from prefixcache.errors import EngineDeadError, InvalidArgumentError

__all__ = ["EngineProcess"]

logger = logging.getLogger(__name__)

HEARTBEAT_MAX_S = 1.0
"""The longest interval between two heartbeats of the child: a quarter of ``answer_timeout_s``, at most this."""

RunnerFactory = Callable[[], Any]
"""Builds the runner in the child: a module-level function (or ``functools.partial`` of one), since it is pickled.
Returns the :class:`~prefixcache.engine.runner.PrefixCachingRunner`, or ``(runner, note)`` with a line of text the
parent gets back as :attr:`EngineProcess.note` (the server's start line says how large the pool is)."""


class _RemoteCache:
    """The parent's view of the child runner's cache: what the server's metrics read."""

    def __init__(self, process: EngineProcess) -> None:
        self._process = process

    def stats(self) -> Any:
        """The child's ``RadixCache.stats()`` (a round trip; raises EngineDeadError once the child is gone)."""
        return self._process.query(_cache_stats)


class EngineProcess:
    """A :class:`~prefixcache.engine.batching.BatchEngine` over the runner ``factory()`` builds, stepping in a child
    process (a fresh interpreter, ``python -c``) so that it never waits for this process's GIL (see the module
    docstring).

    ``max_batch_tokens``, ``max_running``, ``policy`` and ``speculate`` are the engine's.  The constructor returns once
    the child has built its runner and started its engine (seconds: it imports torch and builds the model), or raises
    what the factory raised (its type kept where it pickles), EngineDeadError if the child died first, TimeoutError
    after ``start_timeout_s``, InvalidArgumentError for an ``answer_timeout_s`` that is not a positive number of
    seconds, or for a bad ``speculate``.

    A child that sends nothing, not even its heartbeat, for ``answer_timeout_s`` seconds is taken as stopped: every
    request and call it held fails at once with EngineDeadError (a server answers 503 and ends its streams with an
    error event), and so does every new one until it is heard again.  :meth:`close` ends the child; a child that dies
    fails every request it held and every later call with EngineDeadError.

    ``tokenizer`` is a copy of the child runner's tokenizer (sent back pickled), for the server's prompt rendering,
    tokenization and logprob strings; ``pid`` the child's process id and ``engine_thread_id`` its engine thread's
    native id (``/proc/<pid>/task/<tid>``)."""

    def __init__(
        self,
        factory: RunnerFactory,
        *,
        max_batch_tokens: int = 512,
        max_running: int = 32,
        policy: str = "lpm",
        speculate: str = "off",
        start_timeout_s: float | None = 600.0,
        answer_timeout_s: float = 60.0,
    ) -> None:
        number = isinstance(answer_timeout_s, (int, float)) and not isinstance(answer_timeout_s, bool)
        if not number or not 0 < answer_timeout_s < float("inf"):
            message = f"answer_timeout_s must be a positive number of seconds, got {answer_timeout_s!r}"
            raise InvalidArgumentError(message)
        self.answer_timeout_s = float(answer_timeout_s)
        """How long the child may send nothing (its heartbeat comes every quarter of it, at most every
        :data:`HEARTBEAT_MAX_S`) before it counts as stopped, and the longest :meth:`query` waits for its answer."""
        heartbeat_s = min(HEARTBEAT_MAX_S, self.answer_timeout_s / 4)
        options = {"max_batch_tokens": max_batch_tokens, "max_running": max_running, "policy": policy}
        options["speculate"] = speculate
        self._child = child = ChildProcess(factory, options, heartbeat_s, start_timeout_s)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        """Held from taking a job id to queueing its message, so that the child gets them in the order of their ids
        (it tells a cancel that came before its request from one that came after the request ended)."""
        self._jobs: dict[int, RemoteJob] = {}
        self._ids = itertools.count(1)
        self._dead: EngineDeadError | None = None
        self._silent: EngineDeadError | None = None
        """Set while the child has not been heard for ``answer_timeout_s``: what every request meanwhile fails with."""
        self._closed = False
        self._cancelled_unadmitted = 0
        """Requests cancelled by their holder before the child's engine admitted them."""
        self.tokenizer = child.ready.tokenizer
        self.note = child.ready.note
        self.engine_thread_id = child.ready.engine_thread_id
        self.pid: int = child.pid
        self.cache = _RemoteCache(self)
        self._outbox = Outbox(child.conn, "prefixcache-engine-sender")
        self._cancels = Outbox(child.cancels_conn, "prefixcache-engine-canceller")
        # The watchdog exists before the receiver starts: the receiver tells it of every message it reads.
        self._watchdog = Watchdog(
            child.conn,
            timeout_s=self.answer_timeout_s,
            interval_s=heartbeat_s,
            is_silent=lambda: self._silent is not None,
            on_silent=self._went_silent,
        )
        self._receiver = threading.Thread(target=self._receive, name="prefixcache-engine-receiver", daemon=True)
        self._receiver.start()
        self._watchdog.start()

    # -- requests ---------------------------------------------------------------------------------------------------

    def submit(self, prompt_ids: Any, sampling: Any = None, **options: Any) -> RemoteHandle:
        """Queue a request as :meth:`BatchEngine.submit` does, without per-token callbacks (``on_token`` and
        ``on_logprob`` cannot cross the process boundary: use :meth:`submit_prepared` for a streamed answer).  Returns
        at once, without waiting for the child: what the engine's submit raises there (InvalidTokensError,
        CapacityError, NamespaceError, InvalidArgumentError) fails the handle's future, as its own type.  Raises
        InvalidArgumentError for a callback or a closed engine, EngineDeadError once the child is gone or while it is
        not answering (see the class), or when it has not read :data:`~prefixcache.engine.outbox.MAX_UNSENT_BYTES`
        sent to it.  O(size of the prompt) to pickle it."""
        if options.get("on_token") is not None or options.get("on_logprob") is not None:
            raise InvalidArgumentError("on_token and on_logprob do not cross to an engine process: use submit_chat")
        options.pop("on_token", None)
        options.pop("on_logprob", None)
        # As given, so that the child's checks see what BatchEngine.submit would (a bad type or shape is its
        # InvalidTokensError, not a TypeError here); only an iterator, which does not pickle, is read into a list.
        prompt = list(prompt_ids) if isinstance(prompt_ids, Iterator) else prompt_ids
        return self._start("submit", (prompt, sampling, options), None, None)

    def submit_prepared(
        self,
        prepared: PreparedChat,
        *,
        namespace: str | None = None,
        request_id: str | None = None,
        on_delta: Callable[[str], None] | None = None,
        on_logprob: Callable[[Any], None] | None = None,
    ) -> tuple[RemoteHandle, Future[Any]]:
        """:func:`~prefixcache.engine.chat.submit_chat` in the child (which calls this for an engine process): the
        same text deltas, logprob records (each before the delta its token's text is part of) and
        ``ChatCompletion``.  Returns at once and raises as :meth:`submit`."""
        payload = (prepared.prompt_ids, prepared.sampling, prepared.decoder.arguments, namespace, request_id)
        payload += (on_delta is not None or on_logprob is not None, on_logprob is not None)
        handle = self._start("chat", payload, on_delta, on_logprob)
        return handle, handle.future

    def _start(self, op: str, payload: Any, on_delta: Any, on_logprob: Any) -> RemoteHandle:
        job = RemoteJob(op, Future(), None, on_delta, on_logprob)
        job.handle = handle = RemoteHandle(functools.partial(self._cancel, job), job.future)
        self._send_job(job, payload)
        return handle

    def _send_job(self, job: RemoteJob, payload: Any) -> int:
        """Give ``job`` the next id, register it and queue its message; returns its id.  Raises what
        :meth:`_check_open` raises, and EngineDeadError when the message cannot be queued (the job then left
        unregistered)."""
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            job.job_id = job_id = next(self._ids)
            message = pickle.dumps((job.op, job_id, data), protocol=pickle.HIGHEST_PROTOCOL)
            # Registered and queued under the lock the watchdog fails jobs under: a job it fails is one whose
            # message it can take back.
            with self._lock:
                self._check_open()
                self._jobs[job_id] = job
                try:
                    self._outbox.put(message, job=job_id, bounded=True)
                except EngineDeadError as error:
                    del self._jobs[job_id]
                    raise self._dead or error from None
        return job_id

    def _cancel(self, job: RemoteJob) -> None:
        """A request's cancel (:meth:`RemoteHandle.cancel`): one still waiting to be sent is taken back and ends
        cancelled here; the child is told of one it was sent.  O(1), never waits on the child.  Raises
        EngineDeadError once the connection failed."""
        job_id = job.job_id
        with self._lock:
            if self._jobs.get(job_id) is not job:
                return  # ended, failed already, or never queued: nothing of it runs
            unsent = bool(self._outbox.discard((job_id,)))
            if unsent:
                del self._jobs[job_id]
                self._cancelled_unadmitted += 1
        if unsent:
            settle(job.future, "cancelled", None)
        else:
            self._post_cancels((job_id,))

    def _post_cancels(self, job_ids: tuple[int, ...]) -> None:
        try:
            self._cancels.put(pickle.dumps(job_ids, protocol=pickle.HIGHEST_PROTOCOL))
        except EngineDeadError as error:
            raise self._dead or error from None

    # -- functions in the child -------------------------------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(engine, *args)`` on the child's engine thread between two steps (:meth:`BatchEngine.call_soon`);
        ``fn`` must be a module-level function (it is pickled).  A result that is a ``Future`` is waited for in the
        child.  The future holds the result or the error.  Raises EngineDeadError once the child is gone or while it
        is not answering."""
        return self._run("call", fn, args)

    def query(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """``fn(engine, *args)`` run at once on the child's command thread, not between steps (for reads that the
        engine's own locks make safe: counters, cache stats), and its result.  Raises what ``fn`` raised,
        EngineDeadError once the child is gone, while it is not answering, or when it has not answered within
        ``timeout_s`` (default ``answer_timeout_s``)."""
        timeout_s = self.answer_timeout_s if timeout_s is None else timeout_s
        try:
            return self._run("query", fn, args).result(timeout_s)
        except FutureTimeout:
            raise EngineDeadError(f"the engine process did not answer within {timeout_s} s") from None

    def _run(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Future[Any]:
        future: Future[Any] = Future()
        self._send_job(RemoteJob(op, future), (fn, args))
        return future

    def save_snapshot(self, directory: str | os.PathLike[str]) -> Future[Any]:
        """:meth:`BatchEngine.save_snapshot` in the child (the copy between two steps, the files on its writer)."""
        return self._run("query", BatchEngine.save_snapshot, (directory,))  # as given: the child checks it

    def load_snapshot(self, directory: str | os.PathLike[str]) -> Future[Any]:
        """:meth:`BatchEngine.load_snapshot` in the child (between two steps)."""
        return self._run("query", BatchEngine.load_snapshot, (directory,))

    def evict_all(self) -> Future[Any]:
        """:meth:`BatchEngine.evict_all` in the child (between two steps)."""
        return self._run("query", BatchEngine.evict_all, ())

    @property
    def num_pending(self) -> int:
        """The requests submitted here that have not ended, plus the :meth:`call` functions not yet answered: the
        child engine's ``num_pending`` as this process has heard it, without a round trip (a server's ``/health``
        reads it, whatever the child does).  O(requests in flight).  Raises EngineDeadError once the child is gone or
        while it is not answering, InvalidArgumentError once closed."""
        with self._lock:
            self._check_open()
            return sum(job.op != "query" for job in self._jobs.values())

    preempted_requests = property(lambda self: self.query(getattr, "preempted_requests"), doc="Its preemptions.")

    def figures(self, timeout_s: float | None = None) -> EngineFigures:
        """:meth:`BatchEngine.figures` in the child, in one round trip, its cancellations counted as
        :attr:`cancelled_requests` counts them.  Raises as :meth:`query`."""
        figures = self.query(BatchEngine.figures, timeout_s=timeout_s)
        return dataclasses.replace(figures, cancelled_requests=figures.cancelled_requests + self._cancelled_unadmitted)

    @property
    def cancelled_requests(self) -> int:
        """Requests cancelled before they finished: the child engine's count (a round trip, raising as
        :meth:`query`), plus those cancelled before it admitted them (taken back unsent, or cancelled on their way),
        which it never saw.  Not those failed while the child did not answer."""
        return self.query(getattr, "cancelled_requests") + self._cancelled_unadmitted

    # -- life -------------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Nothing: the child's engine steps from the start (here so that a server starts either engine alike)."""

    @property
    def alive(self) -> bool:
        """Whether the child runs, answers (it was heard within ``answer_timeout_s``) and has not been closed."""
        return self._dead is None and self._silent is None and not self._closed and self._child.running()

    def close(self, timeout_s: float = 30.0) -> None:
        """End the child: its engine closes (requests still queued are cancelled, a snapshot being written finishes)
        and it exits; killed if it has not within ``timeout_s``, or at once when it is not answering (a stopped
        child would never read the close).  Idempotent; never waits on a thread from that thread (a future's
        callback may close it from the receiver or the watchdog)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            silent = self._silent is not None
        if self._dead is None:
            try:
                self._post("close", 0, None)
            except EngineDeadError:
                pass
        self._child.end(timeout_s, at_once=silent)
        self._watchdog.stop()
        for outbox in (self._outbox, self._cancels):
            outbox.close()
            outbox.join(timeout_s)  # ends at once: what it was writing failed when the child exited
        if threading.current_thread() is not self._receiver:
            self._receiver.join(timeout_s)
        self._watchdog.join(timeout_s)
        self._child.close_sockets()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the engine is closed")
        if self._dead is not None:
            raise self._dead
        if self._silent is not None:
            raise self._silent

    def _post(self, op: str, job: int, data: Any) -> None:
        """Queue a message that is never refused for its size (the close); O(1), never waits on the child.  Raises
        EngineDeadError once the connection failed."""
        try:
            self._outbox.put(pickle.dumps((op, job, data), protocol=pickle.HIGHEST_PROTOCOL))
        except EngineDeadError as error:
            raise self._dead or error from None

    # -- the receiver and the child's silence -------------------------------------------------------------------

    def _receive(self) -> None:
        """The receiver thread: every message of the child, in order, to its job."""
        jobs = self._jobs
        while True:
            try:
                kind, job_id, value = receive_message(self._child.conn)
            except (EOFError, OSError):
                break
            self._watchdog.heard()
            if self._silent is not None:
                self._heard_again()
            if kind == "delta":
                job = jobs.get(job_id)
                if job is not None:
                    job.deliver(*value)
            elif kind == "ack":
                if value is None:  # accepted: its deltas and end follow
                    continue
                with self._lock:
                    job = jobs.pop(job_id, None)
                if job is not None:  # else failed already (the child was silent) or its caller gave up on it
                    settle(job.future, "error", value)
            elif kind == "end":
                with self._lock:
                    job = jobs.pop(job_id, None)
                    if job is not None and value == NOT_ADMITTED:
                        self._cancelled_unadmitted += 1
                if job is None:
                    continue
                if job.error is not None:
                    value = ("error", job.error)
                settle(job.future, *value)
            elif kind == "closed":
                break
        code = self._child.exit_code(10)
        dead = EngineDeadError(
            "the engine process was closed" if self._closed else f"the engine process exited (exit code {code})"
        )
        with self._lock:
            self._dead = dead
            pending = list(jobs.values())
            jobs.clear()
        self._watchdog.stop()
        self._outbox.close()
        self._cancels.close()
        if not self._closed:
            logger.error("%s; %d request(s) in flight failed", dead, len(pending))
        for job in pending:
            if not self._closed:
                settle(job.future, "error", dead)
            elif job.handle is not None:  # cancelled by close, as in-process
                settle(job.future, "cancelled", None)
            else:  # a call the child never answered: refused as after close
                settle(job.future, "error", InvalidArgumentError("the engine is closed"))

    def _went_silent(self) -> None:
        """The watchdog found the child silent: fail every job in flight with one EngineDeadError and refuse new ones
        until the child is heard again.  What was not sent of them is never sent; the child is asked to cancel the
        requests it was sent (it does before it admits anything once it runs again)."""
        silent = EngineDeadError(
            f"the engine process did not answer within {self.answer_timeout_s} s (stopped, or stuck with its GIL held)"
        )
        with self._lock:
            if self._closed or self._dead is not None or self._silent is not None:
                return
            self._silent = silent
            pending = list(self._jobs.items())
            self._jobs.clear()
            unsent = self._outbox.discard(job_id for job_id, _ in pending)
        sent = tuple(job_id for job_id, job in pending if job.handle is not None and job_id not in unsent)
        if sent:
            try:
                self._post_cancels(sent)
            except EngineDeadError:
                pass  # the connection failed: the child is gone and the receiver says so
        logger.error("%s; %d request(s) and call(s) in flight failed", silent, len(pending))
        for _, job in pending:
            settle(job.future, "error", silent)

    def _heard_again(self) -> None:
        with self._lock:
            if self._silent is None:
                return
            self._silent = None
        logger.warning("the engine process answers again after %s s of silence or more", self.answer_timeout_s)

    def __repr__(self) -> str:
        return f"EngineProcess(pid={self.pid}, alive={self.alive})"


def _cache_stats(engine: BatchEngine) -> Any:
    return engine.runner.cache.stats()
