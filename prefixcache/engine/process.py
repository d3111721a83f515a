"""An engine in a process of its own: :class:`EngineProcess` runs a :class:`~prefixcache.engine.batching.BatchEngine`
in a child process and offers the server what it uses of one (``submit``, :func:`~prefixcache.engine.chat.submit_chat`,
snapshots, counters, ``close``).

Why: in one process, the server's event loop and the engine's thread share one GIL.  Every streamed token costs the
loop about 0.1 ms of Python with the GIL held (uvloop's wake-up, the ASGI send chain, the socket write), and the
engine's thread waits for it between its many small tensor operations: a few percent of a small model's token time
(issue 30; ``prefixcache bench serve`` measures it).  In its own process the engine has a GIL of its own; per token it
only pickles the text delta and writes it to a socket (a syscall that gives up its GIL).  vLLM's V1 splits its API
server and its ``EngineCore`` the same way.

What crosses the socket (the child's side is :mod:`prefixcache.engine.process_main`): the parent sends each request
as its prompt ids, its :class:`SamplingParams` (a grammar travels as its source and is rebuilt in the child over the
child's own tokenizer, see :func:`~prefixcache.engine.grammar.register_tokenizer`) and its decoder's arguments; the
child runs it exactly as in-process (``submit_chat``: the stop strings and the detokenizer on the engine thread, so
a stop string ends the request before that token's K/V are computed, as in-process) and sends back each text delta
with its logprob records, then the end.  Functions run in the child are module-level ones, passed by reference
(pickle), never closures.  Wire messages are tuples; a request's own arguments are pickled by the parent into bytes,
so one that the child cannot unpickle fails that request alone.

- parent to child: ``(factory, options, heartbeat_s)`` once, then ``("chat" | "submit", job, payload)``,
  ``("call" | "query", job, payload)``, ``("close", 0, None)``, in the order of their job ids;
- parent to child on a second socket, the cancels: a tuple of the job ids of requests to cancel;
- child to parent: ``("ready", info)`` or ``("failed", error)`` once, then ``("ack", job, error)``, ``("delta",
  job, (text, records))``, ``("end", job, (kind, value))``, ``("beat", 0, None)`` every ``heartbeat_s`` seconds and
  ``("closed", 0, None)``; a request cancelled before the child admitted it ends ``("cancelled", "not admitted")``.

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
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from typing import Any

from prefixcache.engine.batching import BatchEngine, EngineFigures
from prefixcache.engine.chat import PreparedChat
from prefixcache.engine.outbox import Outbox
from prefixcache.engine.process_main import CHILD_COMMAND, NOT_ADMITTED, Ready, receive_message, send_message
from prefixcache.errors import EngineDeadError, InvalidArgumentError

__all__ = ["EngineProcess", "RemoteHandle"]

logger = logging.getLogger(__name__)

HEARTBEAT_MAX_S = 1.0
"""The longest interval between two heartbeats of the child: a quarter of ``answer_timeout_s``, at most this."""

RunnerFactory = Callable[[], Any]
"""Builds the runner in the child: a module-level function (or ``functools.partial`` of one), since it is pickled.
Returns the :class:`~prefixcache.engine.runner.PrefixCachingRunner`, or ``(runner, note)`` with a line of text the
parent gets back as :attr:`EngineProcess.note` (the server's start line says how large the pool is)."""


class RemoteHandle:
    """A request running in an :class:`EngineProcess`: ``future`` holds its outcome (the
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


class _Job:
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

    ``max_batch_tokens``, ``max_running`` and ``policy`` are the engine's.  The constructor returns once the child has
    built its runner and started its engine (seconds: it imports torch and builds the model), or raises what the
    factory raised (its type kept where it pickles), EngineDeadError if the child died first, TimeoutError after
    ``start_timeout_s``, InvalidArgumentError for an ``answer_timeout_s`` that is not a positive number of seconds.

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
        self._heartbeat_s = min(HEARTBEAT_MAX_S, self.answer_timeout_s / 4)
        # A fresh interpreter started by its command line, not multiprocessing's spawn: spawn runs the parent's main
        # module again in the child, which fails for a script without a ``__main__`` guard (and for a notebook).
        parent_end, child_end = socket.socketpair()
        cancels_end, child_cancels_end = socket.socketpair()
        environment = dict(os.environ)
        # The child imports from where this process imports, in its order (an empty entry, this process's current
        # folder, made absolute), and from nowhere else: not from its own current folder, which ``python -c`` would
        # put first (CHILD_COMMAND drops it), nor from an empty entry of a PYTHONPATH.
        path = [os.path.abspath(entry) for entry in sys.path]
        environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
        self._process = subprocess.Popen(
            [sys.executable, "-c", CHILD_COMMAND, str(child_end.fileno()), str(child_cancels_end.fileno())],
            pass_fds=(child_end.fileno(), child_cancels_end.fileno()),
            env=environment,
        )
        child_end.close()
        child_cancels_end.close()
        self._conn = Connection(parent_end.detach())
        self._cancels_conn = Connection(cancels_end.detach())
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        """Held from taking a job id to queueing its message, so that the child gets them in the order of their ids
        (it tells a cancel that came before its request from one that came after the request ended)."""
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self._dead: EngineDeadError | None = None
        self._silent: EngineDeadError | None = None
        """Set while the child has not been heard for ``answer_timeout_s``: what every request meanwhile fails with."""
        self._closed = False
        self._cancelled_unadmitted = 0
        """Requests cancelled by their holder before the child's engine admitted them."""
        options = {"max_batch_tokens": max_batch_tokens, "max_running": max_running, "policy": policy}
        try:
            send_message(self._conn, (factory, options, self._heartbeat_s))
            ready = self._first_message(start_timeout_s)
        except BaseException:
            self._process.kill()
            self._process.wait()
            self._conn.close()
            self._cancels_conn.close()
            raise
        self.tokenizer = ready.tokenizer
        self.note = ready.note
        self.engine_thread_id = ready.engine_thread_id
        self.pid: int = self._process.pid
        self.cache = _RemoteCache(self)
        self._heard_at = time.monotonic()
        self._stopping = threading.Event()
        self._outbox = Outbox(self._conn, "prefixcache-engine-sender")
        self._cancels = Outbox(self._cancels_conn, "prefixcache-engine-canceller")
        self._receiver = threading.Thread(target=self._receive, name="prefixcache-engine-receiver", daemon=True)
        self._receiver.start()
        self._watchdog = threading.Thread(target=self._watch, name="prefixcache-engine-watchdog", daemon=True)
        self._watchdog.start()

    def _first_message(self, timeout_s: float | None) -> Ready:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the engine process did not start within {timeout_s} s")
        try:
            kind, value = receive_message(self._conn)
        except (EOFError, OSError):
            code = self._process.wait(10)
            raise EngineDeadError(f"the engine process exited while starting (exit code {code})") from None
        if kind == "failed":
            raise value
        return value

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
        job = _Job(op, Future(), None, on_delta, on_logprob)
        job.handle = handle = RemoteHandle(functools.partial(self._cancel, job), job.future)
        self._send_job(job, payload)
        return handle

    def _send_job(self, job: _Job, payload: Any) -> int:
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

    def _cancel(self, job: _Job) -> None:
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
            _settle(job.future, "cancelled", None)
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
        self._send_job(_Job(op, future), (fn, args))
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
        return self._dead is None and self._silent is None and not self._closed and self._process.poll() is None

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
        try:
            self._process.wait(0 if silent else timeout_s)
        except subprocess.TimeoutExpired:
            if not silent:
                logger.warning("the engine process did not exit within %s s: killed", timeout_s)
            self._process.kill()
            self._process.wait()
        self._stopping.set()
        for outbox in (self._outbox, self._cancels):
            outbox.close()
            outbox.join(timeout_s)  # ends at once: what it was writing failed when the child exited
        for thread in (self._receiver, self._watchdog):
            if threading.current_thread() is not thread:
                thread.join(timeout_s)
        self._conn.close()
        self._cancels_conn.close()

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

    # -- the receiver and the watchdog ------------------------------------------------------------------------------

    def _receive(self) -> None:
        """The receiver thread: every message of the child, in order, to its job."""
        jobs = self._jobs
        while True:
            try:
                kind, job_id, value = receive_message(self._conn)
            except (EOFError, OSError):
                break
            self._heard_at = time.monotonic()
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
                    _settle(job.future, "error", value)
            elif kind == "end":
                with self._lock:
                    job = jobs.pop(job_id, None)
                    if job is not None and value == NOT_ADMITTED:
                        self._cancelled_unadmitted += 1
                if job is None:
                    continue
                if job.error is not None:
                    value = ("error", job.error)
                _settle(job.future, *value)
            elif kind == "closed":
                break
        try:
            code: int | None = self._process.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        dead = EngineDeadError(
            "the engine process was closed" if self._closed else f"the engine process exited (exit code {code})"
        )
        with self._lock:
            self._dead = dead
            pending = list(jobs.values())
            jobs.clear()
        self._stopping.set()
        self._outbox.close()
        self._cancels.close()
        if not self._closed:
            logger.error("%s; %d request(s) in flight failed", dead, len(pending))
        for job in pending:
            if not self._closed:
                _settle(job.future, "error", dead)
            elif job.handle is not None:  # cancelled by close, as in-process
                _settle(job.future, "cancelled", None)
            else:  # a call the child never answered: refused as after close
                _settle(job.future, "error", InvalidArgumentError("the engine is closed"))

    def _watch(self) -> None:
        """The watchdog thread: every heartbeat interval, whether the child has been silent for ``answer_timeout_s``
        (then :meth:`_went_silent`)."""
        while not self._stopping.wait(self._heartbeat_s):
            if self._silent is not None or time.monotonic() - self._heard_at <= self.answer_timeout_s:
                continue
            try:
                unread = self._conn.poll(0)  # sent, but this process's receiver has not had the GIL to read it
            except (OSError, ValueError):
                return  # closed
            if not unread:
                self._went_silent()

    def _went_silent(self) -> None:
        """Fail every job in flight with one EngineDeadError and refuse new ones until the child is heard again.
        What was not sent of them is never sent; the child is asked to cancel the requests it was sent (it does before
        it admits anything once it runs again)."""
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
            _settle(job.future, "error", silent)

    def _heard_again(self) -> None:
        with self._lock:
            if self._silent is None:
                return
            self._silent = None
        logger.warning("the engine process answers again after %s s of silence or more", self.answer_timeout_s)

    def __repr__(self) -> str:
        return f"EngineProcess(pid={self.pid}, alive={self.alive})"


def _settle(future: Future[Any], kind: str, value: Any) -> None:
    # A future its holder cancelled (asyncio.wrap_future cancels it with the task awaiting it) takes no outcome: raising
    # InvalidStateError here would end the receiver thread, and every later call would wait forever.
    try:
        if kind == "done":
            future.set_result(value)
        elif kind == "cancelled":
            future.set_exception(CancelledError())
        else:
            future.set_exception(value)
    except InvalidStateError:
        pass


def _cache_stats(engine: BatchEngine) -> Any:
    return engine.runner.cache.stats()
